"""Memory Caching (memory_caching/model.py) under context parallelism (parallel.cp): what a slice
of a sequence receives from the slices before it (parallel/cp/state.py).

Split: contiguous (rank r holds tokens [r S / cp, (r + 1) S / cp)), and every slice is whole
segments (`check_cp_layout`): rank r's n = S / (cp x segment) segments are the sequence's segments
r n .. r n + n - 1 (variant none: one segment, the slice). A slice starts from the Memory Caching
state the slices before it leave, its "handover":
    start    the online memory's state (write_mode checkpoint, and variant none); independent
             writes restart every segment from the base's initial state instead
    cache    the end states M^(i) of the N = r n segments before the slice (variants that cache),
             per memory layer [B, H, N, i, o]
    pooled   their mean keys kbar_i [B, H, N, E] (grm, soup, ssc)
With it, the slice runs exactly the one-process code of its segments (global indices N.., the
cached reads and weights over all N + i cached states).

Linear memory (associative: a segment maps a state S to a S + U, a its decay product, U the state
it reaches from zero): prefix. Each rank's summary is (log a, U, kbar) of each of its segments,
[B, H, n], [B, H, n, E, E], [B, H, n, E], computed from its features without the scan
(U = sum_j exp(l_T - l_j) b_j k_j v_j^T: 2 T E^2 FLOPs per head, a quarter of the chunked scan's
FLOPs when E equals the chunk; not in the FLOP model); prefix_state all-gathers them and `fold`s
those of the earlier ranks, segment by segment, into the handover (the fold's state is the
handover itself, so the cache grows as it folds). Nobody waits in a chain. Bytes per layer, fp32,
all-gathered forward and reduce-scattered backward: cp x n x B x H x (E^2 + 1 [+ E gated]) x 4 in
the gathered buffer (each rank receives (cp - 1) / cp of it); variant none: n = 1 and no kbar.

Deep memory (not associative): chain. Rank r receives the handover from rank r - 1 before its
scan (receive_state) and sends the one at its end (its last state, the cache with its own
segments' end states, their kbar) to rank r + 1 after its reads (send_state). Bytes from rank r to
r + 1 per layer and direction, fp32: B x H x (2 x P [continuing writes] + (r + 1) n x P [caching]
+ (r + 1) n x E [gated]) x 4, P = sum of the memory's i x o (the weights and the surprise of each
layer; the cache holds weights only). Nothing else in the layer joins the cp ranks, so the ranks
run as a wavefront: L layers take L + cp - 1 layer-slices forward and again backward. Independent
writes do not need the previous segment's state, but soup's scan mixes the cached states, so the
chain carries the cache for every variant (one code path). The handover travels in the dtypes of
the base's initial state (fp32 parameters) and of the keys, which are those of one process's end
states and mean keys also under bf16 autocast (the states stay fp32, the keys are bf16).

memory_caching/cost.py's halo_bytes, handover_sizes and summary_sizes count these messages
(benchmarks/cp_memory_caching.py compares them with the c10d calls it records).

Convolutions on q, k, v (K taps) read the last K - 1 projected inputs of the slice before:
previous_rows of the mixer's input x [B, K - 1, D] (halo, bytes B x (K - 1) x D x 4 per layer
and direction), projected here by the bias-free wk, wv, wq (rank 0's zero rows project to the
one-process zero padding).

parallel.cp_attention=ulysses (`ulysses_reads`): no handover. Every state, cached state, mean key,
score and weight of Memory Caching is per head, so each rank runs the one-process mixer on the whole
sequence for H / cp of the heads (any split: slices need not hold whole segments or chunks):

    the rank's tokens' q, k, v projections before the convolution, the gate pre-activations (g = 3
      per head deep, 2 linear) and W_u's projection (gated variants) [B, s, H, 3 E + g (+ E)]
      -> all-to-all (parallel/cp/ulysses.py seq_to_heads) -> [B, S, H / cp, ...]
    convolution (those heads' taps), gates, MemoryCachingMixer.head_reads (segments, cache, scores)
    reads [B, S, H / cp, E] -> all-to-all back -> [B, s, H, E] -> the read-out per token
    documents: the ranks' doc_start all-gathered (SequenceSplit.sequence_starts, as attention's),
      the channels packed as one process packs x (padding rows: the channels of a zero row)

Bytes per layer and micro-batch (cost.py cp_messages): the two buffers a B s H (4 E + g (+ E))
forward and again backward, (cp - 1) / cp of each leaving the rank; with documents also B S bytes
of doc_start all-gathered. Nothing waits in a chain: the deep memory's wavefront and the linear
memory's prefix are gone, and each rank's activations are those of S tokens for H / cp heads.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import torch

from megatron_taper.models.titans.cp import head_channels, head_features, pack_channels, ulysses_heads
from megatron_taper.models.titans.documents import starts_inside
from megatron_taper.models.titans.neural_memory import ALL_HEADS, ConvPast, State

if TYPE_CHECKING:
    from megatron_taper.models.memory_caching.model import MemoryCachingMixer


class Handover(NamedTuple):
    start: State  # the online memory's state at the slice's start
    cache: list[torch.Tensor]  # per memory layer the end states of the N earlier segments [B, H, N, i, o]
    pooled: torch.Tensor | None  # their mean keys [B, H, N, E] (gated variants)
    received: tuple[torch.Tensor, ...]  # what the slice was handed (their backward must run on every rank)


def conv_past(mixer: MemoryCachingMixer, x: torch.Tensor) -> ConvPast:
    """The convolutions' inputs before this slice (module doc), or None (no split or no taps)."""
    memory, split = mixer.memory, mixer.context
    if split is None or memory.conv_q is None or memory.conv_q.shape[1] < 2:
        return None
    from megatron_taper.parallel.cp.state import previous_rows

    before = previous_rows(split, mixer.context_tag, x, memory.conv_q.shape[1] - 1)  # [B, K - 1, D]
    return tuple(proj(before) for proj in (memory.wk, memory.wv, memory.wq))


