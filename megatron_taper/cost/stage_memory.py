"""Per-stage memory of a pipeline split, from the per-piece numbers of cost/memory.py: the pipeline's
communication buffers, DeepSpeed's buckets and `MemoryModel`, the static / activation prefix
tables the partition (cost/partition.py) and the planner (cost/plan.py) look stages up in."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING, Sequence

from megatron_taper.cost.block import prefix_sums

if TYPE_CHECKING:
    from megatron_taper.cost.memory import ModelMemory


def pipeline_buffers(io: float, in_flight: Sequence[int], microbatches: int) -> list[float]:
    """Per stage: p2p receive buffers beyond the in-flight inputs, gradient receive buffers and
    the in-flight outputs (module doc)."""
    n = len(in_flight)
    if n == 1:
        return [0.0]
    out = []
    for s, k in enumerate(in_flight):
        receive = (microbatches - k) * io if s > 0 else 0.0
        send = (microbatches + k) * io if s < n - 1 else 0.0
        out.append(receive + send)
    return out


def deepspeed_buffers(mm: ModelMemory) -> float:
    """DeepSpeed ZeRO-3's working buffers on one rank (no pipelining: the whole model): its fp32
    gradient reduce bucket (allocated whole; contiguous_gradients) and the parameters it holds
    gathered at once, in fp32 (docs/precision.md): the piece running and up to prefetch_bucket
    elements ahead of it, at most the whole model."""
    setup = mm.setup
    if setup.zero != "deepspeed":
        return 0.0
    pieces = [p.params for p in [*mm.layers, mm.embedding, mm.head]]
    gathered = min(setup.prefetch_bucket + max(pieces), sum(pieces))
    return 4.0 * (setup.reduce_bucket + gathered)


def to_memory_model(mm: ModelMemory, in_flight: Sequence[int], limits: Sequence[float],
                    key: str = "parallel.pp_memory_gb", virtual: int = 1) -> "MemoryModel":
    """The partitioner's view of `mm` for len(in_flight) stages (`virtual` chunks per rank) with
    byte limits `limits`."""
    engine = deepspeed_buffers(mm)
    return MemoryModel(
        static=[p.static for p in mm.layers], act=[p.kept for p in mm.layers], in_flight=list(in_flight),
        limits=list(limits), first_static=mm.embedding.static, first_act=mm.embedding.kept,
        last_static=mm.head.static, last_act=mm.head.kept, key=key, peak=[p.peak for p in mm.layers],
        last_peak=mm.head.peak - mm.head.kept,
        fixed=[b + engine for b in pipeline_buffers(mm.io, in_flight, mm.setup.microbatches)],
        grad_prefix=prefix_sums([p.grads for p in mm.layers]), first_grads=mm.embedding.grads,
        last_grads=mm.head.grads, microbatches=mm.setup.microbatches,
        reduce_copy=mm.setup.fsdp and mm.setup.pipelined and virtual == 1)


@dataclass(frozen=True)
class MemoryModel:
    """Bytes per layer and per stage extra, for the partitioner; `in_flight` and `limits` have
    one entry per stage. Without `peak` a stage needs static + act * in_flight (+ fixed); with
    it, the formula of the module doc."""

    static: Sequence[float]  # per layer: bytes for the whole step (params + grads + optimizer ...)
    act: Sequence[float]  # per layer: bytes one micro-batch keeps for backward
    in_flight: Sequence[int]
    limits: Sequence[float]
    first_static: float = 0.0
    first_act: float = 0.0
    last_static: float = 0.0
    last_act: float = 0.0
    key: str = "parallel.pp_memory_gb"  # the config key the limits came from, for errors
    # per layer: bytes while its backward runs (its activations and gradient buffers), on top of
    # the kept bytes of the stage's earlier layers; empty = not modelled
    peak: Sequence[float] = ()
    last_peak: float = 0.0  # bytes besides everything the stage keeps while the head's backward runs
    fixed: Sequence[float] = field(default_factory=list)  # per stage, whatever its layers (buffers)
    # prefix sums over the layers of the gradients in `static` that the step's first backward makes
    # (PieceMemory.grads), the embedding's and head's; empty = resident through the step
    grad_prefix: Sequence[float] = ()
    first_grads: float = 0.0
    last_grads: float = 0.0
    microbatches: int = 0  # micro-batches of a stage per step (0: not known, the in-flight count)
    reduce_copy: bool = False  # fsdp2, one chunk per rank: at the step's end a copy of its gradients (measured)

    def peak_table(self, act_prefix: Sequence[float]) -> list[list[float]]:
        """table[lo][hi - lo - 1] = max over l in [lo, hi) of act_prefix[l] + peak[l]."""
        table = []
        for lo in range(len(self.peak)):
            row, best = [], -math.inf
            for layer in range(lo, len(self.peak)):
                best = max(best, act_prefix[layer] + self.peak[layer])
                row.append(best)
            table.append(row)
        return table

    def stage_parts(self, stage: int, n_stages: int, lo: int, hi: int, static_prefix: Sequence[float],
                    act_prefix: Sequence[float], table: list[list[float]] | None = None
                    ) -> tuple[float, float, float]:
        """(static, activations, fixed) bytes of stage `stage` holding layers lo..hi-1."""
        static = static_prefix[hi] - static_prefix[lo]
        act = act_prefix[hi] - act_prefix[lo]
        first, last = stage == 0, stage == n_stages - 1
        if first:
            static, act = static + self.first_static, act + self.first_act
        if last:
            static, act = static + self.last_static, act + self.last_act
        fixed = self.fixed[stage] if self.fixed else 0.0
        n = self.in_flight[stage]
        if not self.peak:
            return static, act * n, fixed
        table = table or self.peak_table(act_prefix)
        blocks = table[lo][hi - lo - 1] - act_prefix[lo] + (self.first_act if first else 0.0)
        top = max(blocks, act + self.last_peak if last else act)
        if not self.grad_prefix:
            return static, act * (n - 1) + top, fixed
        # module doc: the first backward without the gradients, the next with them, the step's end
        grads = (self.grad_prefix[hi] - self.grad_prefix[lo] + (self.first_grads if first else 0.0)
                 + (self.last_grads if last else 0.0))
        first_backward = act * (n - 1) + top - grads
        m = self.microbatches or n
        later = act * (n - 1 if m > n else n - 2) + top if m > 1 else first_backward
        return static, max(first_backward, later, grads if self.reduce_copy else 0.0), fixed

    def stage_bytes(self, stage: int, n_stages: int, lo: int, hi: int, static_prefix: Sequence[float],
                    act_prefix: Sequence[float], table: list[list[float]] | None = None) -> float:
        return sum(self.stage_parts(stage, n_stages, lo, hi, static_prefix, act_prefix, table))


class PeakRows(dict):
    """MemoryModel.peak_table's rows, each made when first read: row lo is, for hi > lo, the max
    over l in [lo, hi) of kept_prefix[l] + peak[l] (a search reads a few rows of each table)."""

    def __init__(self, peak: Sequence[float], kept_prefix: Sequence[float]):
        super().__init__()
        self.moments = [kept_prefix[i] + peak[i] for i in range(len(peak))]

    def __bool__(self) -> bool:  # stage_parts takes a falsy table for none
        return True

    def __missing__(self, lo: int) -> list[float]:
        row = list(accumulate(self.moments[lo:], max))
        self[lo] = row
        return row
