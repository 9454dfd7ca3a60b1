"""Memory Caching (Behrouz et al., arXiv 2602.24281): recurrent memories whose capacity grows
with the sequence by caching the memory state at the end of every segment.

Two families, each a stack of blocks `x = x + MC(norm(x)); x = x + SwiGLU_w(norm(x))` (the MLP
has this layer's tapered width w):
    linear_memory   base = LinearMemory (memory_caching/linear_memory.py, gated linear attention)
    deep_memory     base = Titans' NeuralMemory (models/titans/; its options in model.titans)

Memory Caching over a base (options in model.memory_caching): the sequence is cut into segments
of `segment` tokens (S); the base recurrence runs inside each segment (chunked as the base is);
the state M^(i) at the end of segment i is cached. With `write_mode` checkpoint a segment starts
from the previous segment's final state (the recurrence continues), with independent from the
base's initial state (each segment its own compressor). At token t of segment s, with the online
state M^(s)_t (after writing t) and the cached M^(i), i < s:
    none      y_t = M_t(q_t) over the whole sequence (the base; `segment` is not used)
    residual  y_t = M^(s)_t(q_t) + sum_{i<s} M^(i)(q_t)
    grm       y_t = g^(s)_t M^(s)_t(q_t) + sum_{i<s} g^(i)_t M^(i)(q_t),
              g_t = softmax_i <u_t, kbar_i>, u_t = W_u x_t per head, kbar_i = the mean of the keys
              of segment i; for the online segment the mean of its keys up to t (no look-ahead)
    soup      y_t = M~_t(q_t) with the parameters mixed, M~_t = g^(s)_t M^(s)_t + sum_i g^(i)_t M^(i):
              the cached memories are mixed per token, the online one enters each memory layer as
              g^(s)_t (r M^(s)_t) through the base's read hook (ReadMix), so the online state
              itself is never materialised; for a linear memory this equals grm (a test checks it),
              and the linear memory computes it as grm
    ssc       grm over the online state and the `top_k` cached segments of the highest scores
              <u_t, kbar_i> (per token and head; the others get weight 0); the reads of all cached
              segments are computed and the unselected ones discarded (dense, grm's cost)
With one segment (S >= L) every variant is its base: its only weight is softmax of one score, 1.
No Python loop runs over segments where it can be avoided (`scan_segments`): the linear memory
scans all segments at once, the deep memory continuing segments of whole chunks in one scan and
independent ones folded into the batch (soup over the deep memory, which mixes the cached states
into each segment's reads, and segments that are not whole chunks still run one by one); every
token's weights and its reads of every cached state are computed at once, a state the token may
not read yet weighted 0. So cached reads cost O(L^2 / S) per sequence, twice the triangle's
(every token reads the n - 1 cached states); the cost model (memory_caching/cost.py
`memory_caching_layer_cost`) counts exactly the matmuls of model.py.

Tensor parallelism splits everything by head (scores, gammas and reads are per head), through
Titans' `tp_plan_memory` (memory_caching/parallel.py); W_u is column-parallel like wq. Context
parallelism (the mixer's `context`): each rank's slice is whole segments and starts from the state
the slices before it hand over (memory_caching/cp.py: a prefix for the linear memory, a chain for
the deep one); with parallel.cp_attention=ulysses instead each rank runs this mixer (`head_reads`)
on the whole sequence for its share of the heads, from the all-to-all of the memory's inputs
(memory_caching/cp.py ulysses_reads).

Documents (`doc_start` [B, S], True where a new document begins; under context parallelism only
with parallel.cp_attention=ulysses, where each rank packs the whole sequence's documents):
the mixer runs on the documents packed (titans/documents.py), each moved to a segment boundary
(a chunk boundary for `none`) with its last segment padded by rows that write nothing. A segment
that starts a document starts from the base's initial state (the chunk before it hands on zero,
or M_0 and zero surprise: linear_memory.py chunked_scan's `carry`, neural_memory.py reset_terms),
its convolutions see nothing before it, and its tokens read and weigh only the cached states of
their own document's segments (`first`: every other cached state gets weight 0 in residual and a
score of -inf in grm / soup / ssc). So each document's reads equal those of the document alone.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taper.models.layers import RMSNorm, SwiGLU
from megatron_taper.models.memory_caching import cp
from megatron_taper.models.memory_caching.cost import GATED, deep_scan_plan, segment_slices
from megatron_taper.models.memory_caching.linear_memory import LinearMemory, time_blocks
from megatron_taper.models.titans.documents import Packing, pack_documents, starts_inside
from megatron_taper.models.titans.model import Titans
from megatron_taper.models.titans.neural_memory import ALL_HEADS, NeuralMemory, State, pad_features, reset_state
from megatron_taper.models.transformer.model import Transformer

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig


class MemoryCachingMixer(nn.Module):
    """The sequence mixer: a base memory (LinearMemory or NeuralMemory) with cached segment states."""

    def __init__(self, cfg: ModelConfig, memory: nn.Module):
        super().__init__()
        mc = cfg.memory_caching
        self.memory = memory
        self.variant, self.segment, self.top_k = mc.variant, mc.segment, mc.top_k
        self.head_dim = cfg.head_dim
        self.wu = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False) if mc.variant in GATED else None
        # context parallelism (memory_caching/cp.py): the sequence split, or None
        self.context = None
        self.linear = isinstance(memory, LinearMemory)
        self.continues = mc.continues  # a slice starts from the last one's state
        self.caches = mc.variant != "none"

    def forward(self, x: torch.Tensor, *_rope: torch.Tensor, doc_start: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, S, D] (normalised) -> [B, S, D] (RoPE tables, if passed, are not used); `doc_start`
        [B, S]: documents (module docstring)."""
        if self.context is not None and self.context.attention == "ulysses":
            return self.memory.output(cp.ulysses_reads(self, x, doc_start))
        doc_start = starts_inside(doc_start, self.context, "Memory Caching")
        if doc_start is None:
            return self.memory.output(self.reads(x))
        packing = self.packing(doc_start)
        return self.memory.output(packing.unpack(self.reads(packing.pack(x), packing), dim=2))

    def packing(self, doc_start: torch.Tensor) -> Packing:
        """The packed layout of the documents of doc_start [B, S]: each at a segment boundary (a chunk
        boundary for `none`)."""
        return pack_documents(doc_start, self.memory.chunk_size if self.variant == "none" else self.segment)

    def reads(self, x: torch.Tensor, packing: Packing | None = None) -> torch.Tensor:
        """Per-head reads before the read-out: [B, H, S, E]. Under context parallelism x is a slice
        of whole segments, which starts from the state the slices before it hand over (`cp.receive`):
        its segments' global indices start at N, the number of segments before it. `packing`: x is
        packed documents, each starting a segment (module docstring)."""
        positions = None if packing is None else packing.positions
        features = self.memory.project(x, x, cp.conv_past(self, x), positions=positions)[0]  # time is dim 2
        u = None if self.wu is None else self.wu(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        return self.head_reads(features, u, packing)

    def head_reads(self, features: tuple, u: torch.Tensor | None, packing: Packing | None = None,
                   heads: slice = ALL_HEADS) -> torch.Tensor:
        """`reads` from the memory's features (memory.project: [B, n, T, ...]) and W_u's projection u
        [B, n, T, E] (gated variants, else None) of the memory's heads `heads` (default all)."""
        k, q = features[0], features[2]
        batch, total = k.shape[0], k.shape[2]
        segments = segment_slices(total, self.segment, self.variant)
        length = segments[0].stop
        first = None  # [B, T] the first segment of each token's document
        if packing is not None:
            features = pad_features(features, packing.valid) if not self.linear else features
            first = (torch.arange(total, device=k.device) - packing.positions) // length
        pooled = None if u is None else segment_means(k, length)  # [B, H, n, E]
        handover = cp.receive(self, features, segments, pooled, batch, heads)
        before = handover.cache[0].shape[2] if handover.cache else 0
        if handover.pooled is not None:
            pooled = torch.cat((handover.pooled, pooled), dim=2)  # [B, H, N + n, E]
        # every token's weights over (online, cached 0 .. N + n - 2): [B, H, T, N + n]
        gammas = None if u is None else self.gammas(u, k, pooled, before, length, first)
        online, finals, state = self.scan_segments(features, handover, gammas, length, packing, heads)
        if self.caches:  # per memory layer the end states of every segment so far [B, H, N + n, i, o]
            finals = [torch.cat(pair, dim=2) for pair in zip(handover.cache, finals)] if before else finals
        if self.variant == "none" or (self.variant == "soup" and not self.linear):
            return cp.send(self, online, state, finals, pooled, handover)
        reachable = before + len(segments) - 1  # cached states some token of the slice reads
        if not reachable:
            return cp.send(self, online if gammas is None else gammas[..., :1] * online, state, finals, pooled,
                           handover)
        cached = cached_reads(q, [w[:, :, :reachable] for w in finals], not self.linear)  # [B, H, T, M, E]
        if self.variant == "residual" and first is not None:
            weights = cached_mask(length, total, before, reachable, q, first)  # [B, 1, T, M]
            out = online + torch.einsum("btm,bhtme->bhte", weights[:, 0], cached)
        elif self.variant == "residual":
            weights = cached_mask(length, total, before, reachable, q)  # [T, M]
            out = online + torch.einsum("tm,bhtme->bhte", weights, cached)
        else:  # grm, ssc; soup over a linear memory is grm (module doc)
            out = gammas[..., :1] * online + (gammas[..., None, 1:reachable + 1] @ cached).squeeze(-2)
        return cp.send(self, out, state, finals, pooled, handover)

    def scan_segments(self, features: tuple, handover: cp.Handover, gammas: torch.Tensor | None, length: int,
                      packing: Packing | None = None, heads: slice = ALL_HEADS
                      ) -> tuple[torch.Tensor, list[torch.Tensor], State]:
        """The online reads [B, H, T, E] of the slice's segments of `length` tokens, their end
        states per memory layer [B, H, n, i, o], and the online state after the last segment. The
        linear memory scans them at once (LinearMemory.scan_segments); the deep memory scans
        continuing segments of whole chunks at once (their ends are chunk boundaries) and folds
        independent segments into the batch where the slice holds whole segments; else, and for
        soup (which mixes the cached memories into each read), it runs them one by one. `packing`:
        a segment that starts a document starts from the initial state. `heads`: the memory's heads
        the features are of."""
        memory, batch, total = self.memory, features[0].shape[0], features[0].shape[2]
        documents = None if packing is None else (packing.valid, packing.resets)
        if self.linear:
            reads, ends = memory.scan_segments(features, handover.start[0][0], length, self.continues,
                                               None if packing is None else packing.resets)
            state = ([ends[:, :, -1]], []) if self.continues else memory.init_state(batch, heads)
            return reads, [ends], state
        n = -(-total // length)
        plan = deep_scan_plan(self.variant, self.continues, memory.chunk_size, total, length)
        if plan == "one":
            reads, ends, state = memory.scan_segments(features, handover.start, length, documents, heads)
            return reads, ends, state
        if plan == "folded":
            folded = tuple(f.unflatten(2, (n, length)).movedim(2, 1).flatten(0, 1) for f in features)
            reads, ends = memory.scan_features(folded, memory.init_state(batch * n, heads), heads=heads)
            reads = reads.unflatten(0, (batch, n)).movedim(1, 2).flatten(2, 3)
            return reads, [w.unflatten(0, (batch, n)).movedim(1, 2) for w in ends[0]], memory.init_state(batch, heads)
        cache, state, onlines, own = list(handover.cache), handover.start, [], []
        for start in range(0, total, length):
            seg = slice(start, start + length)
            mix = None
            if self.variant == "soup":  # segment i reads the N + i states cached before it
                mix = self.soup_mix(gammas[:, :, seg, :1 + (cache[0].shape[2] if cache else 0)], cache)
            if packing is not None:
                state = reset_state(memory.init_state(batch, heads), state, packing.resets[:, start])
            packed = {} if documents is None else {"documents": tuple(t[:, seg] for t in documents)}
            read, final = memory.scan_features(tuple(f[:, :, seg] for f in features), state, mix=mix, heads=heads,
                                               **packed)
            onlines.append(read)
            own.append(final[0])
            if self.variant == "soup":
                ends = [w.unsqueeze(2) for w in final[0]]
                cache = [torch.cat(pair, dim=2) for pair in zip(cache, ends)] if cache else ends
            state = final if self.continues else memory.init_state(batch, heads)
        return torch.cat(onlines, dim=2), [torch.stack(layer, dim=2) for layer in zip(*own)], state

    def gammas(self, u: torch.Tensor, k: torch.Tensor, pooled: torch.Tensor, before: int, length: int,
               first: torch.Tensor | None = None) -> torch.Tensor:
        """Weights [B, H, T, N + n] of the online state and the cached states 0 .. N + n - 2 for
        every token of the slice (a token of segment i gives weight 0 to the states it may not
        read, N + i and later, and with `first` [B, T] to those before its document's first
        segment); u, k [B, H, T, E]; pooled [B, H, N + n, E] the segments' mean keys."""
        total = k.shape[2]
        n = pooled.shape[2] - before
        blocks = time_blocks(k, length)  # [B, H, n, L, E]
        count = torch.arange(1, length + 1, device=k.device, dtype=k.dtype)[:, None]
        running = (blocks.cumsum(3) / count).flatten(2, 3)[:, :, :total]  # online: keys up to t only
        logits = (u * running).sum(-1, keepdim=True)  # [B, H, T, 1]
        reachable = before + n - 1
        if reachable:
            visible = cached_mask(length, total, before, reachable, k, first).bool()  # [T, M] or [B, 1, T, M]
            scores = (u @ pooled[:, :, :reachable].transpose(-1, -2)).masked_fill(~visible, float("-inf"))
            if self.variant == "ssc" and reachable > self.top_k:
                chosen = scores.topk(self.top_k, dim=-1).indices
                keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, chosen, True)
                scores = scores.masked_fill(~keep, float("-inf"))
            logits = torch.cat((logits, scores), dim=-1)
        return torch.softmax(logits, dim=-1)

    @staticmethod
    def soup_mix(gamma: torch.Tensor, cache: list[torch.Tensor]) -> Callable[..., torch.Tensor]:
        """The read hook of the memory soup for one segment: layer l's pre-activation is
        g^(s) (r M^(s)_t) + r (sum_i g^(i) M^(i)), the cached memories (per layer [B, H, N, i, o])
        mixed per token."""
        stacked = [layer.flatten(3) for layer in cache]  # per layer [B, H, N, i*o]

        def mix(layer: int, r: torch.Tensor, read: torch.Tensor, positions: slice) -> torch.Tensor:
            g = gamma[:, :, positions]  # [B, H, C, 1 + N]
            out = g[..., :1] * read
            if not stacked:
                return out
            mixed = (g[..., 1:] @ stacked[layer]).unflatten(-1, (r.shape[-1], -1))  # [B, H, C, i, o]
            return out + (r.unsqueeze(-2) @ mixed).squeeze(-2)

        return mix


def cached_reads(q: torch.Tensor, cache: list[torch.Tensor], residual: bool) -> torch.Tensor:
    """Every query's reads of every cached memory: q [B, H, T, E], cache per memory layer
    [B, H, M, i, o] -> [B, H, T, M, E]: f(q) (SiLU between layers), plus q when `residual` (the
    deep memory). The first layer is one matmul against the cached weights side by side."""
    first = cache[0]
    r = (q @ first.movedim(2, 3).flatten(3)).unflatten(-1, (first.shape[2], -1))  # [B, H, T, M, o]
    for w in cache[1:]:
        r = torch.einsum("bhtmi,bhmio->bhtmo", F.silu(r), w)
    return r + q.unsqueeze(3) if residual else r


def segment_means(k: torch.Tensor, length: int) -> torch.Tensor:
    """The mean of k [B, H, T, E] over each segment of `length` tokens (the last may be shorter): [B, H, n, E]."""
    total = k.shape[2]
    n = -(-total // length)
    sums = time_blocks(k, length).sum(3)
    sizes = torch.full((n, 1), float(length), dtype=k.dtype, device=k.device)
    sizes[-1] = total - (n - 1) * length
    return sums / sizes


def cached_mask(length: int, total: int, before: int, reachable: int, like: torch.Tensor,
                first: torch.Tensor | None = None) -> torch.Tensor:
    """[T, M] in like's dtype: 1 where token t (of local segment t // length) may read cached state
    m (m < N + t // length), else 0. With `first` [B, T] (the first segment of each token's
    document) [B, 1, T, M], also 0 where m < first."""
    seg = torch.arange(total, device=like.device) // length
    cached = torch.arange(reachable, device=like.device)[None, :]
    mask = cached < before + seg[:, None]
    if first is not None:
        mask = mask & (cached >= first[..., None])[:, None]
    return mask.to(like.dtype)


class MemoryCachingBlock(nn.Module):
    """x = x + MC(norm(x)); x = x + SwiGLU(norm(x)) with this layer's MLP width."""

    base: Callable[[ModelConfig], nn.Module] = LinearMemory

    def __init__(self, cfg: ModelConfig, mlp_width: int):
        super().__init__()
        self.mixer_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = MemoryCachingMixer(cfg, type(self).base(cfg))
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, mlp_width)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc_start: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.mixer(self.mixer_norm(x), doc_start=doc_start)
        return x + self.mlp(self.mlp_norm(x))


class DeepMemoryBlock(MemoryCachingBlock):
    base = NeuralMemory


class LinearMemoryLM(Transformer):
    """Blocks of Memory Caching over the linear memory (the Transformer's embedding, norm, head)."""

    block_class = MemoryCachingBlock
    init_value = Titans.init_value  # the common rule; M_0 ~ N(0, 1 / fan_in); conv taps near identity


class DeepMemoryLM(LinearMemoryLM):
    block_class = DeepMemoryBlock
