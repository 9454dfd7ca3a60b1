"""Llama-style decoder whose blocks each get their own (tapered) MLP width.

    tokens [B, S] -> tok_embeddings -> blocks 0..L-1 -> norm -> output -> logits [B, S, V]

Positions: RoPE, or ALiBi with `model.position=alibi` (Press et al. 2022: no rotation; each head
adds -2^(-8h/H) * distance to its scores, models/layers.py), which is what the tree LM's
length-extrapolation benchmark compares against (docs/tree_lm.md).

model.moe: the blocks from model.moe.first_dense on hold a mixture of experts as their MLP
(models/moe.py), each expert of the width the taper gives that layer (taper.py); config.py admits
it for this family and Gated Attention (whose blocks are these with a gate), the blocks of the
other families that build on this class take no `moe`.

Blocks live in a ModuleDict keyed by their global index, so a pipeline stage can drop the
blocks, the embedding, or the head it does not own and keep the same parameter names; forward
then takes hidden states [B, S, D] instead of tokens and returns hidden states when the head is
gone. This file is single-device code: parallelism is applied from outside. Context parallelism
sets `context` (here and on every Attention) to a sequence split: the S tokens this module then
sees are a slice of a longer sequence, and RoPE angles come from their true positions.
Packed documents (data.document_mask): forward's `doc_start` restricts every block's attention to
each token's document (models/layers.py Attention); without it, attention is causal over the window.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from megatron_taper.models.decoding import kv_decoder
from megatron_taper.models.init import init_parameters, init_tensor
from megatron_taper.models.layers import Attention, RMSNorm, rope_tables, rope_tables_at
from megatron_taper.models.moe import build_mlp
from megatron_taper.taper import layer_widths, moe_layers

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, mlp_width: int, moe: bool = False):
        """`moe`: the MLP is a mixture of experts of width `mlp_width` each (models/moe.py)."""
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = self.build_attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = build_mlp(cfg, mlp_width, moe)

    def build_attention(self, cfg: ModelConfig) -> nn.Module:
        return Attention(cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.position_encoding)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc_start: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, doc_start=doc_start)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    block_class = TransformerBlock

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.mlp_widths = layer_widths(cfg)  # an MoE layer's: the width of each of its experts
        self.context = None  # a context-parallel sequence split (parallel/cp/split.py), or None
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleDict(
            {str(i): self.block_class(cfg, width, moe=True) if moe else self.block_class(cfg, width)
             for i, (width, moe) in enumerate(zip(self.mlp_widths, moe_layers(cfg)))}
        )
        self.norm: RMSNorm | None = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output: nn.Linear | None = (None if cfg.tie_embeddings
                                         else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False))

    def init_value(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """The initial value of parameter `name` of full shape `shape` (models/init.py's rule)."""
        return init_tensor(name, shape, seed, self.cfg.init_std, self.cfg.n_layers)

    def init_weights(self, seed: int) -> None:
        """Fill every parameter of this (materialised, unsharded) model through init_value."""
        init_parameters(self, seed)

    def run_blocks(self, h: torch.Tensor, doc_start: torch.Tensor | None = None) -> torch.Tensor:
        """This module's blocks in order on hidden states [B, S, D]; doc_start [B, S] (or None)
        goes to every block as a keyword (a block without document support is never handed one)."""
        if self.context is None:
            cos, sin = rope_tables(h.shape[1], self.cfg.head_dim, self.cfg.rope_theta, h.device)
        else:
            cos, sin = rope_tables_at(self.context.positions(h.shape[1], h.device), self.cfg.head_dim,
                                      self.cfg.rope_theta)
        for block in self.layers.values():
            h = block(h, cos, sin) if doc_start is None else block(h, cos, sin, doc_start=doc_start)
        return h

    def forward(self, x: torch.Tensor, doc_start: torch.Tensor | None = None) -> torch.Tensor:
        """x: tokens [B, S] (when this module holds the embedding) or hidden states [B, S, D];
        doc_start: None, or [B, S] bool, True where a document begins (data.document_mask: each
        token attends only inside its document; models/documents.py)."""
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        h = self.run_blocks(h) if doc_start is None else self.run_blocks(h, doc_start=doc_start)
        if self.norm is None:
            return h
        h = self.norm(h)
        if self.output is not None:
            return self.output(h)
        if self.cfg.tie_embeddings and self.tok_embeddings is not None:
            return h @ self.tok_embeddings.weight.t()
        return h


decoder = functools.partial(kv_decoder, block_class=TransformerBlock)
