"""Cost-balanced contiguous split of a layer stack into pipeline stages (pure; no torch.distributed).

Problem: layers 0..L-1 with costs c_l go, in order, onto S stages (each stage at least one layer);
stage 0 also carries `first` (the embedding), stage S-1 carries `last` (final norm, LM head and
loss). Minimise the slowest stage: max_s (sum of its layer costs + its extra).

Method (exact): dynamic programming over (stage, prefix end). Phase 1 finds the optimal
bottleneck B*. Phase 2 restricts every stage to cost <= B* (and to its memory limit) and picks,
among those optimal splits, the one with the smallest sum of squared stage costs (the most even
one); remaining ties go to the lexicographically smallest boundary vector, i.e. earlier stages
take as few layers as possible. The same inputs therefore always give the same split, on every
rank, with no randomness. Costs are compared exactly (floats as given), so integer costs give
integer-exact answers. Time O(S * L^2), instant for any real model.

Memory limits (optional): stage s must satisfy bytes(s) <= limit(s), where bytes is the
predicted peak of one rank holding it (megatron_taper/cost/memory.py: parameters, gradients and
optimizer state after tp / ZeRO sharding, plus the activations of the micro-batches in flight,
tp-, sequence-parallel-, checkpointing- and dtype-aware, the largest moment of a backward, the
head's loss buffers and the pipeline's p2p buffers). Under 1F1B stage s holds up to
min(pp - s, m) micro-batches in flight, under GPipe all m. No feasible split -> ValueError
naming the key and how far over its limit the best split's fullest stage is.

Virtual stages (interleaved schedules): the stack is cut into pp * v chunks with the same
objective, chunk c lives on pp rank c % pp (looped placement, as torch's interleaved 1F1B and
interleaved zero-bubble schedules expect), or, for the V schedules (zbv, dualpipev: 2 chunks per
rank), on rank c for c < pp and 2 pp - 1 - c after (rank 0 holds the first and the last chunk);
the embedding is on chunk 0 and the head on the last chunk. Memory limits are only
modelled for v = 1 (an interleaved rank's in-flight count depends on the chunk) and are refused
otherwise; a multi-chunk rank's predicted peak is PipelinePlan.rank_peak_bytes (interleaved 1F1B;
ZB-V by walking torch's action list for the rank, zbv_actions).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from megatron_taper.config import PP_BALANCE_MODES
from megatron_taper.cost.block import prefix_sums
from megatron_taper.cost.flops import model_costs
from megatron_taper.cost.memory import GIB, MemorySetup, model_memory
from megatron_taper.cost.stage_memory import MemoryModel, to_memory_model

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig

@dataclass(frozen=True)
class Partition:
    bounds: tuple[int, ...]  # stage s holds layers bounds[s] .. bounds[s+1]-1
    costs: tuple[float, ...]  # per stage, extras included

    @property
    def stages(self) -> list[list[int]]:
        return [list(range(a, b)) for a, b in zip(self.bounds, self.bounds[1:])]

    @property
    def bottleneck(self) -> float:
        return max(self.costs)

    @property
    def ideal(self) -> float:
        return sum(self.costs) / len(self.costs)

    @property
    def bottleneck_over_ideal(self) -> float:
        return self.bottleneck / self.ideal if self.ideal > 0 else 1.0


def evaluate(bounds: Sequence[int], costs: Sequence[float], first: float = 0.0, last: float = 0.0) -> Partition:
    """The stage costs of a given split (stage s = layers bounds[s]..bounds[s+1]-1)."""
    n = len(bounds) - 1
    assert bounds[0] == 0 and bounds[-1] == len(costs) and all(a < b for a, b in zip(bounds, bounds[1:]))
    pre = prefix_sums(costs)
    out = []
    for s in range(n):
        c = pre[bounds[s + 1]] - pre[bounds[s]]
        c += (first if s == 0 else 0.0) + (last if s == n - 1 else 0.0)
        out.append(c)
    return Partition(tuple(bounds), tuple(out))


def partition(costs: Sequence[float], n_stages: int, first: float = 0.0, last: float = 0.0,
              memory: MemoryModel | None = None, key: str = "parallel.pp") -> Partition:
    """Exact min-max contiguous split of `costs` into `n_stages` non-empty stages (see module doc)."""
    n = len(costs)
    assert 1 <= n_stages <= n, f"{n_stages} stages for {n} layers (preflight refuses more stages than layers)"
    if any(c < 0 or math.isnan(c) for c in costs) or first < 0 or last < 0:
        raise ValueError(f"layer costs must be non-negative numbers (balancing for {key})")
    if memory is not None:
        assert len(memory.in_flight) == n_stages and len(memory.limits) == n_stages
        assert len(memory.static) == n and len(memory.act) == n
    pre = prefix_sums(costs)
    s_pre = prefix_sums(memory.static) if memory else []
    a_pre = prefix_sums(memory.act) if memory else []
    table = memory.peak_table(a_pre) if memory and memory.peak else None

    def cost(s: int, lo: int, hi: int) -> float:
        c = pre[hi] - pre[lo]
        if s == 0:
            c += first
        if s == n_stages - 1:
            c += last
        return c

    def fits(s: int, lo: int, hi: int) -> bool:
        return memory is None or memory.stage_bytes(s, n_stages, lo, hi, s_pre, a_pre, table) <= memory.limits[s]

    inf = math.inf
    # Phase 1 (suffix form): best[s][i] = min bottleneck of stages s..S-1 over layers i..L-1.
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    best[n_stages][n] = -inf
    for s in range(n_stages - 1, -1, -1):
        # stage s starts at i >= s and leaves at least one layer per later stage
        for i in range(s, n - (n_stages - s) + 1):
            b = inf
            for j in range(i + 1, n - (n_stages - s - 1) + 1):
                rest = best[s + 1][j]
                if rest == inf or not fits(s, i, j):
                    continue
                b = min(b, max(cost(s, i, j), rest))
            best[s][i] = b
    bottleneck = best[0][0]
    if bottleneck == inf:
        assert memory is not None
        raise ValueError(_no_fit_message(memory, n, n_stages, s_pre, a_pre, table))

    # Phase 2: among splits with every stage <= bottleneck (and fitting), minimise sum of squares.
    sq = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    nxt = [[-1] * (n + 1) for _ in range(n_stages + 1)]
    sq[n_stages][n] = 0.0
    for s in range(n_stages - 1, -1, -1):
        for i in range(s, n - (n_stages - s) + 1):
            for j in range(i + 1, n - (n_stages - s - 1) + 1):  # ascending j: ties keep the smallest
                rest = sq[s + 1][j]
                c = cost(s, i, j)
                if rest == inf or c > bottleneck or not fits(s, i, j):
                    continue
                total = c * c + rest
                if total < sq[s][i]:
                    sq[s][i], nxt[s][i] = total, j
    bounds = [0]
    for s in range(n_stages):
        bounds.append(nxt[s][bounds[-1]])
    assert bounds[-1] == n
    return Partition(tuple(bounds), tuple(cost(s, bounds[s], bounds[s + 1]) for s in range(n_stages)))


def _no_fit_message(memory: MemoryModel, n: int, n_stages: int, s_pre: list[float], a_pre: list[float],
                    table: list[list[float]] | None) -> str:
    # The smallest achievable max(bytes / limit) tells the user how far off the limits are.
    need = [[math.inf] * (n + 1) for _ in range(n_stages + 1)]
    need[n_stages][n] = 0.0
    for s in range(n_stages - 1, -1, -1):
        for i in range(s, n - (n_stages - s) + 1):
            for j in range(i + 1, n - (n_stages - s - 1) + 1):
                used = memory.stage_bytes(s, n_stages, i, j, s_pre, a_pre, table) / max(memory.limits[s], 1e-30)
                need[s][i] = min(need[s][i], max(used, need[s + 1][j]))
    gib = max(memory.limits) / GIB
    return (f"no split of {n} layers into {n_stages} pipeline stages fits the per-stage memory limit "
            f"({memory.key}: {gib:.3g} GiB on the largest stage); the best split needs {need[0][0]:.2f}x the "
            f"limit on its fullest stage. Raise {memory.key}, use more stages (parallel.pp), "
            f"train.activation_checkpointing, fewer micro-batches in flight or a smaller train.micro_batch")


def in_flight_microbatches(n_stages: int, microbatches: int, schedule: str = "1f1b") -> list[int]:
    """Micro-batches whose activations stage s holds at once: 1F1B min(pp - s, m); GPipe m."""
    if schedule == "gpipe":
        return [microbatches] * n_stages
    return [min(n_stages - s, microbatches) for s in range(n_stages)]


# ---------------------------------------------------------------------------------------------
# Plans for a model config


@dataclass
class StagePlan:
    layers: list[int]
    rank: int  # pp rank holding this stage (chunk_rank)
    flops: float  # forward FLOPs per token, embedding / head included
    params: int
    static_bytes: float  # one rank: params + grads + optimizer states (+ unsharded / cast weights)
    act_bytes: float  # one rank: activations at the peak (micro-batches in flight) + pipeline buffers
    cost: float  # the balanced metric (flops, params, 1 per layer, or seconds)
    peak_bytes: float = 0.0  # static_bytes + act_bytes: the predicted peak of one rank (v = 1)
    kept_bytes: float = 0.0  # one micro-batch's activations kept for backward (K)
    buffer_bytes: float = 0.0  # its p2p buffers (in act_bytes)
    retained_bytes: float = 0.0  # one micro-batch's, after a split backward's input pass (PieceMemory.retained)


@dataclass
class PipelinePlan:
    pp: int
    virtual: int
    balance: str
    stages: list[StagePlan]
    bottleneck_over_ideal: float  # by FLOPs, for this split
    uniform_bottleneck_over_ideal: float  # by FLOPs, for the layer-count split
    uniform_stages: list[list[int]] = field(default_factory=list)
    memory: MemorySetup | None = None  # what the memory columns assumed
    v_shape: bool = False  # V placement of 2 chunks per rank (zbv, dualpipev), else looped
    schedule: str = "1f1b"

    @property
    def stage_layers(self) -> list[list[int]]:
        return [s.layers for s in self.stages]

    def rank_chunks(self, pp_rank: int) -> list[int]:
        """Indices of the (virtual) stages on this pp rank, in schedule order."""
        return [c for c in range(len(self.stages)) if chunk_rank(c, self.pp, self.v_shape) == pp_rank]

    def rank_static_bytes(self, pp_rank: int) -> float:
        """Parameters, gradients, optimizer state and gathered weights of all chunks of a pp rank.
        fsdp2 shards each chunk on its own and keeps it gathered from its first forward to its
        last backward of the step; torch's multi-chunk schedules keep at most 3 chunks of a rank
        gathered (the others are resharded between uses, their unsharded gradients kept), so
        beyond 3 chunks per rank this is an upper bound."""
        return sum(self.stages[c].static_bytes for c in self.rank_chunks(pp_rank))

    def rank_peak_bytes(self, pp_rank: int) -> float | None:
        """Predicted peak of a pp rank with all its chunks: their static bytes and p2p buffers
        plus multi_chunk_activations; None where that is not modelled (interleaved_zero_bubble,
        dualpipev)."""
        ids = self.rank_chunks(pp_rank)
        chunks = [self.stages[c] for c in ids]
        if len(chunks) == 1:
            return chunks[0].peak_bytes
        if self.memory is None:
            return None
        act = multi_chunk_activations(self.schedule, self.pp, self.memory.microbatches, pp_rank, ids,
                                      len(self.stages), [s.kept_bytes for s in chunks],
                                      [s.act_bytes - s.buffer_bytes for s in chunks],
                                      [s.retained_bytes for s in chunks])
        return None if act is None else self.rank_static_bytes(pp_rank) + sum(s.buffer_bytes for s in chunks) + act


def multi_chunk_activations(schedule: str, pp: int, microbatches: int, pp_rank: int, chunk_ids: Sequence[int],
                            n_chunks: int, kept: Sequence[float], tops: Sequence[float], retained: Sequence[float],
                            moments: dict | None = None) -> float | None:
    """Activation bytes at the peak of pp rank `pp_rank` holding the chunks `chunk_ids` (of
    `n_chunks`, in schedule order) that keep `kept` per micro-batch, reach `tops` in their
    backward and keep `retained` more between a split backward's passes: interleaved 1F1B by
    interleaved_activations (n = interleaved_in_flight), ZB-V by walking torch's action list
    (zbv_actions, split_backward_activations); None for the other schedules (not modelled).
    `moments`: a dict the caller keeps to reuse split_backward_moments across calls (a search)."""
    if schedule == "zbv":
        first = chunk_ids.index(0) if 0 in chunk_ids else None
        key = (pp, microbatches, pp_rank, first)
        moments = {} if moments is None else moments
        if key not in moments:
            every = split_backward_moments(zbv_actions(pp, microbatches, pp_rank), first)
            moments[key] = every, _undominated(every)
        every, undominated = moments[key]
        # finite bytes >= 0: a moment whose counts are all at most another's is at most its value
        # (float * and + round monotonically), so the maximum over the undominated ones is the same number
        counted = (*kept, *tops, *retained)
        finite = min(counted, default=0.0) >= 0.0 and math.isfinite(sum(counted))
        return _evaluate(undominated if finite else every, kept, tops, retained)
    if schedule != "interleaved_1f1b":
        return None
    n = interleaved_in_flight(pp, len(chunk_ids), microbatches, pp_rank)
    return interleaved_activations(kept, tops, n, chunk_ids.index(n_chunks - 1) if n_chunks - 1 in chunk_ids else None)


def zbv_actions(pp: int, microbatches: int, rank: int) -> list[tuple[str, int, int]]:
    """The actions of pp rank `rank` under torch.distributed.pipelining's ScheduleZBVZeroBubble
    (its _calculate_single_rank_operations, torch 2.13), in order: (F forward | I input-gradient
    pass | W weight-gradient pass, local chunk 0 = stage `rank` or 1 = stage 2 pp - 1 - rank,
    micro-batch). tests/parallel/test_plan_layout.py compares it with torch's."""
    n = max(2 * pp - 1, microbatches)  # torch plans at least this many, then drops the extra ones
    ops: list[tuple[str, int, int]] = []
    count = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}

    def fwd(chunk: int) -> None:
        ops.append(("F", chunk, count[("F", chunk)]))
        count[("F", chunk)] += 1

    def bwd(chunk: int, weight: bool = True) -> None:
        ops.append(("I", chunk, count[("B", chunk)]))
        if weight:
            ops.append(("W", chunk, count[("B", chunk)]))
        count[("B", chunk)] += 1

    for _ in range(2 * (pp - rank) - 1):
        fwd(0)
    for _ in range(rank):
        fwd(1)
        fwd(0)
    for _ in range(pp - rank):
        fwd(1)
        bwd(1)
    while count[("F", 1)] < count[("F", 0)] or count[("F", 0)] < n:
        if count[("F", 0)] < n:
            fwd(0)
        bwd(0)
        fwd(1)
        bwd(1)
    w = {0: count[("B", 0)], 1: count[("B", 1)]}
    for _ in range(rank):
        bwd(0, weight=False)
        bwd(1, weight=False)
    for _ in range(pp - rank):
        bwd(0, weight=False)
        ops.append(("W", 0, w[0]))
        w[0] += 1
    for chunk in (1, 0):
        while w[chunk] < count[("B", chunk)]:
            ops.append(("W", chunk, w[chunk]))
            w[chunk] += 1
    return [op for op in ops if op[2] < microbatches]


