"""Memory Caching (Behrouz et al., arXiv 2602.24281): recurrent memories whose capacity grows
with the sequence by caching the memory state at the end of every segment.

Two families, each a stack of blocks `x = x + MC(norm(x)); x = x + SwiGLU_w(norm(x))` (the MLP
has this layer's tapered width w):
    linear_memory   base = LinearMemory (models/linear_memory.py, gated linear attention)
    deep_memory     base = Titans' NeuralMemory (models/titans.py; its options in model.titans)

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
(every token reads the n - 1 cached states); the cost model (`memory_caching_layer_cost`) counts
exactly the matmuls below.

Tensor parallelism splits everything by head (scores, gammas and reads are per head), through
Titans' `tp_plan_memory`; W_u is column-parallel like wq. Context parallelism (the mixer's
`context`): each rank's slice is whole segments and starts from the state the slices before it
hand over (models/memory_caching_cp.py: a prefix for the linear memory, a chain for the deep one).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taper.cost.block import Cost, Split, attention_cost, norm_act, swiglu_cost
from megatron_taper.models import memory_caching_cp as cp
from megatron_taper.models.cards import DEEP_MEMORY, LINEAR_MEMORY
from megatron_taper.models.layers import RMSNorm, SwiGLU
from megatron_taper.models.linear_memory import (
    LinearMemory,
    linear_memory_params,
    linear_projection_flops,
    linear_segments_flops,
    time_blocks,
)
from megatron_taper.models.spec import FamilySpec
from megatron_taper.models.titans import (
    NeuralMemory,
    State,
    Titans,
    memory_dims,
    memory_params,
    scan_act_per_row,
    scan_flops,
    tp_plan_memory,
)
from megatron_taper.models.transformer import Transformer
from megatron_taper.validation import ConfigError

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig, ParallelConfig
    from megatron_taper.parallel.tp_plan import TPBuilder

GATED = ("grm", "soup", "ssc")  # variants with W_u and the softmax weights


def segment_slices(seq: int, segment: int, variant: str) -> list[slice]:
    size = seq if variant == "none" else segment
    return [slice(s, min(s + size, seq)) for s in range(0, seq, size)]


class MemoryCachingMixer(nn.Module):
    """The sequence mixer: a base memory (LinearMemory or NeuralMemory) with cached segment states."""

    def __init__(self, cfg: ModelConfig, memory: nn.Module):
        super().__init__()
        mc = cfg.memory_caching
        self.memory = memory
        self.variant, self.segment, self.top_k = mc.variant, mc.segment, mc.top_k
        self.head_dim = cfg.head_dim
        self.wu = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False) if mc.variant in GATED else None
        # context parallelism (models/memory_caching_cp.py): the sequence split, or None
        self.context = None
        self.linear = isinstance(memory, LinearMemory)
        self.continues = mc.continues  # a slice starts from the last one's state
        self.caches = mc.variant != "none"

    def forward(self, x: torch.Tensor, *_rope: torch.Tensor) -> torch.Tensor:
        """x [B, S, D] (normalised) -> [B, S, D] (RoPE tables, if passed, are not used)."""
        return self.memory.output(self.reads(x))

    def reads(self, x: torch.Tensor) -> torch.Tensor:
        """Per-head reads before the read-out: [B, H, S, E]. Under context parallelism x is a slice
        of whole segments, which starts from the state the slices before it hand over (`cp.receive`):
        its segments' global indices start at N, the number of segments before it."""
        memory, batch = self.memory, x.shape[0]
        features = memory.project(x, x, cp.conv_past(self, x))[0]  # time is dim 2 of every feature
        k, q = features[0], features[2]
        segments = segment_slices(x.shape[1], self.segment, self.variant)
        length = segments[0].stop
        u = None if self.wu is None else self.wu(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        pooled = None if u is None else segment_means(k, length)  # [B, H, n, E]
        handover = cp.receive(self, features, segments, pooled, batch)
        before = handover.cache[0].shape[2] if handover.cache else 0
        if handover.pooled is not None:
            pooled = torch.cat((handover.pooled, pooled), dim=2)  # [B, H, N + n, E]
        # every token's weights over (online, cached 0 .. N + n - 2): [B, H, T, N + n]
        gammas = None if u is None else self.gammas(u, k, pooled, before, length)
        online, finals, state = self.scan_segments(features, handover, gammas, length)
        if self.caches:  # per memory layer the end states of every segment so far [B, H, N + n, i, o]
            finals = [torch.cat(pair, dim=2) for pair in zip(handover.cache, finals)] if before else finals
        if self.variant == "none" or (self.variant == "soup" and not self.linear):
            return cp.send(self, online, state, finals, pooled, handover)
        reachable = before + len(segments) - 1  # cached states some token of the slice reads
        if not reachable:
            return cp.send(self, online if gammas is None else gammas[..., :1] * online, state, finals, pooled,
                           handover)
        cached = cached_reads(q, [w[:, :, :reachable] for w in finals], not self.linear)  # [B, H, T, M, E]
        if self.variant == "residual":
            weights = cached_mask(length, x.shape[1], before, reachable, q)  # [T, M]
            out = online + torch.einsum("tm,bhtme->bhte", weights, cached)
        else:  # grm, ssc; soup over a linear memory is grm (module doc)
            out = gammas[..., :1] * online + (gammas[..., None, 1:reachable + 1] @ cached).squeeze(-2)
        return cp.send(self, out, state, finals, pooled, handover)

    def scan_segments(self, features: tuple, handover: cp.Handover, gammas: torch.Tensor | None,
                      length: int) -> tuple[torch.Tensor, list[torch.Tensor], State]:
        """The online reads [B, H, T, E] of the slice's segments of `length` tokens, their end
        states per memory layer [B, H, n, i, o], and the online state after the last segment. The
        linear memory scans them at once (LinearMemory.scan_segments); the deep memory scans
        continuing segments of whole chunks at once (their ends are chunk boundaries) and folds
        independent segments into the batch where the slice holds whole segments; else, and for
        soup (which mixes the cached memories into each read), it runs them one by one."""
        memory, batch, total = self.memory, features[0].shape[0], features[0].shape[2]
        if self.linear:
            reads, ends = memory.scan_segments(features, handover.start[0][0], length, self.continues)
            state = ([ends[:, :, -1]], []) if self.continues else memory.init_state(batch)
            return reads, [ends], state
        n = -(-total // length)
        plan = deep_scan_plan(self.variant, self.continues, memory.chunk_size, total, length)
        if plan == "one":
            reads, ends, state = memory.scan_segments(features, handover.start, length)
            return reads, ends, state
        if plan == "folded":
            folded = tuple(f.unflatten(2, (n, length)).movedim(2, 1).flatten(0, 1) for f in features)
            reads, ends = memory.scan_features(folded, memory.init_state(batch * n))
            reads = reads.unflatten(0, (batch, n)).movedim(1, 2).flatten(2, 3)
            return reads, [w.unflatten(0, (batch, n)).movedim(1, 2) for w in ends[0]], memory.init_state(batch)
        cache, state, onlines, own = list(handover.cache), handover.start, [], []
        for start in range(0, total, length):
            seg = slice(start, start + length)
            mix = None
            if self.variant == "soup":  # segment i reads the N + i states cached before it
                mix = self.soup_mix(gammas[:, :, seg, :1 + (cache[0].shape[2] if cache else 0)], cache)
            read, final = memory.scan_features(tuple(f[:, :, seg] for f in features), state, mix=mix)
            onlines.append(read)
            own.append(final[0])
            if self.variant == "soup":
                ends = [w.unsqueeze(2) for w in final[0]]
                cache = [torch.cat(pair, dim=2) for pair in zip(cache, ends)] if cache else ends
            state = final if self.continues else memory.init_state(batch)
        return torch.cat(onlines, dim=2), [torch.stack(layer, dim=2) for layer in zip(*own)], state

    def gammas(self, u: torch.Tensor, k: torch.Tensor, pooled: torch.Tensor, before: int, length: int) -> torch.Tensor:
        """Weights [B, H, T, N + n] of the online state and the cached states 0 .. N + n - 2 for
        every token of the slice (a token of segment i gives weight 0 to the states it may not
        read, N + i and later); u, k [B, H, T, E]; pooled [B, H, N + n, E] the segments' mean keys."""
        total = k.shape[2]
        n = pooled.shape[2] - before
        blocks = time_blocks(k, length)  # [B, H, n, L, E]
        count = torch.arange(1, length + 1, device=k.device, dtype=k.dtype)[:, None]
        running = (blocks.cumsum(3) / count).flatten(2, 3)[:, :, :total]  # online: keys up to t only
        logits = (u * running).sum(-1, keepdim=True)  # [B, H, T, 1]
        reachable = before + n - 1
        if reachable:
            visible = cached_mask(length, total, before, reachable, k).bool()  # [T, M]
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


def deep_scan_plan(variant: str, continues: bool, chunk_size: int, total: int, length: int) -> str:
    """How the deep memory scans `total` tokens in segments of `length` (MemoryCachingMixer.
    scan_segments; the activation model counts the same): "one" scan when continuing segments are
    whole chunks (their ends are chunk boundaries), "folded" into the batch when independent
    segments are whole, else "segments" one by one (also soup, which mixes the cached states into
    each segment's reads)."""
    if variant != "soup" and continues and length % min(chunk_size, length) == 0:
        return "one"
    if variant != "soup" and not continues and total % length == 0:
        return "folded"
    return "segments"


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


def cached_mask(length: int, total: int, before: int, reachable: int, like: torch.Tensor) -> torch.Tensor:
    """[T, M] in like's dtype: 1 where token t (of local segment t // length) may read cached state
    m (m < N + t // length), else 0."""
    seg = torch.arange(total, device=like.device) // length
    return (torch.arange(reachable, device=like.device)[None, :] < before + seg[:, None]).to(like.dtype)


class MemoryCachingBlock(nn.Module):
    """x = x + MC(norm(x)); x = x + SwiGLU(norm(x)) with this layer's MLP width."""

    base: Callable[[ModelConfig], nn.Module] = LinearMemory

    def __init__(self, cfg: ModelConfig, mlp_width: int):
        super().__init__()
        self.mixer_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = MemoryCachingMixer(cfg, type(self).base(cfg))
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, mlp_width)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.mixer_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class DeepMemoryBlock(MemoryCachingBlock):
    base = NeuralMemory


class LinearMemoryLM(Transformer):
    """Blocks of Memory Caching over the linear memory (the Transformer's embedding, norm, head)."""

    block_class = MemoryCachingBlock
    init_value = Titans.init_value  # the common rule; M_0 ~ N(0, 1 / fan_in); conv taps near identity


class DeepMemoryLM(LinearMemoryLM):
    block_class = DeepMemoryBlock


# ---------------------------------------------------------------------------------------------
# Cost model: counts exactly the matmuls above (FLOPs per token, 2 per multiply-add). `causal`
# changes nothing: the recurrence computes only causal work.


def memory_caching_layer_cost(cfg: ModelConfig, width: int, deep: bool) -> Cost:
    d, h, e, seq, mc = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.seq_len, cfg.memory_caching
    gated = mc.variant in GATED
    if deep:
        dims = memory_dims(e, cfg.titans.memory_depth, cfg.titans.memory_expansion)
        io, mem_params = [i * o for i, o in zip(dims[:-1], dims[1:])], memory_params(cfg)
    else:
        io, mem_params = [e * e], linear_memory_params(cfg)
    segments = [s.stop - s.start for s in segment_slices(seq, mc.segment, mc.variant)]
    if deep:  # projections and read-out of every token, chunks restarting at every segment
        flops = sum(scan_flops(cfg, t) for t in segments)
    else:
        flops = seq * linear_projection_flops(cfg) + linear_segments_flops(cfg, seq, segments[0], mc.continues)
    flops += 2 * d * h * e * seq if gated else 0  # W_u
    reachable = len(segments) - 1  # cached states some token reads; every token reads all, masked
    if mc.variant == "none" or not reachable:
        pass  # no cached reads
    elif mc.variant == "soup" and deep:  # scores; per segment the cached memories mixed per token, the mixed read
        flops += h * 2 * seq * reachable * e
        flops += h * sum(sum(2 * t * n * x + 2 * t * x for x in io) for n, t in enumerate(segments) if n)
    else:  # every token's reads of every cached state and their weighted sum [, the scores]
        flops += h * seq * reachable * (sum(2 * x for x in io) + 2 * e + (2 * e if gated else 0))
    mixer_params = mem_params + (d * h * e if gated else 0)
    mlp = swiglu_cost(cfg, width)
    tp_params = Split(whole=d, heads=mixer_params) + mlp.params_split
    act = mixer_act(cfg, io, deep) + mlp.act
    backward = attention_cost(cfg).backward + mlp.backward
    return Cost(mixer_params + d + mlp.params, flops / seq + mlp.flops, tp_params=tp_params, act=act,
                backward=backward)


def mixer_act(cfg: ModelConfig, io: list[int], deep: bool) -> Split:
    """Elements per token the mixer keeps for backward, counted from torch's saved tensors (tests/
    models/test_memory_caching.py checks it within 10%): the norm and its output; per head the
    base's scan and the cached reads. Linear base: its projections, convolutions and read-out
    (9 E + 9 + 3 E with taps), per padded token the chunk's vectors (5 E, and 3 E more that matmul
    copies when the features are scanned in place) and [C, C] products (4 C + 4), the states before every chunk
    twice (the transfer product's input and the reads' copy) and the [N + 1, N + 1] transfer of
    every scan. Deep base: Titans' scan_act_per_row of each scan it runs and 8 head vectors. With caching, every token
    reads every cached state M (masked): the queries and the cached weights side by side (E + M P /
    L), for the gated variants also u, the running mean keys, the scores and weights (6 E + M + 2),
    the online read and the M cached reads they weigh (M E), and for the deep memory each cached
    read's hidden activations; soup over the deep memory its per-token mixed memories and
    per-segment stacks of the cached ones. The deep constants are fitted to the measured counts."""
    d, e, seq, mc = cfg.d_model, cfg.head_dim, cfg.seq_len, cfg.memory_caching
    segments = segment_slices(seq, mc.segment, mc.variant)
    n, length = len(segments), segments[0].stop
    continues = mc.continues
    if deep:  # the scans MemoryCachingMixer.scan_segments runs, and 8 head vectors
        size = min(cfg.titans.chunk_size, length)
        plan = deep_scan_plan(mc.variant, continues, cfg.titans.chunk_size, seq, length)
        if plan == "one":  # chunks ending at segment ends
            scans = [(seq, size)]
        elif plan == "folded":
            scans = [(length, size)] * n
        else:  # segment by segment
            scans = [(s.stop - s.start, min(size, s.stop - s.start)) for s in segments]
        per_head = sum(scan_act_per_row(cfg, rows, c) * rows for rows, c in scans) / seq + 8 * e
        hidden = sum(memory_dims(e, cfg.titans.memory_depth, cfg.titans.memory_expansion)[1:-1])
    else:
        size = min(mc.linear_chunk, length)
        padded = -(-length // size) * size
        scans, chunks = (1 if continues else n), n * padded // size
        taps = mc.linear_conv_kernel
        per_head = 9 * e + 9 + (3 * e * (1 + (taps - 1) / seq) if taps else 0)
        stretch = n * padded / seq  # padded tokens per token
        aligned = continues and stretch == 1  # the features are scanned in place: matmul copies 3 of them
        per_head += stretch * (5 * e + 4 * size + 4) + (3 * e if aligned else 0)
        per_head += ((2 * chunks + scans) * e * e + scans * (chunks // scans + 1) ** 2) / seq
        hidden = 0
    reachable = n - 1 if mc.variant != "none" else 0  # cached states every token reads (masked)
    if mc.variant == "soup" and deep:
        cached = sum(i * (s.stop - s.start) for i, s in enumerate(segments)) / seq  # mean cached states per token
        with_cache = (seq - segments[0].stop) / seq  # tokens that mix cached memories
        per_head += sum(io) * (with_cache + n * (n - 1) / (2 * seq)) + 2 * e + 4 * (1 + cached)
    elif reachable:
        per_head += e + reachable * sum(io) / seq + 2 * hidden * reachable
        if mc.variant in GATED:
            per_head += (4 + 2 * (1 if deep else stretch)) * e + reachable * (e + 1) + 2
    return norm_act(d) + Split(whole=d, heads=cfg.n_heads * per_head)


def linear_memory_layer_cost(cfg: ModelConfig, width: int, causal: bool = True) -> Cost:
    return memory_caching_layer_cost(cfg, width, deep=False)


def deep_memory_layer_cost(cfg: ModelConfig, width: int, causal: bool = True) -> Cost:
    return memory_caching_layer_cost(cfg, width, deep=True)


def tp_plan_memory_caching_block(block: MemoryCachingBlock, prefix: str, cfg: ModelConfig, tp: TPBuilder) -> None:
    """Norms replicated; the memory and W_u split by head; the MLP's width split in units of
    model.taper.multiple (uneven when the width does not divide)."""
    tp.replicated(block.mixer_norm, f"{prefix}.mixer_norm")
    tp.replicated(block.mlp_norm, f"{prefix}.mlp_norm")
    tp_plan_memory(block.mixer.memory, f"{prefix}.mixer.memory", cfg, tp)
    if block.mixer.wu is not None:
        tp.column(block.mixer, "wu", f"{prefix}.mixer", tp.head_rows(cfg.n_heads, cfg.head_dim), input_mode="copy")
    tp.swiglu(block.mlp, f"{prefix}.mlp", cfg.taper.multiple)


def check_memory_caching_layout(mcfg: ModelConfig, pcfg: ParallelConfig) -> None:
    if pcfg.tp > 1 and pcfg.sequence_parallel:
        raise ConfigError(f"parallel.sequence_parallel is not supported for model.arch={mcfg.arch!r} (the "
                          "memory reads the whole sequence); set it to false")
    cp.check_cp_layout(mcfg, pcfg)


SPECS = (FamilySpec(card=LINEAR_MEMORY, build=LinearMemoryLM, layer_cost=linear_memory_layer_cost,
                    tp_block_plan=tp_plan_memory_caching_block, check_layout=check_memory_caching_layout,
                    context_parallel=True, cp_balanced=False, cp_messages=cp.cp_messages),
         FamilySpec(card=DEEP_MEMORY, build=DeepMemoryLM, layer_cost=deep_memory_layer_cost,
                    tp_block_plan=tp_plan_memory_caching_block, check_layout=check_memory_caching_layout,
                    context_parallel=True, cp_balanced=False, cp_messages=cp.cp_messages))
