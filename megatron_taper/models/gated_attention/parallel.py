"""Gated Attention's block tensor-parallel plan (parallel/tp/plan.py runs it). Torch-free at module level."""
from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_taper.models.transformer.parallel import tp_plan_transformer_block

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig
    from megatron_taper.models.gated_attention.model import GatedAttentionBlock
    from megatron_taper.parallel.tp.plan import TPBuilder


def tp_plan_gated_attention_block(block: GatedAttentionBlock, prefix: str, cfg: ModelConfig, tp: TPBuilder) -> None:
    """As the Transformer's; the gate W_g (head-major rows) is split by head like wq."""
    tp_plan_transformer_block(block, prefix, cfg, tp)
    per_head = block.attn.wg.weight.shape[0] // cfg.n_heads  # head_dim (elementwise) or 1 (headwise)
    tp.column(block.attn, "wg", f"{prefix}.attn", tp.head_rows(cfg.n_heads, per_head))
