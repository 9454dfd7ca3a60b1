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
              itself is never materialised; for a linear memory this equals grm (a test checks it)
    ssc       grm over the online state and the `top_k` cached segments of the highest scores
              <u_t, kbar_i> (per token and head; the others get weight 0); the reads of all cached
              segments are computed and the unselected ones discarded (dense, grm's cost)
With one segment (S >= L) every variant is its base: its only weight is softmax of one score, 1.
Cached reads cost O(L^2 / S) per sequence (each token reads the s states before it); the cost
model (`memory_caching_layer_cost`) counts exactly the matmuls below.

Tensor parallelism splits everything by head (scores, gammas and reads are per head), through
Titans' `tp_plan_memory`; W_u is column-parallel like wq. Context parallelism (the mixer's
`context`): each rank's slice is whole segments and starts from the state the slices before it
hand over (models/memory_caching_cp.py: a prefix for the linear memory, a chain for the deep one).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from megatron_taper.cost.block import Cost, Split, attention_cost, norm_act, swiglu_cost
from megatron_taper.models import memory_caching_cp as cp
from megatron_taper.models.cards import DEEP_MEMORY, LINEAR_MEMORY
from megatron_taper.models.layers import RMSNorm, SwiGLU
from megatron_taper.models.linear_memory import (
    LinearMemory,
    linear_memory_params,
    linear_projection_flops,
    linear_scan_flops,
)
from megatron_taper.models.spec import FamilySpec
from megatron_taper.models.titans import (
    NeuralMemory,
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
        self.independent = mc.write_mode == "independent"
        self.head_dim = cfg.head_dim
        self.wu = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False) if mc.variant in GATED else None
        # context parallelism (models/memory_caching_cp.py): the sequence split, or None
        self.context = None
        self.linear = isinstance(memory, LinearMemory)
        self.continues = mc.variant == "none" or not self.independent  # a slice starts from the last one's state
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
        u = None if self.wu is None else self.wu(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        pooled = None if u is None else torch.stack([k[:, :, seg].mean(2) for seg in segments], dim=2)
        handover = cp.receive(self, features, segments, pooled, batch)
        before = len(handover.cache)
        if handover.pooled is not None:
            pooled = torch.cat((handover.pooled, pooled), dim=2)  # [B, H, N + n, E]
        gammas = [None if u is None else self.gammas(u[:, :, seg], k[:, :, seg], pooled, before + i)
                  for i, seg in enumerate(segments)]
        state, onlines, finals = handover.start, [], list(handover.cache)
        for i, seg in enumerate(segments):
            mix = self.soup_mix(gammas[i], finals) if self.variant == "soup" else None
            read, final = memory.scan_features(tuple(f[:, :, seg] for f in features), state, mix=mix)
            onlines.append(read)
            finals.append(final[0])
            state = final if self.continues else memory.init_state(batch)
        if self.variant in ("none", "soup"):
            return cp.send(self, torch.cat(onlines, dim=2), state, finals, pooled, handover)
        q = q.contiguous()  # so that every slice along time below is a view for the matmuls
        # the reads of cached state j by every token of the slice after segment j: [B, H, T - start_j, E]
        starts = [0] * before + [seg.stop for seg in segments[:-1]]
        later = [memory.read(q[:, :, start:], (final, [])) for start, final in zip(starts, finals)]
        outs = []
        for i, seg in enumerate(segments):
            n = before + i  # cached states this segment reads
            if not n:
                outs.append(onlines[0] if gammas[0] is None else gammas[0] * onlines[0])
                continue
            rows = [reads[:, :, seg.start - start:seg.stop - start] for reads, start in zip(later[:n], starts)]
            cached = torch.stack(rows, dim=3)  # [B, H, T, n, E]
            if self.variant == "residual":
                outs.append(onlines[i] + cached.sum(3))
                continue
            gamma = gammas[i]  # [B, H, T, 1 + n]
            outs.append(gamma[..., :1] * onlines[i] + (gamma[..., None, 1:] @ cached).squeeze(-2))
        return cp.send(self, torch.cat(outs, dim=2), state, finals, pooled, handover)

    def gammas(self, u: torch.Tensor, k: torch.Tensor, pooled: torch.Tensor | None, cached: int) -> torch.Tensor:
        """Weights [B, H, T, 1 + cached] of the online state and the first `cached` cached states
        for one segment's u, k [B, H, T, E]; pooled [B, H, N, E] the mean keys of cached segments."""
        count = torch.arange(1, k.shape[2] + 1, device=k.device, dtype=k.dtype)[:, None]
        logits = (u * (k.cumsum(2) / count)).sum(-1, keepdim=True)  # online: keys up to t only
        if cached:
            scores = u @ pooled[:, :, :cached].transpose(-1, -2)  # [B, H, T, cached]
            if self.variant == "ssc" and cached > self.top_k:
                chosen = scores.topk(self.top_k, dim=-1).indices
                keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, chosen, True)
                scores = scores.masked_fill(~keep, float("-inf"))
            logits = torch.cat((logits, scores), dim=-1)
        return torch.softmax(logits, dim=-1)

    @staticmethod
    def soup_mix(gamma: torch.Tensor, finals: list[list[torch.Tensor]]) -> Callable[..., torch.Tensor]:
        """The read hook of the memory soup for one segment: layer l's pre-activation is
        g^(s) (r M^(s)_t) + r (sum_i g^(i) M^(i)), the cached memories mixed per token."""
        stacked = [torch.stack(layer, dim=2).flatten(3) for layer in zip(*finals)]  # per layer [B, H, N, i*o]

        def mix(layer: int, r: torch.Tensor, read: torch.Tensor, positions: slice) -> torch.Tensor:
            g = gamma[:, :, positions]  # [B, H, C, 1 + N]
            out = g[..., :1] * read
            if not stacked:
                return out
            mixed = (g[..., 1:] @ stacked[layer]).unflatten(-1, (r.shape[-1], -1))  # [B, H, C, i, o]
            return out + (r.unsqueeze(-2) @ mixed).squeeze(-2)

        return mix


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
        flops = seq * linear_projection_flops(cfg) + sum(linear_scan_flops(cfg, t) for t in segments)
    flops += 2 * d * h * e * seq if gated else 0  # W_u
    for n, t in enumerate(segments):  # n: cached states this segment reads
        if not n or mc.variant == "none":
            continue
        if mc.variant == "soup":  # scores, mixing the cached memories per token, the mixed read
            flops += h * (2 * t * e * n + sum(2 * t * n * x + 2 * t * x for x in io))
            continue
        flops += h * sum(2 * n * t * x for x in io)  # cached reads
        flops += h * (2 * t * e * n + 2 * t * n * e) if gated else 0  # scores, weighted sum of the reads
    mixer_params = mem_params + (d * h * e if gated else 0)
    mlp = swiglu_cost(cfg, width)
    tp_params = Split(whole=d, heads=mixer_params) + mlp.params_split
    act = mixer_act(cfg, io, deep) + mlp.act
    backward = attention_cost(cfg).backward + mlp.backward
    return Cost(mixer_params + d + mlp.params, flops / seq + mlp.flops, tp_params=tp_params, act=act,
                backward=backward)


