"""preflight(cfg, world_size): every rule that spans config sections or needs the world size (the
rules that need the data on disk are data/checks.py's).

Runs before any process group exists (train.main, the tools, launch/train.sbatch's check), so a
layout the run cannot execute fails at once with one ConfigError naming the keys, on every rank
alike, instead of deep inside a collective. Rules about one section alone live in that section's
`validate(prefix)` (config.py, or the family's options in models/<family>.py); rules only one
model family has live in its FamilySpec.check_layout, which is called from here.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from megatron_taper.config import INTERLEAVED_SCHEDULES
from megatron_taper.cost.float8 import FLOAT8_UNIT
from megatron_taper.models import cards, family
from megatron_taper.taper import layer_widths, moe_layers
from megatron_taper.validation import ConfigError

if TYPE_CHECKING:
    from megatron_taper.config import Config, ModelConfig, ParallelConfig, TrainConfig


@dataclass(frozen=True)
class Layout:
    """What preflight derived: the (pp, dp, cp, tp) degrees and the per-rank batch split."""

    pp: int
    dp: int
    tp: int
    accumulation: int  # micro-batches of train.micro_batch per dp rank and step
    pipeline_microbatches: int  # micro-batches the pipeline schedule runs per step (pp > 1), else 0
    cp: int = 1


def preflight(cfg: Config, world_size: int, widths: Sequence[int] | None = None) -> Layout:
    """Check `cfg` (already section-validated) against itself and `world_size`; the Layout.
    `widths`: layer_widths(cfg.model) when the caller has them (a layout search checks one model
    at many layouts)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if world_size % (p.tp * p.pp * p.cp):
        cp = f" x parallel.cp={p.cp}" if p.cp > 1 else ""
        raise ConfigError(f"parallel.tp={p.tp} x parallel.pp={p.pp}{cp} = {p.tp * p.pp * p.cp} does not divide the "
                          f"world size {world_size}")
    dp = world_size // (p.tp * p.pp * p.cp)
    if widths is None:
        widths = layer_widths(m)  # a taper that leaves a layer below one alignment unit names model.taper
    if p.tp > 1:
        _check_tensor_parallel(m, p, widths)
    if t.device == "cuda" and (message := width_alignment_warning(m, widths, t.device)):
        warnings.warn(message, stacklevel=2)
    spec = family(m.arch)
    check_moe_layout(m, p, t, dp)
    if p.cp > 1:
        _check_context_parallel(m, p, t)
    if spec.check_layout is not None:
        spec.check_layout(m, p)
    if cfg.data.document_mask and not spec.document_mask:
        supported = ", ".join(name for name in cards() if family(name).document_mask)
        raise ConfigError(f"data.document_mask=true: model.arch={m.arch!r} does not keep tokens inside their "
                          f"documents yet (families that do: {supported}); use data.document_mask=false")
    keeps = "document_mask_ulysses" if p.cp_attention == "ulysses" else "document_mask_cp"  # models/spec.py
    if cfg.data.document_mask and p.cp > 1 and not getattr(spec, keeps):
        supported = ", ".join(name for name in cards() if getattr(family(name), keeps))
        if p.cp_attention == "ulysses":
            other = "parallel.cp_attention=allgather, " if spec.document_mask_cp else ""
        else:  # a chain of states that does not reset at document starts, where Ulysses has none
            other = "parallel.cp_attention=ulysses, " if spec.document_mask_ulysses else ""
        raise ConfigError(f"data.document_mask=true with parallel.cp={p.cp} and parallel.cp_attention="
                          f"{p.cp_attention}: not built yet for model.arch={m.arch!r} (families that keep "
                          f"documents under cp with {p.cp_attention}: {supported}); use {other}parallel.cp=1 "
                          f"or data.document_mask=false")
    if cfg.data.document_mask and spec.check_documents is not None:
        spec.check_documents(m, p)
    _check_zero(m, p, world_size, dp)
    _check_hsdp(p, dp)
    if t.float8:
        _check_float8(m, p, t)
    if t.cuda_graphs:
        _check_cuda_graphs(p)
    if t.seq_len_warmup_steps:
        _check_seq_len_warmup(cfg, widths)
    if cfg.run.init_from and p.zero == "deepspeed":
        raise ConfigError("run.init_from with parallel.zero=deepspeed is not supported (DeepSpeed partitions the "
                          "parameters itself); use parallel.zero=fsdp2 or none")
    accumulation = _check_batch(t, dp)
    n_micro = _check_pipeline(m, p, t, dp) if p.pp > 1 else 0
    return Layout(p.pp, dp, p.tp, accumulation, n_micro, p.cp)


