"""Gated Attention's block cost terms (cost/block.py): the Transformer's plus the gate. Torch-free."""
from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_taper.cost.block import Cost, Split, attention_cost, swiglu_cost

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig


def gate_width(cfg: ModelConfig) -> int:
    return cfg.n_heads * (cfg.head_dim if cfg.gated.gate == "elementwise" else 1)


def gated_attention_layer_cost(cfg: ModelConfig, width: int, causal: bool = True) -> Cost:
    """The Transformer's block with the gate W_g as one more projection of the normalised input;
    besides the gate's output, wo's input is then the gated product Y' (H*E per token), not Y."""
    gated_product = Cost(0, 0.0, tp_params=Split(), act=Split(heads=cfg.n_heads * cfg.head_dim),
                         op_act=Split())  # elementwise: recomputed under op-level checkpointing
    return attention_cost(cfg, causal, extra_outputs=gate_width(cfg)) + gated_product + swiglu_cost(cfg, width)