def mixer_act(cfg: ModelConfig, io: list[int], deep: bool) -> Split:
    """Elements per token the mixer keeps for backward, fitted to torch's saved tensors (tests/
    models/test_memory_caching.py checks it within 10%): the norm and its output; per head the
    base's scan (linear: 18 head vectors per token, the chunk's [C, C] decay products, one state
    per chunk; deep: Titans' scan_act_per_row and 8 head vectors); with caching the contiguous
    queries, each cached read's hidden activations (deep), the weights, the scores u and the cached
    reads they weigh (2E + 1.75 E + 4 per cached state), the final states that independent writes
    keep only for the cached reads, and soup's per-token mixed memories and per-segment stacks of
    the cached ones. The constants are fitted to the measured counts."""
    d, e, seq, mc = cfg.d_model, cfg.head_dim, cfg.seq_len, cfg.memory_caching
    segments = segment_slices(seq, mc.segment, mc.variant)
    chunk = cfg.titans.chunk_size if deep else mc.linear_chunk
    chunks = sum(-(-(s.stop - s.start) // chunk) for s in segments)  # chunks restart at every segment
    if deep:  # Titans' count assumes seq / chunk chunks of weights and surprise
        per_head = scan_act_per_row(cfg, seq) + 8 * e + 2 * sum(io) * (chunks - seq / chunk) / seq
        hidden = sum(memory_dims(e, cfg.titans.memory_depth, cfg.titans.memory_expansion)[1:-1])
    else:
        per_head, hidden = 18 * e + 3 * min(chunk, seq) + e * e * chunks / seq, 0
    n = len(segments)
    cached = sum(i * (s.stop - s.start) for i, s in enumerate(segments)) / seq  # mean cached states per token
    if mc.variant == "soup":
        with_cache = (seq - segments[0].stop) / seq  # tokens that mix cached memories
        per_head += sum(io) * (with_cache + n * (n - 1) / (2 * seq)) + 2 * e + 4 * (1 + cached)
    elif mc.variant != "none":
        per_head += e + 2 * hidden * cached
        if mc.write_mode == "independent":  # final states kept only for the cached reads
            per_head += (2 if deep else 0.5) * sum(io) * (n - 1) / seq
        if mc.variant in GATED:
            per_head += 2 * e + 1.75 * e * cached + 4 * (1 + cached)
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
