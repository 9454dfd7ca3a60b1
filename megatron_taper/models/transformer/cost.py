"""The Transformer block's cost terms (cost/block.py): attention plus its tapered SwiGLU. Torch-free."""
from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_taper.cost.block import Cost, attention_cost, swiglu_cost

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig


def transformer_layer_cost(cfg: ModelConfig, width: int, causal: bool = True) -> Cost:
    return attention_cost(cfg, causal) + swiglu_cost(cfg, width)
