"""The layout planner: every layout of SEARCH_SPACE for a recipe on N devices, its predicted peak
memory per rank and step time, best first (docs/planning.md).

A layout is the recipe with the values of one row of the product of SEARCH_SPACE set; it is
legal when the trainer's own start checks accept it: each section's `validate` and
`preflight(cfg, N)` (config level, no process, no weights). So a switch another issue adds or a
refusal it lifts reaches the planner through those checks, and a new key joins the search with
one line in SEARCH_SPACE. The train keys vary innermost: a refusal whose error names no train
key (errors name the keys they depend on) is counted for the other train values unchecked. Per
legal layout: the memory model (cost/memory.py, with the trainer's own MemorySetup.from_config
and batch split) over the FLOPs-balanced partition (cost/partition.py), max over pipeline
ranks, and the step time of cost/step_time.py with the device's numbers (cost/devices.json). A
layout fits when its peak is at most `usable` x the device memory (the rest: what the memory
model leaves out, e.g. the CUDA context and allocator fragmentation).
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import os
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING, Any, Sequence

from megatron_taper.config import CP_ATTENTIONS, V_SCHEDULES
from megatron_taper.cost.block import moe_all_to_all_bytes, routed_experts
from megatron_taper.cost.cp import cp_messages
from megatron_taper.cost.devices import DeviceProfile
from megatron_taper.cost.float8 import block_float8_speedup, math_rate
from megatron_taper.cost.flops import model_costs
from megatron_taper.cost.memory import (
    GIB,
    MemorySetup,
    ModelMemory,
    StageMemory,
    checkpointed_blocks,
    model_memory,
)
from megatron_taper.cost.op_count import OpCounts, compiled_launches, count_ops
from megatron_taper.cost.partition import (
    chunk_rank,
    in_flight_microbatches,
    interleaved_activations,
    multi_chunk_activations,
    partition,
)
from megatron_taper.cost.preflight import compiles, preflight, step_split
from megatron_taper.cost.stage_memory import PeakRows, to_memory_model
from megatron_taper.cost.step_time import RankWork, StepLayout, StepTime, step_time
from megatron_taper.taper import layer_widths, moe_layers
from megatron_taper.validation import ConfigError

if TYPE_CHECKING:
    from megatron_taper.config import Config, TrainConfig

# The search space: config key -> the values tried. The product of the rows is enumerated and
# each row's values are set on the recipe; the trainer's checks decide what is legal.
SEARCH_SPACE: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("parallel.tp", (1, 2, 4, 8)),
    ("parallel.pp", (1, 2, 4, 8, 16, 32)),
    ("parallel.pp_schedule", ("1f1b", "gpipe", "interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev")),
    ("parallel.pp_virtual", (2,)),
    ("parallel.zero", ("none", "fsdp2", "deepspeed")),
    ("parallel.dp_replicate", (1, 2, 4, 8)),  # HSDP replicas (fsdp2); dp_shard = dp / dp_replicate
    ("parallel.sequence_parallel", (False, True)),
    ("parallel.cp", (1, 2, 4, 8)),  # context parallelism: each sequence split over cp ranks
    ("parallel.cp_attention", CP_ATTENTIONS),
    ("parallel.ep", (1, 2, 4, 8, 16, 32, 64)),  # expert parallelism (model.moe; preflight check_moe_layout)
    ("train.micro_batch", (1, 2, 4, 8)),
    ("train.activation_checkpointing", ("none", "selective", "op", "full")),
    ("train.float8", (False, True)),
)
USABLE_FRACTION = 0.9  # of the device memory a predicted peak may take
# parallel.cp > 1 is searched only where each rank keeps at least this many tokens of a sequence:
# shorter slices leave too little attention per layer to hide the K/V exchange behind (the anchors
# use context parallelism for long sequences; a choice, not measured here), and the search stays
# fast (70B at 4096 tokens: cp values that leave 2048 or fewer tokens would triple its time)
CP_MIN_TOKENS = 4096
# train.cuda_graphs: host launches per block and micro-batch, its forward and its backward graph
# replayed (the kernels inside them cost the host nothing; not yet measured on a GPU)
GRAPH_LAUNCHES_PER_BLOCK = 2


def _canonical(values: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """Settings that make no difference to the run take one value, so a layout is tried once:
    without pipelining the schedule, without an interleaved schedule pp_virtual, without tp
    sequence parallelism, without fsdp2 dp_replicate (no replicas), without context parallelism
    cp_attention, without experts (a dense model) ep. Only keys of other sections than train are
    made canonical (search varies the train keys innermost, each value of each)."""
    out = dict(values)
    if out.get("parallel.pp", cfg.parallel.pp) == 1:
        out["parallel.pp_schedule"] = "1f1b"
    if out.get("parallel.pp_schedule", cfg.parallel.pp_schedule) not in ("interleaved_1f1b", "interleaved_zero_bubble"):
        out["parallel.pp_virtual"] = cfg.parallel.pp_virtual
    if out.get("parallel.tp", cfg.parallel.tp) == 1:
        out["parallel.sequence_parallel"] = False
    if out.get("parallel.zero", cfg.parallel.zero) != "fsdp2":  # replicas exist only under fsdp2
        out["parallel.dp_replicate"] = 1
    if out.get("parallel.cp", cfg.parallel.cp) == 1:
        out["parallel.cp_attention"] = cfg.parallel.cp_attention
    if not cfg.model.moe.enabled:
        out["parallel.ep"] = cfg.parallel.ep
    return out


def with_values(cfg: Config, values: dict[str, Any], sections: dict | None = None) -> Config:
    """A copy of `cfg` with each `section.key` of `values` set (sections copied, the rest shared),
    the sections it changed validated; `sections` keeps validated copies by their new values
    across calls, for a search (they are shared then: read only)."""
    out = copy.copy(cfg)
    for section in dict.fromkeys(key.split(".")[0] for key in values):
        mine = tuple((k, v) for k, v in values.items() if k.split(".")[0] == section)
        if sections is None or (section, mine) not in sections:
            changed = copy.copy(getattr(cfg, section))
            for key, value in mine:
                setattr(changed, key.split(".", 1)[1], value)
            changed.validate(section)
            if sections is not None:
                sections[(section, mine)] = changed
        setattr(out, section, changed if sections is None else sections[(section, mine)])
    return out


def overrides(values: dict[str, Any]) -> list[str]:
    """`values` as the trainer's key=value overrides."""
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items()]


