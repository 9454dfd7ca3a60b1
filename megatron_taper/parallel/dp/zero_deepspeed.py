"""parallel.zero=deepspeed: DeepSpeed ZeRO stage 3 behind the ParallelModel interface.

    parallelize() -> DeepSpeedParallelModel.wrap(pm)      (pp must be 1; checked in cost/preflight.py)
    Trainer      -> pm.build_optimizer(train)             deepspeed.initialize(model, AdamW, config, mpu)
                 -> pm.forward_backward(micro_batches)   engine(x), engine.backward, engine.step
                                                         (non-boundary micro-steps)
                 -> pm.optimizer_step(...)               the boundary engine.step(): clip, AdamW, zero grads

Our tp groups go to DeepSpeed as `mpu` (data-parallel group = the mesh's dp dim, or with
context parallelism the flattened dp x cp group; model-parallel group = tp), so ZeRO partitions
each tp rank's local tensors over its dp (x cp) group, and the gradient norm counts a
tp-sharded parameter (marked `tensor_model_parallel`) on every tp rank and a replicated one on tp
rank 0 only, as ParallelModel.clip_gradients does. AdamW is our own torch optimizer (DeepSpeed
flattens its parameter groups into fp32 partitions); with optimizer offload it runs on the CPU.

Known traps handled here: `gradient_clipping` is set from train.grad_clip (DeepSpeed's default is
1.0, also when clipping was meant to be off); DS_ACCELERATOR=cpu is set (if unset) only when the
run's device is the CPU, and there DeepSpeed's shared-memory all-reduce op, which only its
inference all-reduce uses, is not JIT-built (skip_shm_comm_build); C++ ops DeepSpeed does build go
to TORCH_EXTENSIONS_DIR (tests/run.sh and the tests point it at .cache/torch_extensions); the
process group is left through
context.shutdown (barrier, then destroy), as DeepSpeed may abort at exit otherwise.
DeepSpeed skips a step whose gradient norm is non-finite (in every precision); that is reported
to the Trainer as a skipped step. A step whose loss is non-finite on any dp rank (the Trainer's
non-finite policy) is given NaN gradients in its last backward, so DeepSpeed skips it as well.
Context parallelism: DeepSpeed counts dp x cp data-parallel ranks (its train_batch_size is
train.global_batch x cp: a cp group's ranks see the same sequences), averages gradients over
them (the loss shares make that the whole-sequence gradient), and each rank feeds its slices
(ParallelModel.batch_inputs, with doc_start under data.document_mask) and reports the mean of the
shares over the cp group.
Precision: DeepSpeed's `bf16` mode is off; its fp32 partitions run under the Trainer's bf16
autocast (docs/precision.md).

Checkpoints: every DeepSpeed checkpoint holds DeepSpeed's own files (deepspeed/state/, loaded
only by the same engine at the same dp and tp size) *and* the sharded logical files of
checkpoint/ (each rank writes its own fp32 partitions and AdamW moments as boxes of the logical
tensors, `checkpoint_pieces`: no gather), which are the route to another dp/tp size or to
fsdp2/none, and what tools/convert_checkpoint.py reads.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from megatron_taper.checkpoint.files import (
    CheckpointError,
    CheckpointReader,
    Piece,
    deepspeed_loads_allowlisted,
    load_deepspeed_file,
    shard_file,
)
from megatron_taper.parallel.context import ParallelContext
from megatron_taper.parallel.cp.split import cp_mean
from megatron_taper.parallel.model import ParallelModel
from megatron_taper.training.optim import build_optimizer
from megatron_taper.validation import ConfigError

if TYPE_CHECKING:
    from megatron_taper.config import DeepSpeedConfig, TrainConfig

NATIVE_DIR = "deepspeed"  # inside a checkpoint folder
NATIVE_TAG = "state"
OPTIM_KEYS = ("exp_avg", "exp_avg_sq")


class TPGroups:
    """The `mpu` object DeepSpeed asks for: our tp group is its model-parallel group."""

    def __init__(self, ctx: ParallelContext):
        self.ctx = ctx

    def get_model_parallel_group(self):
        return self.ctx.tp_group

    def get_model_parallel_rank(self) -> int:
        return self.ctx.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ctx.tp

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.ctx.rank - self.ctx.tp_rank

    def get_data_parallel_group(self):
        return self.ctx.grad_group  # dp, or dp x cp (ZeRO shards over both)

    def get_data_parallel_rank(self) -> int:
        return self.ctx.dp_shard_rank

    def get_data_parallel_world_size(self) -> int:
        return self.ctx.dp_shard


def deepspeed_config(t: TrainConfig, d: DeepSpeedConfig, ctx: ParallelContext) -> dict:
    """The DeepSpeed JSON config from our sections; parallel.deepspeed.config (a JSON file) is
    merged over it for anything else DeepSpeed offers."""
    accum = t.global_batch // (t.micro_batch * ctx.dp)
    zero: dict[str, Any] = {
        "stage": 3,
        "reduce_bucket_size": d.reduce_bucket_size,
        "stage3_prefetch_bucket_size": d.prefetch_bucket_size,
        "stage3_param_persistence_threshold": d.param_persistence_threshold,
        "contiguous_gradients": True,
        "overlap_comm": ctx.device.type == "cuda",
    }
    for kind in ("optimizer", "param"):
        device = getattr(d, f"offload_{kind}")
        if device != "none":
            zero[f"offload_{kind}"] = {"device": device, "pin_memory": ctx.device.type == "cuda",
                                       **({"nvme_path": d.nvme_path} if device == "nvme" else {})}
    config: dict[str, Any] = {
        # DeepSpeed counts dp x cp data-parallel ranks, the ranks of a cp group the same sequences
        "train_batch_size": t.global_batch * ctx.cp,
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": float(t.grad_clip),  # explicit: DeepSpeed's default is 1.0
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # our torch AdamW
        "zero_force_ds_cpu_optimizer": False,  # ... also when offloaded
        # one precision policy (docs/precision.md): fp32 partitions, the Trainer's bf16 autocast;
        # DeepSpeed's own bf16 mode would store every weight (norms, embedding) in bf16
        "bf16": {"enabled": False},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if d.config:
        try:
            with open(d.config) as f:
                extra = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"parallel.deepspeed.config={d.config!r}: unreadable JSON ({e})") from None
        _merge(config, extra)
    return config


def _merge(base: dict, extra: dict) -> None:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, box shape) of the boxes that cover the flat row-major range [lo, hi) of a tensor
    of `shape`, in order."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    out = []
    row = lo // inner
    if lo % inner:  # a partial first row
        end = min(hi, (row + 1) * inner)
        out += [((row, *o), (1, *b)) for o, b in flat_boxes(shape[1:], lo - row * inner, end - row * inner)]
        row, lo = row + 1, end
    last = hi // inner
    if last > row:  # whole rows
        out.append(((row, *[0] * (len(shape) - 1)), (last - row, *shape[1:])))
    if hi % inner and hi > max(lo, last * inner):  # a partial last row
        out += [((last, *o), (1, *b)) for o, b in flat_boxes(shape[1:], 0, hi - last * inner)]
    return out


def _flat_index(shape: tuple[int, ...], offsets: tuple[int, ...]) -> int:
    index = 0
    for size, o in zip(shape, offsets):
        index = index * size + o
    return index


@dataclass(frozen=True)
class ParameterShard:
    """A rank's ZeRO-3 partition of one parameter: flat range [lo, hi) of the tp-local tensor of
    `shape`, which sits at `tp_offsets` in the logical tensor of shape `full`; `padded` elements
    in DeepSpeed's partition buffer."""

    shape: tuple[int, ...]
    full: tuple[int, ...]
    tp_offsets: tuple[int, ...]
    owner: bool  # writes it (tp replicas do not)
    padded: int
    lo: int
    hi: int

    def boxes(self) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        """(start in the flat partition, offsets in the logical tensor, box shape) of each box of
        the range (`flat_boxes`: at most 2 x ndim - 1)."""
        return [(_flat_index(self.shape, offsets) - self.lo, tuple(o + t for o, t in zip(offsets, self.tp_offsets)),
                 box) for offsets, box in flat_boxes(self.shape, self.lo, self.hi)]

    def read(self, reader: CheckpointReader, key: str) -> torch.Tensor:
        """The partition of logical tensor `key` from its records (fp32, CPU, padded with zeros)."""
        flat = torch.zeros(self.padded, dtype=torch.float32)
        for start, where, box in self.boxes():
            reader.read_into(key, where, flat[start:start + math.prod(box)].view(box))
        return flat