def split_backward_activations(actions: Sequence[tuple[str, int, int]], kept: Sequence[float],
                               tops: Sequence[float], retained: Sequence[float], first: int | None) -> float:
    """Activation bytes at the peak of a rank running `actions` (zbv_actions' form) on chunks that
    keep `kept` per micro-batch after F, reach `tops` in a backward (PieceMemory.peak's moments
    over the chunk, the head's new weight gradient included) and keep `retained` more from I to W.
    I of a micro-batch: the other micro-batches' bytes plus its chunk's top; then kept + retained
    until its W, whose moment is the larger of that and the top. The first stage's chunk (`first`:
    its index, or None) has no input gradient to make: torch skips its I and runs the whole
    backward at W. Each moment is the bytes held besides the micro-batch being processed plus its
    own (the forward's transients are not counted)."""
    return _evaluate(split_backward_moments(actions, first), kept, tops, retained)


def split_backward_moments(actions: Sequence[tuple[str, int, int]], first: int | None
                           ) -> set[tuple[int, ...]]:
    """The distinct moments of split_backward_activations, each as counts (k0, k1, r0, r1, t0, t1):
    micro-batches of chunk c held after F (k, at kept[c]) and after I (r, at kept[c] +
    retained[c]), and the chunk whose top is reached (t). They depend on the action list alone,
    and the steady state repeats the same few, so a search evaluates them per layout cheaply."""
    state = {}  # (chunk, mb) -> "k" | "r"
    k, r = [0, 0], [0, 0]
    out: set[tuple[int, ...]] = set()

    def moment(top: int | None = None, extra: str = "") -> None:
        kk, rr = list(k), list(r)
        if extra:
            (kk if extra == "k" else rr)[chunk] += 1
        out.add((*kk, *rr, int(top == 0), int(top == 1)))

    for kind, chunk, mb in actions:
        held = state.pop((chunk, mb), "")
        if held:
            (k if held == "k" else r)[chunk] -= 1
        if kind == "F" or (kind == "I" and chunk == first):
            moment(extra="k")
            state[(chunk, mb)] = "k"
        elif kind == "I":
            moment(top=chunk)
            state[(chunk, mb)] = "r"
        elif chunk == first:  # W: the first stage's whole backward
            moment(top=chunk)
        else:  # W: the weight pass, the larger of its top and what its I left
            moment(top=chunk)
            moment(extra="r")
        kind_now = state.get((chunk, mb), "")
        if kind_now:
            (k if kind_now == "k" else r)[chunk] += 1
    return out


