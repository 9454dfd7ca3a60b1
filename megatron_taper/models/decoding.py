"""Incremental decoding with a KV cache for stacks of pre-norm attention blocks (single device).

`KVDecoder` runs a model's own submodules (tok_embeddings, each block's attn_norm and attn
(wq/wk/wv, then `attn.project_out`, which Gated Attention overrides with its gate), the block's
feed-forward part, the final norm and head) with the RoPE tables of models/layers.py, but keeps
every layer's rotated keys and values, so each new token costs one position instead of the whole
prefix. The model classes are untouched: training and checkpoints are unaffected.

A family opts in through its FamilySpec.decoder hook (models/spec.py), a function
(model, batch, max_len) -> decoder or None, usually `kv_decoder` with the block class whose
forward it reproduces exactly, and where the block's feed-forward part keeps state of its own
(Hope-attention's online CMS levels), the functions that make and step that state.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taper.models.layers import apply_rope, rope_tables


def mlp_feedforward(block: nn.Module, h: torch.Tensor, state: Any) -> torch.Tensor:
    """The TransformerBlock's second half: h + mlp(mlp_norm(h)) (no state)."""
    return h + block.mlp(block.mlp_norm(h))


@dataclass
class KVCache:
    """Rotated keys and values of every layer: [B, K, max_len, E] each; `length` positions filled."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    length: int = 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0


class KVDecoder:
    """Each call: logits [B, T, V] of `tokens` [B, T] at positions length .. length + T - 1,
    attending to the cached prefix; their keys and values are appended to the cache."""

    def __init__(self, model: nn.Module, batch: int, max_len: int,
                 feedforward: Callable[[nn.Module, torch.Tensor, Any], torch.Tensor] = mlp_feedforward,
                 block_state: Callable[[nn.Module], Any] = lambda block: None):
        cfg = model.cfg
        param = next(model.parameters())
        shape = (batch, cfg.kv_heads, max_len, cfg.head_dim)
        n = len(model.layers)
        self.model, self.feedforward = model, feedforward
        self.cache = KVCache([param.new_empty(shape) for _ in range(n)], [param.new_empty(shape) for _ in range(n)])
        self.block_states = [block_state(block) for block in model.layers.values()]

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        model, cache = self.model, self.cache
        start, count = cache.length, tokens.shape[1]
        if start + count > cache.capacity:
            raise ValueError(f"the KV cache holds {cache.capacity} positions, {start + count} are needed")
        cfg = model.cfg
        h = model.tok_embeddings(tokens)  # [B, T, D]
        cos, sin = rope_tables(start + count, cfg.head_dim, cfg.rope_theta, h.device)
        cos, sin = cos[start:], sin[start:]  # [T, E/2]
        # new position i (absolute start + i) may attend to absolute positions 0 .. start + i
        mask = torch.ones(count, start + count, dtype=torch.bool, device=h.device).tril(diagonal=start)
        for i, block in enumerate(model.layers.values()):
            h = h + self._attention(block.attn, block.attn_norm(h), cos, sin, mask, i)
            h = self.feedforward(block, h, self.block_states[i])
        cache.length = start + count
        h = model.norm(h)
        if model.output is not None:
            return model.output(h)
        return h @ model.tok_embeddings.weight.t()

    def _attention(self, attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   mask: torch.Tensor, layer: int) -> torch.Tensor:
        cache = self.cache
        bsz, count, _ = x.shape
        start, e = cache.length, attn.head_dim
        q = apply_rope(attn.wq(x).view(bsz, count, -1, e), cos, sin).transpose(1, 2)  # [B, H, T, E]
        k = apply_rope(attn.wk(x).view(bsz, count, -1, e), cos, sin).transpose(1, 2)  # [B, K, T, E]
        v = attn.wv(x).view(bsz, count, -1, e).transpose(1, 2)  # [B, K, T, E]
        cache.keys[layer][:, :, start:start + count] = k
        cache.values[layer][:, :, start:start + count] = v
        keys = cache.keys[layer][:, :, :start + count]  # [B, K, start + T, E]
        values = cache.values[layer][:, :, :start + count]
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=q.shape[1] != keys.shape[1])
        return attn.project_out(y.transpose(1, 2), x)  # y: [B, T, H, E]


def kv_decoder(model: nn.Module, batch: int, max_len: int, block_class: type,
               feedforward: Callable[[nn.Module, torch.Tensor, Any], torch.Tensor] = mlp_feedforward,
               block_state: Callable[[nn.Module], Any] = lambda block: None) -> KVDecoder | None:
    """A KVDecoder when it computes exactly what `model.forward` does: RoPE positions, embeddings
    and final norm on this model (not a pipeline stage), and every block exactly `block_class`
    (a subclass may have another forward); None otherwise (generation then recomputes the prefix)."""
    if (model.cfg.position_encoding != "rope" or model.tok_embeddings is None or model.norm is None
            or any(type(block) is not block_class for block in model.layers.values())):
        return None
    return KVDecoder(model, batch, max_len, feedforward, block_state)
