"""Text generation from a single-device model: sampling, and a KV cache (plus the online CMS
state of Hope-attention) for the attention families.

KV cache (model.arch transformer, gated_attention and hope_attention, with RoPE;
model.position=alibi takes the fallback): `cached_forward` runs the model's own submodules
(tok_embeddings, each block's attn_norm, attn.wq/wk/wv/wo, attn.wg for the gate, mlp_norm, mlp or
the CMS levels, the final norm and head) with
RoPE tables from models/layers.py, but keeps every layer's rotated keys and values, so each new
token costs one position instead of the whole prefix. The model classes are untouched: training and
checkpoints are unaffected. The cached path is only taken for exactly those classes (a family that
subclasses TransformerBlock with another forward gets the fallback).

Hope-attention takes the same path: its attention uses the KV cache and every online CMS level
keeps its incremental state (`OnlineLevelState`): the fast weights theta^(c) of the chunk being
read and the inputs of that chunk so far; when a chunk is complete its update is computed with
the training code's own `inner_step` on the whole chunk, so decoding reads exactly the weights a
full forward reads (same chunk boundaries: positions are counted from the start of the sequence).

Fallback (titans and any other family): the full prefix is run through `model(tokens)` for every
new token (the Titans memory's chunked state is not kept between calls yet), which gives the
same tokens at O(length^2) cost.

Sampling: temperature 0 is greedy (argmax); otherwise logits / temperature, then top-k (0 = off)
and top-p (nucleus, 1 = off), drawn with a torch.Generator seeded by `seed`. Generation stops
after max_new_tokens or at a stop id (the tokenizer's EOS).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taper.models.gated_attention import GatedAttention, GatedAttentionBlock, GatedTransformer
from megatron_taper.models.hope_attention import (
    ContinuumLevel,
    HopeAttention,
    HopeAttentionBlock,
    SwiGLUActivations,
    Weights,
    inner_step,
)
from megatron_taper.models.layers import Attention, apply_rope, rope_tables
from megatron_taper.models.transformer import Transformer, TransformerBlock

CACHED_MODELS = (Transformer, GatedTransformer, HopeAttention)
CACHED_BLOCKS = (TransformerBlock, GatedAttentionBlock, HopeAttentionBlock)


@dataclass
class SamplingOptions:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    top_p: float = 1.0  # keep the smallest set whose probability reaches p; 1 = all
    seed: int = 0
    stop_ids: tuple[int, ...] = ()

    def validate(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"--max-new-tokens={self.max_new_tokens} must be >= 0")
        if self.temperature < 0:
            raise ValueError(f"--temperature={self.temperature} must be >= 0")
        if self.top_k < 0:
            raise ValueError(f"--top-k={self.top_k} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p={self.top_p} must be in (0, 1]")


@dataclass
class Generation:
    tokens: list[int]  # the new tokens only
    cached: bool  # whether the KV cache was used
    prefill_s: float  # the prompt's forward
    decode_s: float  # everything after it
    stopped_at_eos: bool = False

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of decoding (the first token comes from the prefill)."""
        return max(len(self.tokens) - 1, 0) / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class OnlineLevelState:
    """One online CMS level while decoding: theta^(c), the weights that read the current chunk
    (w13 [2W, D] and w2 [D, W] until the first update, [B, ...] after), and what that chunk's
    positions so far read: inputs n, activations and outputs y, kept for the update at its end."""

    weights: Weights
    chunk: list[tuple[torch.Tensor, SwiGLUActivations, torch.Tensor]] = field(default_factory=list)
    filled: int = 0

    def read(self, level: ContinuumLevel, n: torch.Tensor) -> torch.Tensor:
        """The level's output for inputs n [B, T, D] at the next T positions; completes chunks."""
        outs = []
        while n.shape[1]:
            take = min(level.period - self.filled, n.shape[1])
            part, n = n[:, :take], n[:, take:]
            acts = SwiGLUActivations.of(part, self.weights[0])
            y = acts.h @ self.weights[1].transpose(-1, -2)  # [B, take, D]
            outs.append(y)
            self.chunk.append((part, acts, y))
            self.filled += take
            if self.filled == level.period:  # the update the full forward makes at this chunk's end
                parts, pieces, ys = zip(*self.chunk)
                acts = SwiGLUActivations(*(torch.cat(t, dim=1) for t in
                                           zip(*((a.s, a.h, a.dh_da) for a in pieces))))  # [B, C, W] each
                self.weights = inner_step(self.weights, torch.cat(parts, dim=1), acts, torch.cat(ys, dim=1),
                                          acts.h.square().sum(-1), F.softplus(level.raw_step))
                self.chunk, self.filled = [], 0
        return torch.cat(outs, dim=1)


