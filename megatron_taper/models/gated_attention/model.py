"""Gated Attention (Qiu et al. 2025, arXiv 2505.06708): a sigmoid gate on each head's output.

    Y  = SDPA(q, k, v)                 per head, before the output projection   [B, S, H, E]
    Y' = Y * sigmoid(X W_g)            X: the normalised block input             [B, S, D]
    out = wo(Y')

`model.gated.gate`: elementwise (W_g: D -> H*E, one gate per head dimension) or headwise
(W_g: D -> H, one gate per head). The gate has no bias. Everything else is the tapered
Transformer (with `doc_start`, attention restricted to each token's document: models/layers.py);
the gate's output dimension is head-major, so a tensor-parallel plan shards it by head exactly like `wq`.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from megatron_taper.models.decoding import kv_decoder
from megatron_taper.models.layers import Attention
from megatron_taper.models.transformer.model import Transformer, TransformerBlock

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig


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


decoder = functools.partial(kv_decoder, block_class=GatedAttentionBlock)