def layout_of(cfg: Config) -> str:
    """The values of every search-space key in `cfg`, as overrides (what layout=auto chose)."""
    return " ".join(overrides({key: _get(cfg, key) for key, _ in SEARCH_SPACE}))


def first_clause(error: Exception | str) -> str:
    """A refusal up to its advice."""
    return re.split(r"; |: use ", str(error))[0]


def reason(error: Exception | str) -> str:
    """A refusal's first clause with its numbers replaced, so refusals of one kind count together."""
    text = re.split(r" \(", first_clause(error))[0]
    return re.sub(r"(?<![\w.])\d+(\.\d+)?(?!\w)", "N", text)[:110]


@dataclass
class Prediction:
    values: dict[str, Any]  # the search space's keys and their values
    layout: StepLayout  # what the step-time model saw (tp, pp, dp, schedule, micro-batches, ...)
    rank_peaks: list[float]  # predicted peak bytes per pipeline rank
    step: StepTime
    tokens_per_s: float  # whole run
    mfu: float  # of the device's bf16 (fp32) peak
    fits: bool
    compiled: bool = False  # train.compile resolved for the device (cost/preflight.py compiles)
    # train.float8: the best rank's float8 / bf16 speed of its blocks' linears (cost/float8.py); inf without
    float8_speedup: float = math.inf
    experts: int = 0  # model.moe.experts (0: a dense model, whose layouts do not name ep)

    @property
    def peak(self) -> float:
        return max(self.rank_peaks)

    def describe(self) -> str:
        v, x = self.values, self.layout
        parts = [f"tp={x.tp}" + ("+sp" if v.get("parallel.sequence_parallel") else ""),
                 f"pp={x.pp}" + (f"x{x.virtual} {x.schedule}" if x.virtual > 1 else
                                 f" {x.schedule}" if x.pp > 1 else ""),
                 f"dp={x.dp}" + (f"({v['parallel.dp_replicate']}x{x.dp // v['parallel.dp_replicate']})"
                                 if v.get("parallel.dp_replicate", 1) > 1 else ""),
                 *([f"cp={x.cp}" + ("" if x.cp_attention == "allgather" else f" {x.cp_attention}")]
                   if x.cp > 1 else []),
                 *([f"ep={x.ep}"] if self.experts else []),
                 f"zero={x.zero}", f"micro_batch={x.micro_batch} x {x.microbatches} "
                 + ("pipeline micro-batches" if x.pp > 1 else "accumulation"),
                 f"checkpointing={v.get('train.activation_checkpointing')}"]
        if v.get("train.float8"):
            parts.append("float8")
        if self.compiled:
            parts.append("compiled")
        return " ".join(parts)