@dataclass
class KVCache:
    """Rotated keys and values of every layer: [B, K, max_len, E] each; `length` positions filled.
    For Hope-attention also every block's online CMS levels (None for a level without updates)."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    length: int = 0
    levels: list[list[OnlineLevelState | None]] = field(default_factory=list)

    @classmethod
    def empty(cls, model: Transformer, batch: int, max_len: int) -> KVCache:
        cfg = model.cfg
        param = next(model.parameters())
        shape = (batch, cfg.kv_heads, max_len, cfg.head_dim)
        n = len(model.layers)
        levels = [[OnlineLevelState((torch.cat((level.w1, level.w3)), level.w2)) if level.period else None
                   for level in getattr(block, "cms", ())] for block in model.layers.values()]
        return cls([param.new_empty(shape) for _ in range(n)], [param.new_empty(shape) for _ in range(n)], 0, levels)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0


def supports_kv_cache(model: nn.Module) -> bool:
    """Whether `cached_forward` computes exactly what `model.forward` does (see the module doc)."""
    return (type(model) in CACHED_MODELS and model.cfg.position_encoding == "rope"
            and model.tok_embeddings is not None and model.norm is not None
            and all(type(block) in CACHED_BLOCKS for block in model.layers.values()))


@torch.no_grad()
def cached_forward(model: Transformer, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits [B, T, V] of `tokens` [B, T] at positions cache.length .. cache.length + T - 1,
    attending to the cached prefix; appends their keys and values to the cache."""
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
        h = h + _cached_attention(block.attn, block.attn_norm(h), cos, sin, mask, cache, i)
        if isinstance(block, HopeAttentionBlock):
            for norm, level, state in zip(block.cms_norms, block.cms, cache.levels[i]):
                h = h + (level(norm(h)) if state is None else state.read(level, norm(h)))
        else:
            h = h + block.mlp(block.mlp_norm(h))
    cache.length = start + count
    h = model.norm(h)
    if model.output is not None:
        return model.output(h)
    return h @ model.tok_embeddings.weight.t()


def _cached_attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                      cache: KVCache, layer: int) -> torch.Tensor:
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
    y = y.transpose(1, 2)  # [B, T, H, E]
    if isinstance(attn, GatedAttention):
        y = y * torch.sigmoid(attn.wg(x)).unflatten(-1, (y.shape[2], -1))  # gate [B, T, H, E or 1]
    return attn.wo(y.flatten(2))


def next_token(logits: torch.Tensor, opts: SamplingOptions, generator: torch.Generator) -> torch.Tensor:
    """One token id per row of `logits` [B, V] (greedy, or sampled as the options say): [B]."""
    if opts.temperature == 0:
        return logits.argmax(dim=-1)
    scores = logits.float() / opts.temperature
    if 0 < opts.top_k < scores.shape[-1]:
        kth = torch.topk(scores, opts.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if opts.top_p < 1.0:
        ordered, order = scores.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= opts.top_p  # the mass before a token already reaches p
        ordered = ordered.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, ordered)
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], opts: SamplingOptions, use_cache: bool | None = None
             ) -> Generation:
    """New tokens after `prompt` (one sequence). `use_cache` None: the KV cache where supported."""
    opts.validate()
    if not prompt:
        raise ValueError("the prompt must have at least one token")
    cached = supports_kv_cache(model) if use_cache is None else use_cache
    if cached and not supports_kv_cache(model):
        raise ValueError(f"{type(model).__name__} has no KV-cache path (transformer, gated_attention, "
                         "hope_attention only)")
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(opts.seed)
    step = _cached_steps(model, prompt, opts, device) if cached else _full_steps(model, prompt, device)
    out, stopped = [], False
    started = time.perf_counter()
    logits = next(step)  # the prompt's forward: logits of the last position [1, V]
    prefill = time.perf_counter() - started
    while len(out) < opts.max_new_tokens:
        token = int(next_token(logits, opts, generator)[0])
        out.append(token)
        if token in opts.stop_ids:
            stopped = True
            break
        if len(out) < opts.max_new_tokens:
            logits = step.send(token)
    return Generation(out, cached, prefill, time.perf_counter() - started - prefill, stopped)


def _cached_steps(model: Transformer, prompt: list[int], opts: SamplingOptions, device: torch.device):
    """Generator: yields the last logits [1, V] of the prompt, then of each token sent to it."""
    cache = KVCache.empty(model, 1, len(prompt) + opts.max_new_tokens)
    logits = cached_forward(model, torch.tensor([prompt], device=device), cache)
    while True:
        token = yield logits[:, -1]
        logits = cached_forward(model, torch.tensor([[token]], device=device), cache)


def _full_steps(model: nn.Module, prompt: list[int], device: torch.device):
    """As _cached_steps, recomputing the whole sequence for every token."""
    ids = list(prompt)
    while True:
        logits = model(torch.tensor([ids], device=device))
        token = yield logits[:, -1]
        ids.append(token)