TENSOR_CORE_UNIT = 128  # CUDA: matmul dimensions in multiples of this fill the tensor cores' tiles


def width_alignment_warning(m: ModelConfig, widths: Sequence[int], device_type: str) -> str | None:
    """The warning for MLP widths that are not multiples of TENSOR_CORE_UNIT on a CUDA device
    (train.device=cuda here; parallelize() for auto on CUDA), else None."""
    off = [w for w in widths if w % TENSOR_CORE_UNIT]
    if device_type != "cuda" or not off:
        return None
    return (f"{len(off)} of the {len(widths)} MLP widths are not multiples of {TENSOR_CORE_UNIT} (e.g. {off[0]}; "
            f"model.taper.multiple={m.taper.multiple}), which wastes tensor-core tiles on CUDA; set "
            f"model.taper.multiple={TENSOR_CORE_UNIT} (the budget stays exact when model.n_layers x model.mlp_width "
            f"is a multiple of it)")


def compiles(m: ModelConfig, p: ParallelConfig, t: TrainConfig, device_type: str) -> bool:
    """Whether the blocks are compiled (train.compile resolved): true, or auto on a CUDA device
    (TrainConfig.compiles) where the layout supports it: not under context parallelism for a family
    whose state passes from slice to slice (_check_context_parallel refuses that with true)."""
    if not t.compiles(device_type):
        return False
    return t.compile_setting == "true" or p.cp == 1 or family(m.arch).cp_balanced


def check_moe_layout(m: ModelConfig, p: ParallelConfig, t: TrainConfig, dp: int) -> None:
    """The one rule of which layouts run a mixture of experts (models/moe.py) and expert parallelism
    (parallel.ep, parallel/ep.py) at data-parallel size `dp`; a ConfigError naming the keys otherwise.
    Runs: one process; dp through DDP (zero=none) or fsdp2; pp; tp, also with sequence parallelism
    (the MoE replicated over tp, seeing the whole sequence); and ep dividing dp and the experts with
    any of these (zero=none or fsdp2; ep < dp copies the experts over dp / ep groups; not with
    HSDP). A dense model takes ep = 1."""
    if not m.moe.enabled:
        if p.ep > 1:
            raise ConfigError(f"parallel.ep={p.ep} spreads experts, but model.moe.experts=0 (a dense model); "
                              f"use parallel.ep=1")
        return
    if p.zero == "deepspeed":
        raise ConfigError("model.moe with parallel.zero=deepspeed is not supported yet (DeepSpeed partitions the "
                          "routing biases, which move outside its optimizer); use parallel.zero=fsdp2 or none")
    if p.cp > 1:
        raise ConfigError(f"model.moe with parallel.cp={p.cp} is not supported yet (untested); use parallel.cp=1")
    if t.float8:
        raise ConfigError("model.moe with train.float8=true is not supported (the experts' grouped GEMMs are no "
                          "nn.Linear); use train.float8=false")
    if p.ep > 1:
        if dp % p.ep:
            raise ConfigError(f"parallel.ep={p.ep} must divide the data-parallel size {dp} (experts split over ep "
                              f"ranks of the dp group and copied over dp / ep groups of them)")
        if m.moe.experts % p.ep:
            raise ConfigError(f"parallel.ep={p.ep} must divide model.moe.experts={m.moe.experts} (each rank holds "
                              f"the same number of experts)")
        if p.dp_split(dp) != (1, dp):
            raise ConfigError(f"parallel.ep={p.ep} with parallel.dp_replicate={p.dp_replicate} / parallel.dp_shard="
                              f"{p.dp_shard} (HSDP) is not supported yet; use parallel.dp_replicate=1 and "
                              f"parallel.dp_shard=0, or parallel.ep=1")