@dataclass
class PlanResult:
    gpus: int
    device: DeviceProfile
    memory_limit: float  # bytes a rank's predicted peak may take
    candidates: int  # distinct layouts tried
    legal: int  # accepted by the trainer's checks
    layouts: list[Prediction]  # legal and fitting, fastest first
    nearest: Prediction | None  # the legal layout with the smallest peak
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> layouts
    # reason -> (the first refusal of that kind with its real values, distinct refusals of that kind)
    examples: dict[str, tuple[str, int]] = field(default_factory=dict)


class Predictor:
    """Peak memory and step time of layouts of one model on one device; partitions and memory
    models are computed once per distinct input."""

    def __init__(self, cfg: Config, device: DeviceProfile):
        self.model = cfg.model
        self.device = device
        self.costs = model_costs(cfg.model)
        self._memory: dict[MemorySetup, ModelMemory] = {}
        self._activations: dict[tuple, list] = {}  # model_memory's cache of the blocks' activation bytes
        self._bounds: dict[int, tuple[int, ...]] = {}
        self._peaks: dict[tuple, list[float]] = {}
        self._models: dict[tuple, tuple] = {}
        self._tables: dict[MemorySetup, PeakRows] = {}
        self._work: dict[tuple, list[RankWork]] = {}
        self._chunks: dict[tuple, list[list[int]]] = {}
        self._cp: dict[tuple, list[tuple]] = {}
        self._moments: dict[tuple, set] = {}  # partition.split_backward_moments per ZB-V rank
        self._ops: dict[tuple, list[float]] = {}
        self._op_counts: dict[int, OpCounts] = {}  # by cp

    def bounds(self, n_chunks: int) -> tuple[int, ...]:
        if n_chunks not in self._bounds:
            c = self.costs
            self._bounds[n_chunks] = partition([x.flops for x in c.layers], n_chunks, c.embedding.flops,
                                               c.head.flops).bounds
        return self._bounds[n_chunks]

    def memory(self, setup: MemorySetup) -> ModelMemory:
        """model_memory; its pieces do not depend on the micro-batch count (only the pipeline
        buffers, which read it from `setup`), so they are computed once for all counts, and the
        blocks' activation bytes once per memory.ACTIVATION_FIELDS values."""
        if setup not in self._memory:
            key = dataclasses.replace(setup, microbatches=1)
            if key not in self._memory:
                self._memory[key] = model_memory(self.model, key, self.costs, self._activations)
            self._memory[setup] = dataclasses.replace(self._memory[key], setup=setup)
        return self._memory[setup]

    def rank_peaks(self, setup: MemorySetup, pp: int, virtual: int, schedule: str) -> list[float]:
        """Predicted peak bytes of each pipeline rank: the memory model per stage at v = 1; with
        several chunks per rank, its chunks' static bytes and buffers and
        partition.multi_chunk_activations of its chunks (the rule of PipelinePlan.rank_peak_bytes:
        interleaved 1F1B, ZB-V by its action list); for interleaved_zero_bubble and dualpipev,
        not modelled there, interleaved_activations with Megatron's warm-up count
        (pp - r - 1) x 2 + (v - 1) x pp + 1 (at most m x v) in flight (an estimate: their deferred
        weight gradients are not modelled, docs/planning.md)."""
        key = (setup, pp, virtual, schedule)
        if key in self._peaks:
            return self._peaks[key]
        n_chunks = pp * virtual
        b = self.bounds(n_chunks)
        m = setup.microbatches
        if virtual == 1:
            flight = [1] if pp == 1 else in_flight_microbatches(pp, m, schedule)
            peaks = [x.total for x in self.stages(setup, b, flight)]
        else:
            chunks = self.stages(setup, b, [1] * n_chunks, virtual)
            peaks = []
            for r, ids in enumerate(self.rank_chunks(pp, virtual, schedule)):
                mine = [chunks[c] for c in ids]
                kept, tops = [s.kept for s in mine], [s.activations for s in mine]
                act = multi_chunk_activations(schedule, pp, m, r, ids, n_chunks, kept, tops,
                                              [s.retained for s in mine], self._moments)
                if act is None:  # interleaved_zero_bubble, dualpipev: Megatron's warm-up count (estimate)
                    flight = min(m * virtual, (pp - r - 1) * 2 + (virtual - 1) * pp + 1)
                    act = interleaved_activations(kept, tops, flight, ids.index(n_chunks - 1)
                                                  if n_chunks - 1 in ids else None)
                peaks.append(sum(s.static + s.buffers for s in mine) + act)
        self._peaks[key] = peaks
        return peaks

    def stages(self, setup: MemorySetup, bounds: Sequence[int], in_flight: list[int], virtual: int = 1
               ) -> list[StageMemory]:
        """ModelMemory.stage of every chunk of the split `bounds` (`virtual` chunks per rank), with
        the memory model's per-setup tables computed once."""
        mm = self.memory(setup)
        key = (setup, tuple(in_flight), virtual)
        if key not in self._models:
            model = to_memory_model(mm, in_flight, [math.inf] * len(in_flight), virtual=virtual)
            static_pre, kept_pre = [0.0, *accumulate(model.static)], [0.0, *accumulate(model.act)]
            if setup not in self._tables:
                self._tables[setup] = PeakRows(model.peak, kept_pre)
            self._models[key] = (model, static_pre, kept_pre)
        model, static_pre, kept_pre = self._models[key]
        table, n, out = self._tables[setup], len(in_flight), []
        for index in range(n):
            lo, hi = bounds[index], bounds[index + 1]
            static, act, fixed = model.stage_parts(index, n, lo, hi, static_pre, kept_pre, table)
            kept = kept_pre[hi] - kept_pre[lo] + (mm.head.kept if index == n - 1 else 0.0)
            out.append(StageMemory(static=static, activations=act, buffers=fixed, kept=kept,
                                   in_flight=in_flight[index], retained=mm.retained(lo, hi, index == n - 1)))
        return out

    def rank_work(self, mm: ModelMemory, pp: int, virtual: int, schedule: str, mode: str, every: int,
                  ops: tuple[int, bool, bool] | None = None) -> list[RankWork]:
        """Per pipeline rank, its work (_rank_work); with `ops` = (cp, graphs, compiled) also its host
        calls per micro-batch (rank_ops) and, under activation_checkpointing=op, its op-checkpointed
        forward operators. Once per distinct input."""
        key = (mm.setup.tp, mm.setup.ep, pp, virtual, schedule, mode, every, ops)
        if key not in self._work and ops is None:
            self._work[key] = self._rank_work(mm, pp, virtual, schedule, mode, every)
        elif key not in self._work:
            work, (cp, graphs, compiled) = self.rank_work(mm, pp, virtual, schedule, mode, every), ops
            calls = self.rank_ops(pp, virtual, schedule, [w.recomputed_blocks for w in work], cp, graphs, compiled)
            # the selective-checkpoint policy runs per operator in eager only: compile applies it while tracing
            forward = self.op_counts(cp).block_forward if mode == "op" and not compiled else 0.0
            self._work[key] = [dataclasses.replace(w, ops=n, op_checkpointed_ops=forward * w.blocks)
                               for w, n in zip(work, calls)]
        return self._work[key]

    def float8_speedups(self, t: TrainConfig, pp: int, virtual: int, schedule: str) -> list[float]:
        """Per pipeline rank, float8 / bf16 speed of its blocks' linear matmuls under `t`'s float8
        rule and recipe (cost/float8.py), FLOPs-weighted over its blocks; ConfigError for a recipe
        without measured ratios (mxfp8)."""
        c = self.costs
        try:
            per_layer = [block_float8_speedup(self.model, w, t.float8_min_dim, t.float8_recipe) for w in c.widths]
        except ValueError as e:
            raise ConfigError(f"train.float8_recipe={t.float8_recipe}: {e}, so the planner does not predict it; "
                              f"plan tensorwise or rowwise") from None
        out = []
        for layers in self.rank_layers(pp, virtual, schedule):
            linear = [min(2.0 * c.layers[i].params, c.layers[i].flops) for i in layers]
            out.append(sum(linear) / sum(f / per_layer[i] for f, i in zip(linear, layers)))
        return out

    def rank_chunks(self, pp: int, virtual: int, schedule: str) -> list[list[int]]:
        """The chunks (virtual stages) of each pipeline rank, in schedule order."""
        key = (pp, virtual, schedule in V_SCHEDULES)
        if key not in self._chunks:
            self._chunks[key] = [[c for c in range(pp * virtual) if chunk_rank(c, pp, key[2]) == r] for r in range(pp)]
        return self._chunks[key]

    def rank_layers(self, pp: int, virtual: int, schedule: str) -> list[list[int]]:
        """The layers of each pipeline rank over the balanced split (every chunk it holds)."""
        b = self.bounds(pp * virtual)
        return [[i for c in mine for i in range(b[c], b[c + 1])] for mine in self.rank_chunks(pp, virtual, schedule)]

    def rank_cp_messages(self, pp: int, virtual: int, schedule: str, micro_batch: int, cp: int, bf16: bool,
                         attention: str, tp: int, documents: bool = False) -> list[tuple]:
        """Per pipeline rank, its blocks' context-parallel messages as (kind, bytes) per block and
        micro-batch (cost/cp.py; attention's K and V, and Ulysses' q, k, v and output, split over tp
        with the heads, the families' states counted whole)."""
        key = (pp, virtual, schedule, micro_batch, cp, bf16, attention, tp, documents)
        if key not in self._cp:
            blocks = cp_messages(self.model, micro_batch, self.model.seq_len, cp, 2 if bf16 else 4, attention,
                                 documents)
            per_block = [tuple((m.kind, m.bytes / (tp if m.what in ("kv", "qkvo") else 1)) for m in msgs)
                         for msgs in blocks]
            self._cp[key] = [tuple(per_block[i] for i in layers) for layers in self.rank_layers(pp, virtual, schedule)]
        return self._cp[key]

    def op_counts(self, cp: int) -> OpCounts:
        """cost/op_count.py's counts at a cp rank's seq_len / cp tokens, counted once per cp; the
        write loop as its Triton kernels where this process selects them (MEGATRON_TAPER_KERNELS=triton)
        on a device that runs them."""
        if cp not in self._op_counts:
            from megatron_taper.models.kernels.state_passing import KERNELS_ENV

            kernels = os.environ.get(KERNELS_ENV) == "triton" and self.device.profile != "cpu"
            self._op_counts[cp] = count_ops(self.model, self.model.seq_len // cp, write_kernel=kernels)
        return self._op_counts[cp]

    def rank_ops(self, pp: int, virtual: int, schedule: str, recomputed: Sequence[int], cp: int,
                 graphs: bool = False, compiled: bool = False) -> list[float]:
        """Per pipeline rank, the host calls of one micro-batch (op_counts): its blocks' operators,
        their recomputed forwards' and the ends' on the last; `compiled` (train.compile) the blocks'
        as the kernels their compiled graphs launch (op_count.compiled_launches); with `graphs`
        (train.cuda_graphs) a block is GRAPH_LAUNCHES_PER_BLOCK launches whatever it runs inside."""
        key = (pp, virtual, schedule, tuple(recomputed), cp, graphs, compiled)
        if key not in self._ops:
            ops = self.op_counts(cp)
            forward, block = compiled_launches(self.model) if compiled else (1.0, 1.0)
            last = len(self.costs.layers) - 1
            self._ops[key] = [(len(layers) * GRAPH_LAUNCHES_PER_BLOCK if graphs else
                               len(layers) * ops.block * block + n_redo * ops.block_forward * forward)
                              + ops.ends * (last in layers)
                              for layers, n_redo in zip(self.rank_layers(pp, virtual, schedule), recomputed)]
        return self._ops[key]

    def op_recompute_bytes(self, setup: MemorySetup, pp: int, virtual: int, schedule: str) -> list[float]:
        """Per pipeline rank, the activation bytes per micro-batch activation_checkpointing=op drops
        and its backward makes again: what its blocks keep without checkpointing less what they keep
        under op (the matmuls' and attention's outputs)."""
        op = self.memory(setup)
        none = self.memory(dataclasses.replace(setup, activation_checkpointing="none"))
        return [sum(none.layers[i].kept - op.layers[i].kept for i in layers)
                for layers in self.rank_layers(pp, virtual, schedule)]

    def _rank_work(self, mm: ModelMemory, pp: int, virtual: int, schedule: str, mode: str, every: int
                   ) -> list[RankWork]:
        c = self.costs
        recomputed = {int(x) for x in checkpointed_blocks([str(i) for i in range(len(c.layers))], mode, every)}
        moe = moe_layers(self.model)
        # per layer: its routed experts' (all N's parameters, the k's active FLOPs); (0, 0) in a dense layer
        experts = [routed_experts(self.model, w) if is_moe else (0, 0.0) for w, is_moe in zip(c.widths, moe)]
        out = []
        for layers in self.rank_layers(pp, virtual, schedule):
            first, last = 0 in layers, len(c.layers) - 1 in layers
            flops = sum(c.layers[i].flops for i in layers) + c.embedding.flops * first + c.head.flops * last
            # the linears' FLOPs: 2 per active weight (the routed experts' k of N), at most the layer's
            linear = sum(min(2.0 * (c.layers[i].params - experts[i][0]), c.layers[i].flops - experts[i][1])
                         + experts[i][1] for i in layers)
            redo = [i for i in layers if i in recomputed and mode != "op"]
            params = sum(mm.layers[i].params for i in layers) + mm.embedding.params * first + mm.head.params * last
            attention = sum(c.layers[i].flops for i in layers) - linear  # outside the linears: attention (memories)
            out.append(RankWork(flops, linear, sum(c.layers[i].flops for i in redo), len(layers), len(redo), params,
                                vocab_collectives=1 * first + 3 * last, attention_flops=attention,
                                expert_flops=sum(experts[i][1] for i in layers),
                                expert_params=sum(experts[i][0] for i in layers) / mm.setup.ep,
                                moe_blocks=sum(moe[i] for i in layers), moe_recomputed=sum(moe[i] for i in redo)))
        return out

    def predict(self, cfg: Config, dp: int, memory_limit: float) -> Prediction:
        """The prediction for `cfg` (legal: preflight accepted it) at data-parallel size `dp`."""
        p, t = cfg.parallel, cfg.train
        bf16 = t.uses_bf16(self.device.bf16_tflops > 0)
        compiled = compiles(cfg.model, p, t, "cpu" if self.device.profile == "cpu" else "cuda")
        _check_peak(self.device, bf16, t.float8)
        micro_batch, m = step_split(p, t, dp)
        setup = MemorySetup.from_config(p, t, dp, bf16, micro_batch=micro_batch, microbatches=m,
                                        documents=cfg.data.document_mask, flex=self.device.profile != "cpu")
        virtual = p.virtual_stages if p.pp > 1 else 1
        peaks = self.rank_peaks(setup, p.pp, virtual, p.pp_schedule)
        op_level = t.activation_checkpointing == "op"
        ops = (setup.cp, t.cuda_graphs and compiled, compiled) if self.device.op_overhead_us > 0 or op_level else None
        work = self.rank_work(self.memory(setup), p.pp, virtual, p.pp_schedule, t.activation_checkpointing, t.ac_every,
                              ops)
        if setup.cp > 1:
            messages = self.rank_cp_messages(p.pp, virtual, p.pp_schedule, micro_batch, setup.cp, bf16,
                                             setup.cp_attention, p.tp, setup.documents)
            work = [dataclasses.replace(w, cp_messages=msgs) for w, msgs in zip(work, messages)]
        if op_level:
            work = [dataclasses.replace(w, op_recompute_bytes=b)
                    for w, b in zip(work, self.op_recompute_bytes(setup, p.pp, virtual, p.pp_schedule))]
        if p.ep > 1:
            per_token = moe_all_to_all_bytes(self.model, 1, p.ep, 2 if bf16 else 4)
            work = [dataclasses.replace(w, all_to_all_bytes=per_token) for w in work]
        if t.float8:
            speedups = self.float8_speedups(t, p.pp, virtual, p.pp_schedule)
            work = [dataclasses.replace(w, float8_speedup=x) for w, x in zip(work, speedups)]
        gpu = self.device.profile != "cpu"  # the cpu profile's mfu was fitted on eager CPU steps
        layout = StepLayout(tp=p.tp, pp=p.pp, dp=dp, virtual=virtual, schedule=p.pp_schedule, zero=p.zero,
                            sequence_parallel=setup.sequence_parallel, micro_batch=micro_batch, microbatches=m,
                            bf16=bf16, float8=t.float8, overlap=gpu, math_rate=math_rate(compiled) if gpu else 1.0,
                            dp_shard=setup.dp_shard, compute_share=self.device.rank_share(p.tp * p.pp * p.cp * dp),
                            host_cores=self.device.cores,
                            cp=setup.cp, cp_attention=setup.cp_attention, ep=p.ep, ep_imbalance=p.ep_imbalance)
        step = step_time(work, layout, self.model.d_model, self.model.seq_len, self.device)
        tokens = t.global_batch * self.model.seq_len / step.total
        gpus = p.tp * p.pp * p.cp * dp
        peak = self.device.bf16_tflops if bf16 else self.device.fp32_tflops
        mfu = 3.0 * self.costs.total_flops * tokens / (gpus * peak * 1e12)
        values = {key: _get(cfg, key) for key, _ in SEARCH_SPACE}
        return Prediction(values, layout, peaks, step, tokens, mfu, max(peaks) <= memory_limit, compiled,
                          max(w.float8_speedup for w in work) if t.float8 else math.inf, self.model.moe.experts)


def _check_peak(device: DeviceProfile, bf16: bool, float8: bool) -> None:
    """ConfigError unless the device profile has a peak for the step's matmul dtype (step_time
    divides by it): e.g. train.precision=bf16 on the cpu profile, whose bf16_tflops is 0."""
    key, field = (("train.float8=true", "fp8_tflops") if float8 else ("train.precision=bf16", "bf16_tflops")
                  if bf16 else ("train.precision=fp32", "fp32_tflops"))
    if getattr(device, field) <= 0:
        raise ConfigError(f"{key}: the {device.profile} device profile ({device.name} in cost/devices.json) has "
                          f"{field} {getattr(device, field):g}, so no step time can be predicted for it; plan "
                          f"another train.precision / train.float8 or a profile with that peak")


def _get(cfg: Config, key: str) -> Any:
    target = cfg
    for part in key.split("."):
        target = getattr(target, part)
    return target


def search(cfg: Config, gpus: int, memory_gib: float, device: DeviceProfile,
           space: Sequence[tuple[str, tuple[Any, ...]]] = SEARCH_SPACE, usable: float = USABLE_FRACTION,
           cp_min_tokens: int = CP_MIN_TOKENS) -> PlanResult:
    """Every layout of `space` for `cfg` on `gpus` devices of `memory_gib` GiB each (module doc),
    leaving out cp values that give a rank fewer than `cp_min_tokens` tokens of a sequence. At
    pp > 1 with parallel.microbatches set, the pipeline micro-batch is global_batch / dp /
    parallel.microbatches whatever train.micro_batch is: a layout's train.micro_batch is that
    size, and the train.micro_batch values that give the same layout again count as dropped."""
    limit = usable * memory_gib * GIB
    predictor = Predictor(cfg, device)
    # the train keys vary innermost: a refusal of the other sections' values holds at all of them
    outer_keys = [k for k, _ in space if not k.startswith("train.")]
    inner_keys = [k for k, _ in space if k.startswith("train.")]
    inner_rows = list(itertools.product(*(v for k, v in space if k.startswith("train."))))
    seen: set[tuple] = set()
    sections: dict = {}
    dropped: Counter[str] = Counter()
    examples: dict[str, tuple[str, set[str]]] = {}
    predicted: set[tuple] = set()

    clauses: dict[str, tuple[str, str]] = {}  # a refusal -> its reason and first clause (layouts share refusals)

    def drop(message: str, layouts: int = 1) -> str:
        if message not in clauses:
            clauses[message] = reason(message), first_clause(message)
        kind, clause = clauses[message]
        dropped[kind] += layouts
        examples.setdefault(kind, (clause, set()))[1].add(clause)
        return kind

    legal: list[Prediction] = []
    widths: dict[int, list[int]] = {}  # id of a model section (kept alive by cfg / `sections`) -> its widths
    for row in itertools.product(*(v for k, v in space if not k.startswith("train."))):
        outer = _canonical(dict(zip(outer_keys, row)), cfg)
        marker = tuple(outer.items())
        if marker in seen:
            continue
        seen.add(marker)
        cp = outer.get("parallel.cp", cfg.parallel.cp)
        if cp > 1 and cfg.model.seq_len // cp < cp_min_tokens:
            drop(f"parallel.cp={cp} leaves {cfg.model.seq_len // cp} tokens of model.seq_len={cfg.model.seq_len} per "
                 f"rank, fewer than {cp_min_tokens} (not searched)", len(inner_rows))
            continue
        refused = ""  # a refusal naming no train. key (an error names its keys): it holds at every train value
        for inner in inner_rows:
            values = {**outer, **dict(zip(inner_keys, inner))}
            if values.get("train.float8") and device.fp8_tflops <= 0:
                drop(f"train.float8: the {device.profile} profile has no float8 peak")
                continue
            if refused:
                drop(refused)
                continue
            try:
                candidate = with_values(cfg, values, sections)
                if id(candidate.model) not in widths:
                    widths[id(candidate.model)] = layer_widths(candidate.model)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    dp = preflight(candidate, gpus, widths[id(candidate.model)]).dp
                x = predictor.predict(candidate, dp, limit)
            except ConfigError as e:
                drop(str(e))
                refused = "" if "train." in str(e) else str(e)
                continue
            if x.float8_speedup <= 1.0:
                drop(f"train.float8=true: no block linear gains (float8 / bf16 at most {x.float8_speedup:.2f} under "
                     f"train.float8_min_dim={candidate.train.float8_min_dim}, cost/speedups.json)")
                continue
            tried = x.values["train.micro_batch"]
            x.values["train.micro_batch"] = x.layout.micro_batch
            if tuple(x.values.items()) in predicted:
                drop(f"train.micro_batch={tried} at parallel.pp={x.layout.pp}: parallel.microbatches="
                     f"{x.layout.microbatches} splits the step into micro-batches of {x.layout.micro_batch} "
                     f"whatever train.micro_batch is (one layout with train.micro_batch={x.layout.micro_batch})")
                continue
            predicted.add(tuple(x.values.items()))
            legal.append(x)
    over = [x for x in legal if not x.fits]
    if over:
        kind = f"predicted peak over {usable:.0%} of {memory_gib:g} GiB"
        dropped[kind] = len(over)
        examples[kind] = (kind, {kind})
    fitting = sorted((x for x in legal if x.fits), key=lambda x: (x.step.total, x.peak))
    nearest = min(legal, key=lambda x: (x.peak, x.step.total)) if legal else None
    order = sorted(dropped.items(), key=lambda kv: -kv[1])
    return PlanResult(gpus, device, limit, len(seen) * len(inner_rows), len(legal), fitting, nearest, dict(order),
                      {kind: (examples[kind][0], len(examples[kind][1])) for kind, _ in order})


def micro_batch_advice(result: PlanResult) -> tuple[int, Prediction] | None:
    """The largest train.micro_batch that fits at the fastest layout's other settings, and its
    prediction (None when nothing fits): more sequences per forward where memory allows, fewer
    accumulation steps; the fastest layout may take a smaller one."""
    if not result.layouts:
        return None
    best = result.layouts[0]
    others = {k: v for k, v in best.values.items() if k != "train.micro_batch"}
    same = [x for x in result.layouts if {k: v for k, v in x.values.items() if k != "train.micro_batch"} == others]
    largest = max(same, key=lambda x: x.values["train.micro_batch"])
    return largest.values["train.micro_batch"], largest


def no_fit_message(result: PlanResult, memory_gib: float) -> str:
    """One error for a search where nothing fits, naming the nearest layout."""
    where = f"{result.gpus} x {memory_gib:g} GiB ({result.device.profile})"
    if result.nearest is None:
        reasons = "; ".join(f"{n} x {r}" for r, n in list(result.dropped.items())[:3])
        return f"no layout of the search space is legal on {where}: {reasons}"
    near = result.nearest
    need = near.peak / (result.memory_limit / (memory_gib * GIB)) / GIB
    return (f"no legal layout fits {where}: the nearest, {near.describe()} ({' '.join(overrides(near.values))}), "
            f"needs a predicted {near.peak / GIB:.3g} GiB per rank, i.e. devices of {need:.3g} GiB; use more or "
            f"larger devices, or a smaller model")