def _chained(mixer: MemoryCachingMixer):
    """The split whose slices hand over their state (module doc), or None: no split, or Ulysses (each
    rank scans the whole sequence for its heads)."""
    split = mixer.context
    return None if split is None or split.attention == "ulysses" else split


def receive(mixer: MemoryCachingMixer, features: tuple, segments: list[slice], pooled: torch.Tensor | None,
            batch: int, heads: slice = ALL_HEADS) -> Handover:
    """The handover this slice starts from (module doc); pooled: the mean keys of its own segments;
    `heads`: the memory's heads the features are of (Ulysses)."""
    memory, split = mixer.memory, _chained(mixer)
    if split is None:
        return Handover(memory.init_state(batch, heads), [], None, ())
    if mixer.linear:
        return _prefix(mixer, features, segments, pooled, batch)
    return _chain_in(mixer, len(segments) * split.rank, features[0], batch)


def send(mixer: MemoryCachingMixer, y: torch.Tensor, state: State, finals: list[torch.Tensor],
         pooled: torch.Tensor | None, handover: Handover) -> torch.Tensor:
    """y (the mixer's reads), after handing this slice's end handover to the next rank (deep
    memory) or tying what it was handed (linear memory); module doc."""
    split = _chained(mixer)
    if split is None:
        return y
    from megatron_taper.parallel.cp.state import send_state, tie

    if mixer.linear:
        return tie(y, *handover.received)
    if split.rank == split.cp - 1:
        return y
    like = handover.received  # the same dtypes as what this rank was handed, in the same order
    out = (state[0] + state[1] if mixer.continues else [])
    out += list(finals) if mixer.caches else []  # per layer [B, H, N + n, i, o]
    out += [pooled] if pooled is not None else []
    return send_state(split, mixer.context_tag, y, [t.to(w.dtype) for t, w in zip(out, like)])


def _chain_initial(mixer: MemoryCachingMixer, before: int, keys: torch.Tensor | None,
                   batch: int) -> list[torch.Tensor]:
    """Tensors shaped as the chain's handover after `before` segments (flat: state, cache, pooled);
    keys: the slice's keys [B, H, T, E] for the gated variants, else None."""
    weights, surprise = mixer.memory.init_state(batch)
    flat = list(weights) + list(surprise) if mixer.continues else []
    if mixer.caches:
        flat += [w.new_zeros(()).expand(*w.shape[:2], before, *w.shape[2:]) for w in weights]
    if keys is not None:
        flat.append(keys.new_zeros(()).expand(*keys.shape[:2], before, keys.shape[-1]))
    return flat


