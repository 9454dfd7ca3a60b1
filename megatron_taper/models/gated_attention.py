"""Gated Attention (Qiu et al. 2025, arXiv 2505.06708): a sigmoid gate on each head's output.

    Y  = SDPA(q, k, v)                 per head, before the output projection   [B, S, H, E]
    Y' = Y * sigmoid(X W_g)            X: the normalised block input             [B, S, D]
    out = wo(Y')

`model.gated.gate`: elementwise (W_g: D -> H*E, one gate per head dimension) or headwise
(W_g: D -> H, one gate per head). The gate has no bias. Everything else is the tapered
Transformer; the gate's output dimension is head-major, so a tensor-parallel plan shards it by
head exactly like `wq`.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from megatron_taper.cost.block import Cost, Split, attention_cost, swiglu_cost
from megatron_taper.models.cards import GATED_ATTENTION
from megatron_taper.models.decoding import kv_decoder
from megatron_taper.models.layers import Attention
from megatron_taper.models.spec import FamilySpec
from megatron_taper.models.transformer import Transformer, TransformerBlock, tp_plan_transformer_block

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig
    from megatron_taper.parallel.tp_plan import TPBuilder


class GatedAttention(Attention):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, gate: str):
        super().__init__(d_model, n_heads, n_kv_heads, head_dim)
        self.wg = nn.Linear(d_model, n_heads * (head_dim if gate == "elementwise" else 1), bias=False)

    def project_out(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        g = torch.sigmoid(self.wg(x)).unflatten(-1, (y.shape[2], -1))  # [B, S, H, E or 1]
        return self.wo((y * g).flatten(2))


class GatedAttentionBlock(TransformerBlock):
    def build_attention(self, cfg: ModelConfig) -> nn.Module:
        return GatedAttention(cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.gated.gate)


class GatedTransformer(Transformer):
    block_class = GatedAttentionBlock


def gate_width(cfg: ModelConfig) -> int:
    return cfg.n_heads * (cfg.head_dim if cfg.gated.gate == "elementwise" else 1)


def gated_attention_layer_cost(cfg: ModelConfig, width: int, causal: bool = True) -> Cost:
    """The Transformer's block with the gate W_g as one more projection of the normalised input;
    besides the gate's output, wo's input is then the gated product Y' (H*E per token), not Y."""
    gated_product = Cost(0, 0.0, tp_params=Split(), act=Split(heads=cfg.n_heads * cfg.head_dim),
                         op_act=Split())  # elementwise: recomputed under op-level checkpointing
    return attention_cost(cfg, causal, extra_outputs=gate_width(cfg)) + gated_product + swiglu_cost(cfg, width)


def tp_plan_gated_attention_block(block: GatedAttentionBlock, prefix: str, cfg: ModelConfig, tp: TPBuilder) -> None:
    """As the Transformer's; the gate W_g (head-major rows) is split by head like wq."""
    tp_plan_transformer_block(block, prefix, cfg, tp)
    per_head = block.attn.wg.weight.shape[0] // cfg.n_heads  # head_dim (elementwise) or 1 (headwise)
    tp.column(block.attn, "wg", f"{prefix}.attn", tp.head_rows(cfg.n_heads, per_head))


SPECS = (FamilySpec(card=GATED_ATTENTION, build=GatedTransformer, layer_cost=gated_attention_layer_cost,
                    tp_block_plan=tp_plan_gated_attention_block, context_parallel=True,
                    decoder=functools.partial(kv_decoder, block_class=GatedAttentionBlock)),)