def skip_shm_comm_build() -> None:
    """DeepSpeed's CPU communication backend JIT-builds its shared-memory all-reduce op at initialize
    (30-100 s of compiling on 2 cores, once per TORCH_EXTENSIONS_DIR); only its inference_all_reduce
    uses that op, which ZeRO training never calls (its collectives are torch.distributed's on our
    gloo groups), and without it DeepSpeed falls back to torch.distributed. Marked incompatible in
    DeepSpeed's table of compatible ops, it is not built."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


@dataclass
class DeepSpeedParallelModel(ParallelModel):
    options: DeepSpeedConfig | None = None  # parallel.deepspeed
    engine: Any = None  # deepspeed.DeepSpeedEngine, after build_optimizer

    @classmethod
    def wrap(cls, pm: ParallelModel, options: DeepSpeedConfig) -> "DeepSpeedParallelModel":
        """Hand `pm`'s module to DeepSpeed (at build_optimizer); cost/preflight.py has refused one process,
        pp > 1, sequence parallelism and tp > kv heads."""
        assert pm.ctx.mesh is not None and not pm.tp_grad_syncs
        for name, param in pm.module.named_parameters():
            if name in pm.to_full:  # a tp shard: DeepSpeed counts its norm on every tp rank
                param.tensor_model_parallel = True
        out = cls(pm.module, pm.ctx, pm.loss_fn, pm.to_full, pm.to_local, pm.replicas, pm.tp_grad_syncs,
                  tp_specs=pm.tp_specs, split=pm.split, options=options)
        out.dp_sharded = True  # logical_state is a collective over dp
        return out

    # -- optimizer ----------------------------------------------------------------------------

    def build_optimizer(self, train: TrainConfig) -> torch.optim.Optimizer:
        if self.ctx.device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        if self.ctx.device.type == "cpu":
            skip_shm_comm_build()
        base = build_optimizer(self.module, train, self.ctx.device)
        self.engine, optimizer, _, _ = deepspeed.initialize(
            model=self.module, optimizer=base, config=deepspeed_config(train, self.options, self.ctx),
            mpu=TPGroups(self.ctx),
            dist_init_required=False)
        return optimizer

    def forward_backward(self, micro_batches: list[torch.Tensor], autocast: Callable,
                         carry: None = None, seq_len: int | None = None) -> torch.Tensor:
        assert carry is None, "a carried state is refused with this layout (the family's check_layout)"
        engine = self.engine
        if engine.gradient_accumulation_steps() != len(micro_batches):
            raise ConfigError(f"deepspeed: {len(micro_batches)} micro-batches per step, but the engine was built "
                              f"for {engine.gradient_accumulation_steps()}")
        total = torch.zeros((), device=self.ctx.device)
        for i, tokens in enumerate(micro_batches):
            inputs, targets, documents = self.batch_inputs(tokens.to(self.ctx.device, non_blocking=True), seq_len)
            with autocast():
                loss = self.loss_fn(engine(inputs, **documents), targets)
            scaled = loss
            if i == len(micro_batches) - 1 and not self._finite_over_dp(total + loss.detach().float()):
                # the non-finite policy: DeepSpeed skips a step only for a non-finite gradient
                # norm, so a step whose loss is non-finite on any dp rank gets NaN gradients
                scaled = loss * float("nan")
            engine.backward(scaled)  # scaled by 1 / gradient_accumulation_steps
            if i < len(micro_batches) - 1:
                engine.step()  # not a boundary: counts the micro-step, no update
            total += loss.detach().float()
        return cp_mean(total / len(micro_batches), self.split)

    def _finite_over_dp(self, value: torch.Tensor) -> bool:
        """Whether `value` is finite on every dp rank (a host read; DeepSpeed's step reads its
        gradient norm on the host anyway)."""
        value = value.clone()
        torch.distributed.all_reduce(value, group=self.ctx.grad_group)
        return bool(torch.isfinite(value))

    def reduce_gradients(self) -> None:  # DeepSpeed reduce-scatters inside backward
        return None

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        raise NotImplementedError("deepspeed clips inside engine.step (gradient_clipping = train.grad_clip)")

    def optimizer_step(self, optimizer: torch.optim.Optimizer, max_norm: float,
                       loss_finite: bool | torch.Tensor = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The boundary engine.step(); a non-finite loss was turned into NaN gradients by
        forward_backward, so DeepSpeed skips that step too. (norm, stepped) as tensors."""
        engine = self.engine
        skipped = engine.skipped_steps
        engine.step()  # boundary: global norm, clip, AdamW (skipped if the norm is non-finite), zero grads
        stepped = engine.skipped_steps == skipped
        norm = engine.get_global_grad_norm() if stepped else float("nan")
        norm = torch.as_tensor(float(norm) if norm is not None else float("nan"), device=self.ctx.device)
        return norm, torch.tensor(stepped, device=self.ctx.device)

    # -- checkpoints --------------------------------------------------------------------------

    def logical_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        step = self._adam_step()
        model_state, optim_state = {}, {}
        for name, param in self.module.named_parameters():
            # all-gathers over dp (the fp32 master copy), then the tp gather
            model_state[name] = self.full_tensor(name, safe_get_full_fp32_param(param)).cpu()
            if step is None:
                continue
            state = {k: self.full_tensor(name, safe_get_full_optimizer_state(param, k)).cpu() for k in OPTIM_KEYS}
            optim_state[name] = {"step": step.detach().cpu().clone(), **state}
        return model_state, optim_state

    def load_logical_state(self, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict,
                           missing: Callable[[str], Exception]) -> None:
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        params = dict(self.module.named_parameters())
        for name in params:
            if name not in model_state:
                raise missing(name)
        for name, param in params.items():
            value = self.local_tensor(name, model_state[name]).to(self.ctx.device)
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):  # the working copy
                with torch.no_grad():
                    param.copy_(value.to(param.dtype))
            safe_set_full_fp32_param(param, value.float())  # the fp32 master copy
        if not optim_state:
            return
        step = next(iter(optim_state.values()))["step"]
        self._init_adam_state(step)
        for name, param in params.items():
            if name in optim_state:
                for k in OPTIM_KEYS:
                    safe_set_full_optimizer_state(param, self.local_tensor(name, optim_state[name][k]).float(), k)

    def checkpoint_pieces(self, optimizer: torch.optim.Optimizer, copy: bool = True) -> list[Piece]:
        """Each rank writes its own ZeRO partitions, no gather: a parameter's partition on dp rank
        r is the flat range [r x P, (r + 1) x P) of the row-major tp-local tensor (P: DeepSpeed's
        partition size; the last one padded), written as the boxes that range covers (`flat_boxes`:
        at most 2 x ndim - 1), placed in the logical tensor by the tp layout (piece_box). Replicas
        over tp write on the owning tp rank only. AdamW's step (a scalar, the same on every rank)
        is written once per parameter, by the ranks in turn, so each rank finds one in its own
        file. DeepSpeed's own sharded files (save_native) are what resumes at the same size."""
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

        step = self._adam_step()
        pieces = []
        for i, (name, param) in enumerate(self.module.named_parameters()):
            shards = self.ctx.dp_shard
            turn = (i % shards, i // shards % self.ctx.tp)  # the (dp x cp, tp) rank writing this step
            if step is not None and (self.ctx.dp_shard_rank, self.ctx.tp_rank) == turn:
                pieces.append(Piece(f"optim/{name}/step", (), (), step.detach().cpu().clone()))
            part = self._partition(name, param)
            if not part.owner:
                continue
            tensors = {f"model/{name}": safe_get_local_fp32_param(param)}
            if step is not None:
                tensors.update({f"optim/{name}/{k}": safe_get_local_optimizer_state(param, k) for k in OPTIM_KEYS})
            for key, flat in tensors.items():
                flat = flat.detach().reshape(-1)[: part.hi - part.lo].to("cpu", copy=copy)
                for start, where, box in part.boxes():
                    pieces.append(Piece(key, part.full, where, flat[start:start + math.prod(box)].reshape(box)
                                        .contiguous()))
        return pieces

    def load_pieces(self, optimizer: torch.optim.Optimizer, reader: CheckpointReader) -> None:
        """Each rank reads only its own ZeRO partition of every parameter and AdamW moment (the
        boxes of its flat range, as checkpoint_pieces writes them) and sets it in place: the
        working partition and the fp32 master (DeepSpeed's local API), no gather. At the dp and tp
        size that wrote the checkpoint a rank reads (and verifies) only its own records; at another
        size, the records that overlap its partition."""
        from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

        params = [(name, param, self._partition(name, param)) for name, param in self.module.named_parameters()]
        with torch.no_grad():
            for name, param, part in params:
                value = part.read(reader, f"model/{name}")
                param.ds_tensor.data.copy_(value.reshape(param.ds_tensor.shape))  # the working copy
                safe_set_local_fp32_param(param, value.to(self.ctx.device))  # the fp32 master copy
        steps = [f"optim/{name}/step" for name, _, _ in params if f"optim/{name}/step" in reader.index]
        if not steps:
            return
        own = [k for k in steps if reader.index[k]["records"][0]["file"] == shard_file(self.ctx.rank)]
        self._init_adam_state(reader.read((own or steps)[0], (), ()))  # one value: from this rank's file if there
        for name, param, part in params:
            for k in OPTIM_KEYS:
                if f"optim/{name}/{k}" in reader.index:
                    safe_set_local_optimizer_state(param, part.read(reader, f"optim/{name}/{k}").to(self.ctx.device), k)

    def _partition(self, name: str, param: torch.nn.Parameter) -> "ParameterShard":
        """This rank's ZeRO partition of `param`: the flat range [dp_rank x P, (dp_rank + 1) x P) of
        the row-major tp-local tensor (P: DeepSpeed's partition size; the last one padded), placed
        in the logical tensor by the tp layout (piece_box)."""
        shape = tuple(param.ds_shape)
        full, tp_offsets, owner = self.piece_box(name, torch.empty(shape, device="meta"))
        size = param.ds_tensor.ds_numel if hasattr(param.ds_tensor, "ds_numel") else param.ds_tensor.numel()
        lo = min(self.ctx.dp_shard_rank * size, param.ds_numel)
        hi = min(lo + size, param.ds_numel)
        return ParameterShard(shape, full, tp_offsets, owner, param.ds_tensor.numel(), lo, hi)

    def save_native(self, folder: str) -> str | None:
        """DeepSpeed's own checkpoint into folder/deepspeed/state/ (a collective; every rank writes)."""
        self.engine.save_checkpoint(os.path.join(folder, NATIVE_DIR), tag=NATIVE_TAG, save_latest=False)
        return NATIVE_DIR

    def load_native(self, folder: str, meta: dict, verify: Callable[[str], None]) -> bool:
        """Load DeepSpeed's own files when they fit this run (same engine, dp and tp); else False.
        Only the files this rank's engine reads are verified (`native_reads`); a failure on any
        rank is raised on every rank (one gather), before DeepSpeed reads anything."""
        layout = meta["layout"]
        same = (meta["config"]["parallel"].get("zero") == "deepspeed" and layout["dp"] == self.ctx.dp
                and layout.get("cp", 1) == self.ctx.cp and layout["tp"] == self.ctx.tp
                and os.path.isdir(os.path.join(folder, NATIVE_DIR, NATIVE_TAG)))
        if not same:
            return False
        error = ""
        try:
            for name in self.native_reads(folder, meta):
                verify(name)
                # the allow-list before the collective load, so that every rank stops (mmap: no tensor is read)
                load_deepspeed_file(os.path.join(folder, name), "cpu", mmap=True)
        except CheckpointError as e:
            error = str(e)
        errors: list = [None] * self.ctx.world_size  # engine.load_checkpoint is a collective: all ranks or none
        torch.distributed.all_gather_object(errors, error)
        if any(errors):
            raise CheckpointError(next(e for e in errors if e))
        with deepspeed_loads_allowlisted():  # DeepSpeed's loads run weights_only with an allow-list (files.py)
            path, _ = self.engine.load_checkpoint(os.path.join(folder, NATIVE_DIR), tag=NATIVE_TAG,
                                                  load_optimizer_states=True, load_lr_scheduler_states=False)
        if path is None:
            raise ConfigError(f"{folder}: DeepSpeed could not load its checkpoint files")
        return True

    def native_reads(self, folder: str, meta: dict) -> list[str]:
        """The files of DeepSpeed's checkpoint in `folder` that this rank's engine.load_checkpoint
        opens (names as in meta["files"]): its own model-state and ZeRO optimizer-state files
        (named by DeepSpeed for this dp and tp rank), or every optimizer-state file when DeepSpeed's
        elastic checkpoints are on."""
        root = os.path.join(folder, NATIVE_DIR)
        own = [self.engine._get_ckpt_name(root, NATIVE_TAG), self.engine._get_zero_ckpt_name(root, NATIVE_TAG)]
        names = [os.path.relpath(f, folder).replace(os.sep, "/") for f in own]
        if self.engine.zero_elastic_checkpoint():
            names += [n for n in meta["files"] if n.startswith(f"{NATIVE_DIR}/") and n.endswith("optim_states.pt")]
        return sorted(set(names))

    def _inner_optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer.optimizer  # the torch AdamW over DeepSpeed's fp32 partitions

    def _adam_step(self) -> torch.Tensor | None:
        for state in self._inner_optimizer().state.values():
            if "step" in state:
                return torch.as_tensor(state["step"]).float()
        return None

    def _init_adam_state(self, step: torch.Tensor) -> None:
        """AdamW creates its state lazily at the first step; create it (zeros) so it can be set. Its
        state is keyed by DeepSpeed's fp32 partition groups (its param_groups hold them only
        during a step)."""
        inner = self._inner_optimizer()
        on_device = any(g.get("fused") or g.get("capturable") for g in inner.param_groups)
        for p in self.engine.optimizer.fp32_partitioned_groups_flat:
            state = inner.state[p]
            for k in OPTIM_KEYS:
                state.setdefault(k, torch.zeros_like(p, memory_format=torch.preserve_format))
            state["step"] = step.to(dtype=torch.float32, device=p.device).clone() if on_device \
                else step.to(torch.float32).clone()