def _undominated(moments: set[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The moments no other moment is at least as large as in every count (the steady state's
    repeats leave a tenth or fewer). Largest total first: a moment's dominators have larger totals,
    and one dominated by a dominated moment is dominated by that one's dominator, so comparing it
    with the undominated ones found so far suffices."""
    out: list[tuple[int, ...]] = []
    for m in sorted(moments, key=sum, reverse=True):
        if not any(all(a <= b for a, b in zip(m, o)) for o in out):
            out.append(m)
    return out


def _evaluate(moments: set[tuple[int, ...]], kept: Sequence[float], tops: Sequence[float],
              retained: Sequence[float]) -> float:
    after_i = [kept[c] + retained[c] for c in range(len(kept))]
    padded = [*kept, 0.0][:2], [*after_i, 0.0][:2], [*tops, 0.0][:2]
    return max((k0 * padded[0][0] + k1 * padded[0][1] + r0 * padded[1][0] + r1 * padded[1][1]
                + t0 * padded[2][0] + t1 * padded[2][1] for k0, k1, r0, r1, t0, t1 in moments), default=0.0)


def interleaved_activations(kept: Sequence[float], tops: Sequence[float], n: int, last: int | None) -> float:
    """Activation bytes at the peak of a pp rank whose chunks keep `kept` bytes per micro-batch and
    reach `tops` in their backward, with n micro-batches in flight under interleaved 1F1B. The
    last virtual stage (`last`, index into the chunks, or None when not on this rank) runs each
    forward straight into its backward, so it holds one micro-batch at most; the other chunks
    hold the rest, each booked at the largest of them (an upper bound: they mix). The peak is
    the larger of the last stage's backward beside n - 1 of the others and another chunk's
    backward beside n - 2 of the others and one of the last stage's."""
    others = [k for i, k in enumerate(kept) if i != last]
    if last is None:
        return (n - 1) * max(kept) + max(tops)
    other_kept = max(others, default=0.0)
    at_last = (n - 1) * other_kept + tops[last]
    other_tops = [t for i, t in enumerate(tops) if i != last]
    at_other = max(0, n - 2) * other_kept + kept[last] + max(other_tops) if other_tops else 0.0
    return max(at_last, at_other)


def interleaved_in_flight(pp: int, virtual: int, microbatches: int, pp_rank: int) -> int:
    """Chunk micro-batches whose activations a pp rank holds at most under torch's interleaved
    1F1B: its warm-up forwards ((v - 1) x the micro-batches of a round + 2 per hop from the last
    rank, at most v x m) and the steady state's one more."""
    per_round = microbatches // max(1, microbatches // pp)
    warmup = min((virtual - 1) * per_round + 2 * (pp - 1 - pp_rank), virtual * microbatches)
    return min(warmup + 1, virtual * microbatches)


def chunk_rank(chunk: int, pp: int, v_shape: bool = False) -> int:
    """The pp rank holding (virtual) stage `chunk` (module doc)."""
    if v_shape and chunk >= pp:
        return 2 * pp - 1 - chunk
    return chunk % pp


def plan_pipeline(model_cfg: ModelConfig, pp: int, *, virtual: int = 1, balance: str = "flops", microbatches: int = 0,
                  micro_batch: int = 1, schedule: str = "1f1b", memory_gb: Sequence[float] | None = None,
                  bytes_per_param: float | None = None, measured: tuple[list[float], float, float] | None = None,
                  memory_key: str = "parallel.pp_memory_gb", setup: MemorySetup | None = None,
                  v_shape: bool = False) -> PipelinePlan:
    """Split `model_cfg`'s layers over pp ranks x `virtual` chunks by the `balance` metric.

    measured: (per-layer seconds, embedding seconds, head seconds), required for balance=profile.
    memory_gb: per-stage limit in GiB (one value for all stages, or one per stage).
    setup: the layout, precision and checkpointing the memory model assumes (default: tp = dp =
    1, no ZeRO, fp32, no checkpointing); its micro-batch and micro-batch count are replaced by
    `micro_batch` and the schedule's; `bytes_per_param` replaces the engine's state bytes.
    """
    assert balance in PP_BALANCE_MODES and virtual >= 1, (balance, virtual)  # validated by ParallelConfig
    costs = model_costs(model_cfg)
    n_layers = len(costs.layers)
    n_chunks = pp * virtual
    m = microbatches or pp
    # pp = 1 runs no schedule: its micro-batches are gradient accumulation, one alive at a time
    in_flight = [1] if pp == 1 else in_flight_microbatches(pp, m, schedule) if virtual == 1 else [1] * n_chunks
    setup = dataclasses.replace(setup or MemorySetup(), micro_batch=micro_batch, microbatches=m, pipelined=pp > 1,
                                bytes_per_param=bytes_per_param)
    limits = [math.inf] * n_chunks
    if memory_gb:
        assert virtual == 1, "preflight refuses memory limits with interleaved schedules"
        limits = list(memory_gb) if len(memory_gb) > 1 else [memory_gb[0]] * pp
        if len(limits) != pp:
            raise ValueError(f"{memory_key}: {len(limits)} limits given for parallel.pp={pp} stages")
        limits = [g * GIB for g in limits]
    mm = model_memory(model_cfg, setup)
    memory = to_memory_model(mm, in_flight, limits, memory_key, virtual)

    flops = [c.flops for c in costs.layers]
    if balance == "flops":
        metric, first, last = flops, costs.embedding.flops, costs.head.flops
    elif balance == "params":
        metric = [float(c.params) for c in costs.layers]
        first, last = float(costs.embedding.params), float(costs.head.params)
    elif balance == "uniform":
        metric, first, last = [1.0] * n_layers, 0.0, 0.0
    else:
        if measured is None:
            raise ValueError("parallel.pp_balance=profile needs measured per-layer times (see profile_layer_times)")
        metric, first, last = list(measured[0]), measured[1], measured[2]
        if len(metric) != n_layers:
            raise ValueError(f"profile has {len(metric)} layer times for model.n_layers={n_layers}")
    part = partition(metric, n_chunks, first, last, memory if memory_gb else None, key="parallel.pp")
    by_flops = evaluate(part.bounds, flops, costs.embedding.flops, costs.head.flops)
    uniform = partition([1.0] * n_layers, n_chunks)
    uniform_flops = evaluate(uniform.bounds, flops, costs.embedding.flops, costs.head.flops)

    static_pre, act_pre = prefix_sums(memory.static), prefix_sums(memory.act)
    table = memory.peak_table(act_pre)
    stages = []
    for c, layers in enumerate(part.stages):
        params = sum(costs.layers[i].params for i in layers)
        params += (costs.embedding.params if c == 0 else 0) + (costs.head.params if c == n_chunks - 1 else 0)
        static, act, fixed = memory.stage_parts(c, n_chunks, layers[0], layers[-1] + 1, static_pre, act_pre, table)
        kept = (act_pre[layers[-1] + 1] - act_pre[layers[0]] + (memory.first_act if c == 0 else 0.0)
                + (memory.last_act if c == n_chunks - 1 else 0.0))
        stages.append(StagePlan(layers, chunk_rank(c, pp, v_shape), by_flops.costs[c], params, static, act + fixed,
                                part.costs[c], static + act + fixed, kept, fixed,
                                mm.retained(layers[0], layers[-1] + 1, c == n_chunks - 1)))
    return PipelinePlan(pp, virtual, balance, stages, by_flops.bottleneck_over_ideal,
                        uniform_flops.bottleneck_over_ideal, uniform.stages, setup, v_shape, schedule)