def _check_cuda_graphs(p: ParallelConfig) -> None:
    """train.cuda_graphs (parallel/block_options.py): layouts whose blocks see the same parameter
    memory and one micro-batch's forward and backward in turn."""
    if p.zero != "none":
        raise ConfigError(f"train.cuda_graphs=true with parallel.zero={p.zero} is not supported (ZeRO gathers each "
                          f"block's parameters into new memory every step, which a captured graph cannot read); "
                          f"use parallel.zero=none or train.cuda_graphs=false")
    if p.pp > 1:
        raise ConfigError(f"train.cuda_graphs=true with parallel.pp={p.pp} is not supported (a pipeline schedule runs "
                          f"later micro-batches' forwards before earlier backwards, each needing its own graph); "
                          f"use parallel.pp=1 or train.cuda_graphs=false")
    if p.cp > 1:
        raise ConfigError(f"train.cuda_graphs=true with parallel.cp={p.cp} is not supported yet (untested); use "
                          f"parallel.cp=1 or train.cuda_graphs=false")


def _check_seq_len_warmup(cfg: Config, widths: Sequence[int]) -> None:
    """train.seq_len_warmup_steps > 0 (TrainConfig.seq_len_at; ParallelModel.batch_inputs cuts each
    window into shorter ones): lengths start x a power of two up to model.seq_len, in layouts whose
    shapes may change from step to step and whose windows are independent; the model's own rules
    (the family's, sequence parallelism's) hold at the shortest length."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    start, full = t.seq_len_warmup_start, m.seq_len
    key = f"train.seq_len_warmup_start={start}"
    if start >= full or full % start or (full // start) & (full // start - 1):
        raise ConfigError(f"{key} must be model.seq_len={full} divided by a power of two (2, 4, 8, ...): the "
                          f"warmup doubles the window length up to model.seq_len")
    refusals = (
        (p.pp > 1, f"parallel.pp={p.pp} (a pipeline schedule's shapes are fixed when it is built); use "
                   f"parallel.pp=1"),
        (p.cp > 1, f"parallel.cp={p.cp} (the sequence split is built for model.seq_len); use parallel.cp=1"),
        (t.cuda_graphs, "train.cuda_graphs=true (a recorded graph per length and micro-batch shape); use "
                        "train.cuda_graphs=false"),
        (cfg.data.row_streams, "data.row_streams=true (each row's windows follow one another, which cutting "
                               "them breaks); use data.row_streams=false"),
    )
    carried = family(m.arch).carried_state
    if carried is not None and carried.enabled(m):
        refusals += ((True, f"model.arch={m.arch!r} carrying its state from window to window (the cut windows "
                            f"would carry it across their pieces); turn the family's carried state off"),)
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"train.seq_len_warmup_steps={t.seq_len_warmup_steps} is not supported with {why} "
                              f"or train.seq_len_warmup_steps=0")
    shortest = dataclasses.replace(m, seq_len=start)
    try:
        if p.tp > 1:
            _check_tensor_parallel(shortest, p, widths)
        spec = family(m.arch)
        if spec.check_layout is not None:
            spec.check_layout(shortest, p)
    except ConfigError as e:
        raise ConfigError(f"{key}: at the warmup's first length (model.seq_len={start}): {e}") from None


def _check_context_parallel(m: ModelConfig, p: ParallelConfig, t: TrainConfig) -> None:
    """parallel.cp > 1 (parallel/cp/split.py): what the sequence split supports today."""
    cp = p.cp
    if not family(m.arch).context_parallel:
        supported = ", ".join(name for name in cards() if family(name).context_parallel)
        raise ConfigError(f"parallel.cp={cp}: model.arch={m.arch!r} does not support context parallelism yet "
                          f"(families that do: {supported}); use parallel.cp=1")
    if m.seq_len % (2 * cp):
        raise ConfigError(f"parallel.cp={cp} needs model.seq_len={m.seq_len} divisible by 2 x parallel.cp = {2 * cp} "
                          f"(the load-balanced causal split gives each rank 2 equal chunks of the sequence)")
    if not family(m.arch).cp_balanced and (p.pp > 1 or t.compile_setting == "true"):
        key = f"parallel.pp={p.pp}" if p.pp > 1 else "train.compile=true"
        raise ConfigError(f"parallel.cp={cp} with {key} is not supported for model.arch={m.arch!r} yet (its state "
                          f"passes from slice to slice, parallel/cp/state.py, which is untested under pipelining and "
                          f"compile); use {'parallel.pp=1' if p.pp > 1 else 'train.compile=false'}")
    if p.cp_attention == "ulysses":
        _check_ulysses(m, p)
    if p.zero == "fsdp2" and p.dp_replicate > 1:
        raise ConfigError(f"parallel.cp={cp} with parallel.dp_replicate={p.dp_replicate} (HSDP) is not supported; "
                          f"use parallel.dp_replicate=1 (fsdp2 then shards over dp x cp)")
    if p.sequence_parallel and p.tp > 1 and (m.seq_len // cp) % p.tp:
        raise ConfigError(f"parallel.cp={cp} with parallel.sequence_parallel=true needs the slice of "
                          f"model.seq_len={m.seq_len} / parallel.cp = {m.seq_len // cp} tokens divisible by "
                          f"parallel.tp={p.tp} (sequence parallelism splits each rank's slice over tp)")


def _check_ulysses(m: ModelConfig, p: ParallelConfig) -> None:
    """parallel.cp_attention=ulysses (parallel/cp/ulysses.py): a family whose cp messages include an
    all-to-all (attention over the whole sequence, Titans' and Memory Caching's per-head memories),
    whose query heads per tp rank divide by cp (kv heads are repeated to lcm(kv heads, cp))."""
    from megatron_taper.cost.cp import ALLTOALL, cp_messages

    cp = p.cp
    blocks = cp_messages(m, 1, m.seq_len, cp, attention="ulysses")
    if not any(msg.kind == ALLTOALL for block in blocks for msg in block):
        raise ConfigError(f"parallel.cp_attention='ulysses': model.arch={m.arch!r} has no all-to-all form (nothing "
                          f"in it is per head: its state mixes every channel of d_model, so it cannot be split by "
                          f"heads; its context parallelism exchanges that state or its summaries between the cp "
                          f"slices, parallel/cp/state.py); use parallel.cp_attention=allgather")
    heads = m.n_heads // p.tp
    if heads % cp:
        raise ConfigError(f"parallel.cp={cp} with parallel.cp_attention='ulysses' splits each tp rank's heads over "
                          f"the cp ranks: model.n_heads={m.n_heads} / parallel.tp={p.tp} = {heads} heads per tp rank "
                          f"must divide by parallel.cp={cp}; choose parallel.tp x parallel.cp dividing "
                          f"model.n_heads, or parallel.cp_attention=allgather or ring")


def _check_tensor_parallel(m: ModelConfig, p: ParallelConfig, widths: Sequence[int]) -> None:
    tp = p.tp
    if family(m.arch).tp_block_plan is None:
        raise ConfigError(f"parallel.tp={tp}: model.arch={m.arch!r} has no tensor-parallel plan; use parallel.tp=1")
    if m.n_heads % tp:
        raise ConfigError(f"parallel.tp={tp} must divide model.n_heads={m.n_heads}")
    kv = m.kv_heads
    if kv % tp and tp % kv:
        raise ConfigError(f"parallel.tp={tp} and model.n_kv_heads={kv}: one must divide the other (kv heads are "
                          f"split when tp divides them and replicated when tp is a multiple of them)")
    if m.vocab_size < tp:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than parallel.tp={tp}")
    unit = m.taper.multiple
    for layer, (width, experts) in enumerate(zip(widths, moe_layers(m))):
        if width // unit < tp and not experts:  # a mixture of experts is replicated over tp
            raise ConfigError(f"layer {layer} has MLP width {width} = {width // unit} unit(s) of "
                              f"model.taper.multiple={unit}, fewer than parallel.tp={tp}: lower parallel.tp or "
                              f"model.taper.multiple, or raise model.mlp_width")
    if p.sequence_parallel and m.seq_len % tp:
        raise ConfigError(f"parallel.sequence_parallel needs model.seq_len={m.seq_len} divisible by parallel.tp={tp}")


def _check_zero(m: ModelConfig, p: ParallelConfig, world_size: int, dp: int) -> None:
    if p.zero == "deepspeed":
        if p.pp > 1:
            raise ConfigError(f"parallel.zero=deepspeed with parallel.pp={p.pp}: DeepSpeed refuses ZeRO-3 with "
                              f"pipeline parallelism; use parallel.zero=fsdp2 or parallel.pp=1")
        if world_size == 1:
            raise ConfigError("parallel.zero=deepspeed needs more than one process (torchrun --nproc-per-node N, "
                              "N >= 2); with one process use parallel.zero=none")
        if p.sequence_parallel and p.tp > 1:
            raise ConfigError("parallel.zero=deepspeed with parallel.sequence_parallel=true is not supported "
                              "(DeepSpeed reduces gradients inside backward, before the tp sums of sequence-"
                              "parallel norms); use parallel.zero=fsdp2")
    shards = p.zero == "deepspeed" or (p.zero == "fsdp2" and dp * p.cp > 1)
    if shards and p.tp > m.kv_heads:
        raise ConfigError(f"parallel.zero={p.zero} with parallel.tp={p.tp} > model.n_kv_heads={m.kv_heads}: kv "
                          f"heads replicated over tp ranks need a gradient sum over whole tensors, which ZeRO has "
                          f"already sharded; use parallel.tp <= model.n_kv_heads or parallel.zero=none")


def _check_hsdp(p: ParallelConfig, dp: int) -> None:
    """parallel.dp_replicate x parallel.dp_shard: the 2-D data-parallel mesh of HSDP (fsdp2 only)."""
    replicate, shard = p.dp_split(dp)
    if replicate == 1 and shard == dp:
        return
    if p.zero != "fsdp2":
        raise ConfigError(f"parallel.dp_replicate={p.dp_replicate} / parallel.dp_shard={p.dp_shard} (HSDP) need "
                          f"parallel.zero=fsdp2, not {p.zero!r}; with parallel.zero={p.zero} leave "
                          f"parallel.dp_replicate=1 and parallel.dp_shard=0")
    if replicate * shard != dp:
        given = p.dp_shard or f"0 (= {dp} // {replicate} = {shard})"
        raise ConfigError(f"parallel.dp_replicate={p.dp_replicate} x parallel.dp_shard={given} = {replicate * shard}"
                          f" must equal the data-parallel size {dp} (world size / (parallel.tp={p.tp} x "
                          f"parallel.pp={p.pp})); parallel.dp_shard=0 takes dp / parallel.dp_replicate")


def _check_float8(m: ModelConfig, p: ParallelConfig, t: TrainConfig) -> None:
    """train.float8 (parallel/float8.py): float8 matmuls need both dimensions multiples of the
    recipe's unit; mxfp8 a Blackwell GPU; on CUDA the compiled blocks (eager float8 does not pay)."""
    unit = FLOAT8_UNIT[t.float8_recipe]
    if p.tp > 1:
        raise ConfigError(f"train.float8=true with parallel.tp={p.tp} is not supported (the tensor-parallel "
                          f"linears are not torchao Float8Linear); use parallel.tp=1 or train.float8=false")
    if m.taper.multiple % unit or m.d_model % unit:
        raise ConfigError(f"train.float8=true needs model.taper.multiple (={m.taper.multiple}: every MLP width is a "
                          f"multiple of it) and model.d_model (={m.d_model}) to be multiples of {unit} (float8 "
                          f"matmuls of train.float8_recipe={t.float8_recipe}); set model.taper.multiple to a "
                          f"multiple of {unit}")
    if t.float8_recipe == "mxfp8" and t.device == "cpu":
        raise ConfigError("train.float8_recipe=mxfp8 needs a Blackwell GPU (train.device=cpu); use "
                          "train.float8_recipe=tensorwise or rowwise")
    if t.device == "cuda" and not compiles(m, p, t, "cuda"):
        raise ConfigError(f"train.float8=true on CUDA needs the compiled blocks (train.compile="
                          f"{t.compile_setting} does not compile this layout; eager float8 ran 2.4x slower than "
                          f"bf16 on an H200): set train.compile=true or train.float8=false")


