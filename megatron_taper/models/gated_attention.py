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

import torch
from torch import nn

from megatron_taper.config import ModelConfig
from megatron_taper.flops import Cost, swiglu_cost
from megatron_taper.models.layers import Attention
from megatron_taper.models.transformer import Transformer, TransformerBlock


class GatedAttention(Attention):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, gate: str):
        super().__init__(d_model, n_heads, n_kv_heads, head_dim)
        self.wg = nn.Linear(d_model, n_heads * (head_dim if gate == "elementwise" else 1), bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        y = self.attend(x, cos, sin)  # [B, S, H, E]
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
    d, h, k, e, s = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.seq_len
    matmul = d * h * e + 2 * d * k * e + h * e * d + d * gate_width(cfg)
    context = (s + 1) / 2 if causal else s
    # saved for backward: norm input, q, k, v, attention output, gate
    acts = 2 * (d + h * e + 2 * k * e + h * e + d + gate_width(cfg))
    attn = Cost(matmul + d, 2 * matmul + 4 * h * e * context, acts)
    mlp = swiglu_cost(cfg, width)
    return Cost(attn.params + mlp.params, attn.flops + mlp.flops, attn.act_bytes + mlp.act_bytes)
