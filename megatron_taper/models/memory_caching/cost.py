"""Memory Caching's cost terms (cost/block.py), torch-free: both families' block parameters,
FLOPs per token (counting exactly the matmuls of memory_caching/model.py and linear_memory.py, 2 per
multiply-add; `causal` changes nothing: the recurrence computes only causal work) and saved
activations, and the context-parallel messages of memory_caching/cp.py (its module doc).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_taper.cost.block import Cost, Split, attention_cost, norm_act, swiglu_cost
from megatron_taper.cost.cp import ALLGATHER, ALLTOALL, CHAIN, HALO, CPMessage
from megatron_taper.models.titans.cost import memory_dims, memory_params, scan_act_per_row, scan_flops, ulysses_bytes

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig

GATED = ("grm", "soup", "ssc")  # variants with W_u and the softmax weights


def segment_slices(seq: int, segment: int, variant: str) -> list[slice]:
    size = seq if variant == "none" else segment
    return [slice(s, min(s + size, seq)) for s in range(0, seq, size)]


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


# ---------------------------------------------------------------------------------------------
# The linear base (linear_memory.py).


def linear_memory_params(cfg: ModelConfig) -> int:
    d, h, e, kernel = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.memory_caching.linear_conv_kernel
    return 4 * d * h * e + 2 * d * h + 2 * h + h * e + 3 * h * e * kernel


def linear_scan_flops(cfg: ModelConfig, tokens: int, size: int | None = None) -> float:
    """chunked_scan of one sequence of `tokens` tokens from a state, in chunks of `size` (default
    model.memory_caching.linear_chunk), padded to whole chunks (projections excluded): per chunk
    and head q k^T and scores v (2 C^2 E each), the chunk's writes and q S (2 C E^2 each); per
    head the state passing's [N + 1, N + 1] transfer product (2 (N + 1)^2 E^2)."""
    h, e = cfg.n_heads, cfg.head_dim
    size = size or cfg.memory_caching.linear_chunk
    chunks = -(-tokens // size)
    return h * (chunks * (4 * size * size * e + 4 * size * e * e) + 2 * (chunks + 1) ** 2 * e * e)


def linear_segments_flops(cfg: ModelConfig, tokens: int, length: int, continues: bool) -> float:
    """LinearMemory.scan_segments over `tokens` tokens in segments of `length`: each padded to whole
    chunks of min(linear_chunk, length); one scan (continues) or one per segment."""
    size = min(cfg.memory_caching.linear_chunk, length)
    segments, padded = -(-tokens // length), -(-length // size) * size
    if continues:
        return linear_scan_flops(cfg, segments * padded, size)
    return segments * linear_scan_flops(cfg, padded, size)


def linear_projection_flops(cfg: ModelConfig) -> float:
    """Per token: wq, wk, wv, wo, the gates and the convolutions."""
    d, h, e, kernel = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.memory_caching.linear_conv_kernel
    return 2 * (4 * d * h * e + 2 * d * h + 3 * h * e * kernel)


# ---------------------------------------------------------------------------------------------
# Context parallelism: the messages of cp.py, counted.


def _sizes(mcfg: ModelConfig) -> tuple[bool, bool, bool, int, int]:
    """(deep, continues, gated, convolution taps, P = sum of the memory layers' i x o)."""
    mc, deep = mcfg.memory_caching, mcfg.arch == "deep_memory"
    dims = memory_dims(mcfg.head_dim, mcfg.titans.memory_depth, mcfg.titans.memory_expansion) if deep else [
        mcfg.head_dim] * 2
    p = sum(i * o for i, o in zip(dims[:-1], dims[1:]))
    taps = mcfg.titans.conv_kernel if deep else mc.linear_conv_kernel
    return deep, mc.continues, mc.variant in ("grm", "soup", "ssc"), taps, p


def segments_per_slice(mcfg: ModelConfig, cp: int) -> int:
    mc = mcfg.memory_caching
    return 1 if mc.variant == "none" else mcfg.seq_len // (cp * mc.segment)


def halo_bytes(mcfg: ModelConfig, micro_batch: int, elem: int = 4) -> int:
    """One layer's halo, sent rank r -> r + 1 forward and its gradient back (cp.py's module doc)."""
    return elem * micro_batch * max(_sizes(mcfg)[3] - 1, 0) * mcfg.d_model


def handover_sizes(mcfg: ModelConfig, micro_batch: int, before: int, elem: int = 4) -> tuple[int, int]:
    """(tensors, bytes) of one layer's deep-memory handover after `before` segments (the chain's
    message, cp.py's module doc; the same again for its gradient); fp32."""
    deep, continues, gated, _, p = _sizes(mcfg)
    caches = mcfg.memory_caching.variant != "none"
    depth = mcfg.titans.memory_depth
    tensors = 2 * depth * continues + depth * caches + gated
    per_head = 2 * p * continues + before * p * caches + before * mcfg.head_dim * gated
    return tensors, elem * micro_batch * mcfg.n_heads * per_head


def cp_messages(mcfg: ModelConfig, layer: int, width: int, micro_batch: int, cp: int, act_bytes: int = 4,
                attention: str = "allgather") -> tuple[CPMessage, ...]:
    """FamilySpec.cp_messages of both families: the convolution halo (halo_bytes, the mixer's input
    rows in the activations' dtype) and the deep memory's chain, its largest hop (the handover into
    the last rank, which carries the cache of the (cp - 1) n segments before it: handover_sizes),
    or the linear memory's prefix all-gather (summary_sizes). Under Ulysses (parallel.cp_attention=
    ulysses, cp.py ulysses_reads) neither: the all-to-alls of the memory's inputs (q, k, v, the gates:
    3 per head deep, 2 linear, and W_u's projection in the gated variants) and of its reads."""
    if attention == "ulysses":
        deep, _, gated, _, _ = _sizes(mcfg)
        return (CPMessage(ALLTOALL, ulysses_bytes(mcfg, micro_batch, cp, act_bytes, 3 if deep else 2, int(gated)),
                          "features"),)
    halo = halo_bytes(mcfg, micro_batch, act_bytes)
    out = (CPMessage(HALO, halo, "rows"),) if halo else ()
    if mcfg.arch == "deep_memory":
        before = (cp - 1) * segments_per_slice(mcfg, cp)
        return out + (CPMessage(CHAIN, handover_sizes(mcfg, micro_batch, before)[1]),)
    return out + (CPMessage(ALLGATHER, summary_sizes(mcfg, cp, micro_batch)[1], "summary"),)


def summary_sizes(mcfg: ModelConfig, cp: int, micro_batch: int, elem: int = 4) -> tuple[int, int]:
    """(all-gathers, bytes of their gathered buffers) of one layer's linear-memory prefix (cp.py's
    module doc; backward reduce-scatters the same)."""
    gated, e = _sizes(mcfg)[2], mcfg.head_dim
    n = segments_per_slice(mcfg, cp)
    return 2 + gated, elem * cp * n * micro_batch * mcfg.n_heads * (1 + e * e + e * gated)