def step_split(p: ParallelConfig, t: TrainConfig, dp: int) -> tuple[int, int]:
    """(sequences per micro-batch, micro-batches per step) on one data-parallel rank, as the trainer
    runs them: pp = 1: train.micro_batch x accumulation (parallel.microbatches is not used); pp > 1:
    the step's global_batch / dp sequences cut into parallel.microbatches pipeline micro-batches
    (default: one per train.micro_batch)."""
    rows = t.global_batch // dp
    if p.pp == 1:
        return t.micro_batch, max(1, rows // t.micro_batch)
    n_micro = p.microbatches or max(1, rows // t.micro_batch)
    return max(1, rows // n_micro), n_micro


def _check_batch(t: TrainConfig, dp: int) -> int:
    per_round = t.micro_batch * dp
    if t.global_batch % per_round:
        raise ConfigError(f"train.global_batch={t.global_batch} must be a multiple of train.micro_batch x "
                          f"data-parallel size = {t.micro_batch} x {dp}")
    return t.global_batch // per_round


def _check_pipeline(m: ModelConfig, p: ParallelConfig, t: TrainConfig, dp: int) -> int:
    virtual = p.virtual_stages
    if p.pp * virtual > m.n_layers:
        per_rank = f"parallel.pp_virtual={virtual}" if p.pp_schedule in INTERLEAVED_SCHEDULES else \
            f"{virtual} chunks per rank ({p.pp_schedule})"
        what = f"parallel.pp={p.pp}" + (f" x {per_rank}" if virtual > 1 else "")
        raise ConfigError(f"{what} = {p.pp * virtual} stages is more than model.n_layers={m.n_layers}: every "
                          f"stage needs a layer")
    if m.tie_embeddings:
        raise ConfigError("model.tie_embeddings=true with parallel.pp>1 is not supported: the embedding "
                          "(first stage) and the head (last stage) would live on different ranks")
    if p.pp_memory_gb > 0 and virtual > 1:
        raise ConfigError("parallel.pp_memory_gb: per-stage memory limits are only modelled for non-interleaved "
                          "schedules (parallel.pp_schedule=1f1b or gpipe)")
    rows = t.global_batch // dp  # sequences per step on one data-parallel rank
    n_micro = step_split(p, t, dp)[1]
    if rows % n_micro:
        raise ConfigError(f"parallel.microbatches={n_micro} must divide the {rows} sequences of a step on one "
                          f"data-parallel rank (train.global_batch / data-parallel size)")
    if n_micro < p.pp:
        if p.pp_schedule != "gpipe":
            raise ConfigError(
                f"parallel.microbatches={n_micro} is fewer than parallel.pp={p.pp} stages, which "
                f"parallel.pp_schedule={p.pp_schedule} cannot run; use at least {p.pp} micro-batches (raise "
                f"parallel.microbatches or train.global_batch / train.micro_batch) or parallel.pp_schedule=gpipe")
        warnings.warn(f"parallel.microbatches={n_micro} is fewer than parallel.pp={p.pp} stages: every step is "
                      f"mostly pipeline bubble (use at least {p.pp}, ideally 4x)", stacklevel=3)
    # errors name every key they depend on (the layout search relies on it): n_micro may come from train
    derived = "" if p.microbatches else " (train.global_batch / data-parallel size / train.micro_batch)"
    if p.pp_schedule in INTERLEAVED_SCHEDULES:
        rounds = max(1, n_micro // p.pp)
        if n_micro % rounds:
            raise ConfigError(f"parallel.microbatches={n_micro}{derived}: {p.pp_schedule} needs a multiple of "
                              f"parallel.pp={p.pp} (or fewer than 2 * pp)")
    if p.pp_schedule == "dualpipev" and n_micro < 2 * p.pp:
        raise ConfigError(f"parallel.microbatches={n_micro}{derived}: dualpipev needs at least 2 x parallel.pp = "
                          f"{2 * p.pp} (one per stage)")
    return n_micro