def _chain_in(mixer: MemoryCachingMixer, before: int, k: torch.Tensor, batch: int) -> Handover:
    from megatron_taper.parallel.cp.state import receive_state

    keys = k if mixer.wu is not None else None
    flat = list(receive_state(mixer.context, mixer.context_tag, _chain_initial(mixer, before, keys, batch)))
    depth = len(mixer.memory.init_state(batch)[0])
    start = (flat[:depth], flat[depth:2 * depth]) if mixer.continues else mixer.memory.init_state(batch)
    rest = flat[2 * depth:] if mixer.continues else flat
    cache = list(rest[:depth]) if mixer.caches else []
    return Handover(start, cache, rest[-1] if keys is not None else None, tuple(flat))


def linear_summary(features: tuple, segments: list[slice], pooled: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """What each segment does to a linear memory's state (module doc): log a [B, H, n], U
    [B, H, n, E, E], and the segments' mean keys [B, H, n, E] when given; all segments at once
    (the last, if shorter, padded with tokens that neither write nor decay)."""
    from megatron_taper.models.memory_caching.linear_memory import chunk_writes, time_blocks

    k, v, log_a, b = (time_blocks(features[i], segments[0].stop) for i in (0, 1, 3, 4))  # [B, H, n, L, ...]
    lb, updates = chunk_writes(k, v, log_a, b)
    return (lb[..., -1], updates, *(() if pooled is None else (pooled,)))


def fold(continues: bool, caches: bool, state: tuple[torch.Tensor, ...],
         summary: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The linear handover (S, [cache [B, H, N, E, E]], [pooled [B, H, N, E]]) after the segments
    of `summary` (linear_summary): S <- a S + U each (U alone for independent writes), each end
    state cached and each mean key appended."""
    from megatron_taper.models.kernels.state_passing import chunk_states

    rest = list(state[1:])
    logs, updates, *keys = summary
    finals = chunk_states(updates, logs, state[0])[:, :, 1:] if continues else updates  # [B, H, n, E, E]
    out = [finals[:, :, -1]]
    if caches:
        out.append(torch.cat((rest.pop(0), finals), dim=2))
    if keys:
        out.append(torch.cat((rest.pop(0), keys[0]), dim=2))
    return tuple(out)


def _prefix(mixer: MemoryCachingMixer, features: tuple, segments: list[slice], pooled: torch.Tensor | None,
            batch: int) -> Handover:
    from megatron_taper.parallel.cp.state import prefix_state

    memory = mixer.memory
    zero = memory.init_state(batch)[0][0]  # [B, H, E, E]
    initial = [zero]
    if mixer.caches:
        initial.append(zero.new_zeros(*zero.shape[:2], 0, *zero.shape[2:]))
    if pooled is not None:
        initial.append(pooled[:, :, :0])
    state = prefix_state(mixer.context, initial, linear_summary(features, segments, pooled),
                         functools.partial(fold, mixer.continues, mixer.caches))
    start = ([state[0]], []) if mixer.continues else memory.init_state(batch)
    cache = [state[1]] if mixer.caches else []
    return Handover(start, cache, state[-1] if pooled is not None else None, tuple(state))


def ulysses_reads(mixer: MemoryCachingMixer, x: torch.Tensor, doc_start: torch.Tensor | None) -> torch.Tensor:
    """parallel.cp_attention=ulysses: the mixer's per-head reads [B, H, s, E] of this rank's slice x
    [B, s, D] (module doc, Ulysses): the whole sequence's channels of H / cp heads, one process's
    mixer on them (with documents: packed from the whole sequence's doc_start), the reads back."""
    from megatron_taper.parallel.cp.ulysses import heads_to_seq, seq_to_heads

    memory, split = mixer.memory, mixer.context
    extra = () if mixer.wu is None else (mixer.wu,)
    heads = ulysses_heads(split, memory.wq.weight.shape[0] // memory.head_dim)
    mine = seq_to_heads(head_channels(memory, x, extra), split, None)  # [B, S, H / cp, 3 E + g (+ E)]
    whole = None if doc_start is None else starts_inside(split.sequence_starts(doc_start))
    packing = None if whole is None else mixer.packing(whole)
    if packing is not None:  # as one process's packed zeros: the channels of a zero row in the padding
        mine = pack_channels(packing, mine, head_channels(memory, x.new_zeros(1, 1, x.shape[2]), extra)[0, 0, heads])
    features, u = head_features(memory, mine, heads, None if packing is None else packing.positions)
    reads = mixer.head_reads(features, u[0] if extra else None, packing, heads)  # [B, H / cp, S, E]
    if packing is not None:
        reads = packing.unpack(reads, dim=2)
    return heads_to_seq(reads.transpose(1, 2), split, None).transpose(1, 2)
