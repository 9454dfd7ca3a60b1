"""The Transformer block's tensor-parallel plan (parallel/tp/plan.py runs it). Torch-free at module level."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig
    from megatron_taper.models.transformer.model import TransformerBlock
    from megatron_taper.parallel.tp.plan import TPBuilder


def tp_plan_transformer_block(block: TransformerBlock, prefix: str, cfg: ModelConfig, tp: TPBuilder) -> None:
    """Norms replicated; attention split by heads; a dense MLP's width split in units of
    model.taper.multiple (uneven when the width does not divide), a mixture of experts replicated."""
    tp.replicated(block.attn_norm, f"{prefix}.attn_norm")
    tp.replicated(block.mlp_norm, f"{prefix}.mlp_norm")
    tp.attention(block.attn, f"{prefix}.attn", cfg.n_heads, cfg.kv_heads, cfg.rope_theta)
    block.attn.first_head = tp.rank * (cfg.n_heads // tp.tp)  # ALiBi slopes follow the global head index
    tp.mlp(block.mlp, f"{prefix}.mlp", cfg.taper.multiple)
