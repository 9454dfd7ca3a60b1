"""Pipeline parallelism: split the model into stages by cost, run them with torch.distributed.pipelining.

    full model (on the meta device, or initialised and the same on every rank)
      -> plan (cost/partition.py: layers per stage by parallel.pp_balance; profile: measured by rank 0's tp group)
      -> this pp rank keeps only its layers (+ embedding on stage 0; final norm, head, loss on the
         last stage), parameter names unchanged (global layer indices)
      -> tensor parallelism etc. on that module (`parallelize(..., whole_model=False)`)
      -> torch.distributed.pipelining stage(s) + schedule over the pp group of the (pp, dp, tp) mesh

Schedules (`parallel.pp_schedule`): 1f1b (default), gpipe, interleaved_1f1b (each rank holds
`parallel.pp_virtual` chunks, chunk c on pp rank c % pp), and the zero-bubble ones, which split
each backward into the input gradient (sent upstream at once) and the weight gradient (deferred
into what would be bubble): interleaved_zero_bubble (ZB1P; looped placement like
interleaved_1f1b), zbv (ZB-V) and dualpipev (DualPipeV), both with exactly 2 chunks per rank in a
V (rank r: chunks r and 2 pp - 1 - r, so rank 0 holds embedding and head). Forward-only
evaluation (one micro-batch) runs interleaved 1F1B over the same stages (looped placement) or,
in the V placement, ZB-V's action list without its backward actions (`_forward_only_v`: ZB-V's
own evaluation runs them and fails; DualPipeV needs 2 pp micro-batches).

Data parallelism: zero=fsdp2 shards each chunk with its own FSDP root (zero.py; every schedule),
zero=none at dp > 1 averages the step's accumulated gradients over dp after the last backward
(data_parallel.average_gradients), for every schedule.

Micro-batches: the rank's micro-batches of one step are concatenated along the batch and cut
into `parallel.microbatches` equal pieces (0 = as many as the Trainer passes). 1F1B and
interleaved 1F1B need at least pp of them; cost/preflight.py refuses fewer (GPipe runs with fewer but
warns, since then most of every step is pipeline bubble).

Loss: the last stage computes it per micro-batch (the ParallelModel's loss_fn, vocab-parallel
under tp); the mean is broadcast over the pp group, so every rank returns the same value.
Context parallelism (cp > 1): every stage's micro-batches are [b, S / cp] slices (hidden states
[b, S / cp, D] between stages): the first stage feeds its slice of the inputs, the last stage its
slice of the targets to the loss share (context_parallel.split_loss), and the returned loss is
the mean of the shares over the cp group; gradients are averaged over dp x cp.
Gradients are scaled by 1 / n_microbatches, i.e. they are those of the mean loss.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from megatron_taper.config import V_SCHEDULES
from megatron_taper.cost.partition import PipelinePlan, chunk_rank, plan_pipeline
from megatron_taper.models.moe import uncounted
from megatron_taper.parallel.context import ParallelContext, has_bf16
from megatron_taper.parallel.cp.split import cp_mean
from megatron_taper.parallel.dp.ddp import average_gradients
from megatron_taper.parallel.dp.ddp import bucket_mb as dp_bucket_mb
from megatron_taper.parallel.dp.fsdp2 import apply_zero
from megatron_taper.parallel.meta_init import is_meta
from megatron_taper.parallel.model import ParallelModel
from megatron_taper.parallel.pp.profile import TPShard, profile_layer_times, profile_meta_layer_times

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig, ParallelConfig, TrainConfig

@dataclass
class PipelineParallelModel(ParallelModel):
    """A ParallelModel whose `module` holds only this pp rank's layers (all its chunks)."""

    plan: PipelinePlan | None = None
    chunks: list[nn.Module] = field(default_factory=list)  # per local virtual stage, schedule order
    chunk_ids: list[int] = field(default_factory=list)  # their global stage indices
    schedule_name: str = "1f1b"
    microbatches: int = 0  # 0 = as many as forward_backward receives
    _schedules: dict[Any, Any] = field(default_factory=dict, repr=False)
    _reducing: list[Any] = field(default_factory=list, repr=False)  # stages whose reduce-scatter is issued
    _dp_bucket_bytes: float = 0.0  # zero=none, dp > 1: average_gradients' bucket size

    def attach_data_parallel(self, bucket_mb: float) -> None:
        """zero=none, dp x cp > 1: the gradients a step accumulates in this rank's chunks are
        averaged over dp x cp in reduce_gradients (data_parallel.average_gradients: flat buckets, after the
        schedule's last backward; the module doc of data_parallel.py says why not DDP)."""
        assert not self.dp_sharded and not self._schedules, "before the first step"
        self.ddp_attached = True
        self._dp_bucket_bytes = dp_bucket_mb(bucket_mb, self.module, self.ctx.dp * self.ctx.cp) * 2**20

    def reduce_gradients(self) -> None:
        if self.ddp_attached:
            average_gradients(self.module, self.ctx.grad_group, self._dp_bucket_bytes, ignore=self.ep_specs)
        super().reduce_gradients()

    def _reshard(self) -> None:
        """Each chunk is its own FSDP root (zero.py): shard all of them again, roots included."""
        if self.dp_sharded:
            from torch.distributed.fsdp import FSDPModule

            for chunk in self.chunks:
                for module in chunk.modules():
                    if isinstance(module, FSDPModule):
                        module.reshard()

    @property
    def n_stages(self) -> int:
        return self.ctx.pp * len(self.chunks)

    def forward_backward(self, micro_batches: list[torch.Tensor], autocast: Callable,
                         carry: None = None, seq_len: int | None = None) -> torch.Tensor:
        assert carry is None, "a carried state is refused with this layout (the family's check_layout)"
        assert seq_len is None or seq_len == micro_batches[0].shape[1] - 1, \
            "preflight refuses a sequence-length warmup with parallel.pp > 1"
        tokens = torch.cat([t.to(self.ctx.device, non_blocking=True) for t in micro_batches])
        n_micro = self.microbatches or len(micro_batches)
        assert tokens.shape[0] % n_micro == 0, "preflight checks parallel.microbatches against the batch"
        schedule = self._schedule(n_micro, tuple(tokens.shape), train=True)
        losses: list[torch.Tensor] = []
        with autocast():
            self._step(schedule, tokens, losses, train=True)
        self._finish_reductions(n_micro)
        return self._mean_loss(losses)

    @torch.no_grad()
    def evaluate(self, tokens: torch.Tensor, autocast: Callable) -> torch.Tensor:
        tokens = tokens.to(self.ctx.device, non_blocking=True)
        schedule = self._schedule(1, tuple(tokens.shape), train=False)
        losses: list[torch.Tensor] = []
        with autocast():
            self._step(schedule, tokens, losses, train=False)
        return self._mean_loss(losses)

    # -- internals -------------------------------------------------------------------------------

    def _step(self, schedule, tokens: torch.Tensor, losses: list, train: bool) -> None:
        run = schedule.step if train else schedule.eval
        first, last = 0 in self.chunk_ids, self.n_stages - 1 in self.chunk_ids
        inputs, targets, documents = self.batch_inputs(tokens)  # cp > 1: this rank's [B, S / cp] slices
        args = (inputs,) if first else ()
        kwargs = {"target": targets, "losses": losses} if last else {}
        # return_outputs=False: the last stage would keep every micro-batch's logits [b, S, V / tp]
        # to the end of the step and then concatenate them (the losses are all that is used);
        # `documents` (doc_start) is cut into micro-batches like the inputs and reaches every stage
        run(*args, return_outputs=False, **kwargs, **documents)

    def _mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        if losses:
            loss = torch.stack([x.detach().float() for x in losses]).mean()
        else:
            loss = torch.zeros((), device=self.ctx.device, dtype=torch.float32)
        # the rank of the last chunk holds the loss: pp - 1 (looped placement), 0 (V)
        holder = chunk_rank(self.n_stages - 1, self.ctx.pp, self.schedule_name in V_SCHEDULES)
        dist.broadcast(loss, group=self.ctx.pp_group, group_src=holder)
        return cp_mean(loss, self.split)

    def _schedule(self, n_micro: int, shape: tuple[int, ...], train: bool):
        """One schedule (and stage objects, whose shapes are inferred on first use) per batch shape."""
        key = (n_micro, shape, train)
        if key not in self._schedules:
            from torch.distributed.pipelining import (
                PipelineStage,
                Schedule1F1B,
                ScheduleDualPipeV,
                ScheduleGPipe,
                ScheduleInterleaved1F1B,
                ScheduleInterleavedZeroBubble,
                ScheduleZBVZeroBubble,
            )

            stages = [PipelineStage(chunk, idx, self.n_stages, self.ctx.device, group=self.ctx.pp_group)
                      for chunk, idx in zip(self.chunks, self.chunk_ids)]
            for stage in stages:  # its shape inference runs a forward (on empty tensors past stage 0)
                stage._forward_metadata_inference = uncounted(stage._forward_metadata_inference, stage.submod)
            loss_fn = self.loss_fn
            zero_bubble = {"interleaved_zero_bubble": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble,
                           "dualpipev": ScheduleDualPipeV}
            if train and self.schedule_name in zero_bubble:
                schedule = zero_bubble[self.schedule_name](stages, n_microbatches=n_micro, loss_fn=loss_fn)
            elif self.schedule_name in V_SCHEDULES:  # forward-only evaluation in the V placement
                schedule = _forward_only_v(ScheduleZBVZeroBubble(stages, n_microbatches=n_micro, loss_fn=loss_fn))
            elif len(stages) > 1:  # interleaved_1f1b; forward-only evaluation of interleaved_zero_bubble
                schedule = ScheduleInterleaved1F1B(stages, n_microbatches=n_micro, loss_fn=loss_fn)
            elif self.schedule_name == "1f1b" and train:
                schedule = Schedule1F1B(stages[0], n_microbatches=n_micro, loss_fn=loss_fn)
            else:  # gpipe, and forward-only evaluation with one micro-batch for 1f1b
                schedule = ScheduleGPipe(stages[0], n_microbatches=n_micro, loss_fn=loss_fn)
            if train and self.dp_sharded and len(stages) > 1:  # torch's action-list runtime
                from torch.distributed.pipelining.schedules import REDUCE_GRAD

                schedule.register_custom_function(REDUCE_GRAD, self._reduce_scatter_chunk)
            self._schedules[key] = schedule
        return self._schedules[key]

    def _reduce_scatter_chunk(self, action, ctx) -> None:
        """REDUCE_GRAD of one chunk, scheduled right after its last backward (zero-bubble: its last
        weight-gradient pass) of the step: issue every FSDP unit's reduce-scatter of the chunk's
        accumulated gradients (and reshard it) as torch's stage does (perform_reduce_grad), but
        leave the compute stream's wait for them and the 1 / n_micro scaling to the end of the
        step (_finish_reductions), so that on CUDA they overlap the backward of the rank's other
        chunks."""
        stage = next(s for s in ctx.schedule_ref._stages if s.stage_index == action.stage_index)
        root = stage.submod
        root.set_is_last_backward(True)
        root.set_reshard_after_backward(True)
        root.set_requires_gradient_sync(True)
        for state in root._get_fsdp_state()._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                group.post_backward()
        self._reducing.append(stage)

    def _finish_reductions(self, n_micro: int) -> None:
        """Wait for the chunks' reduce-scatters (FSDP's end-of-backward callback: the compute
        stream waits for them), then scale the sharded gradients to those of the mean loss."""
        for stage in self._reducing:
            stage.submod._get_fsdp_state()._root_post_backward_final_callback()
            stage.scale_grads(n_micro)
        self._reducing.clear()


def _forward_only_v(schedule):
    """A ZB-V schedule whose lowered action list keeps only the forwards and their sends and
    receives (ZB-V's eval() would run its backward actions too, and fail without gradients)."""
    from torch.distributed.pipelining.schedules import _ComputationType as T

    kept = (T.FORWARD, T.SEND_F, T.RECV_F, T.UNSHARD, T.RESHARD)
    schedule.pipeline_order_with_comms = {
        rank: [a for a in actions if a.computation_type in kept]
        for rank, actions in schedule.pipeline_order_with_comms.items()}
    return schedule


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (it is sent to the previous stage)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def dense_stage_io(chunk: nn.Module) -> None:
    """Give a stage a contiguous output and input gradient. The p2p receive buffers are built
    from their layouts and must be dense, while sequence parallelism leaves strided ones (the
    reduce-scatter at a stage's end, the all-gather's backward at the next one's start). Hooks,
    not a wrapper, so that the pipelining stage still sees an FSDP root as its module."""

    def pre(_module, args):
        return tuple(_DenseGrad.apply(a) if torch.is_tensor(a) and a.requires_grad else a for a in args)

    def post(_module, _args, output):
        return output.contiguous() if torch.is_tensor(output) else output

    chunk.register_forward_pre_hook(pre)
    chunk.register_forward_hook(post)


def plan_stages(model_cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig, dp: int,
                measured: tuple[list[float], float, float] | None = None, memory_gb: list[float] | None = None,
                bytes_per_param: float | None = None, memory_key: str = "parallel.pp_memory_gb",
                device: torch.device | None = None, bf16: bool | None = None) -> PipelinePlan:
    """The split the trainer makes at data-parallel size `dp` (micro-batches as preflight derives
    them; memory limits from parallel.pp_memory_gb unless `memory_gb` is given). The memory
    model (megatron_taper/cost/memory.py) assumes `parallel`'s tp / sequence parallelism / ZeRO
    engine, `train`'s checkpointing, and its precision on `device` (default: train.device; auto =
    CUDA if this machine has it) unless `bf16` says; `bytes_per_param` replaces the engine's state
    bytes. Micro-batches follow the trainer (preflight.step_split: at pp = 1 train.micro_batch x
    accumulation)."""
    from megatron_taper.cost.memory import MemorySetup
    from megatron_taper.cost.preflight import step_split
    from megatron_taper.parallel.context import choose_device

    micro_batch, n_micro = step_split(parallel, train, dp)
    if memory_gb is None and parallel.pp_memory_gb > 0:
        memory_gb = [parallel.pp_memory_gb]
    if bf16 is None:
        device = device or (torch.device("cuda") if train.device == "cuda" else choose_device(train.device))
        bf16 = train.uses_bf16(has_bf16(device))
    setup = MemorySetup.from_config(parallel, train, dp, bf16)
    return plan_pipeline(model_cfg, parallel.pp, virtual=parallel.virtual_stages, balance=parallel.pp_balance,
                         microbatches=n_micro, micro_batch=micro_batch, schedule=parallel.pp_schedule,
                         memory_gb=memory_gb, bytes_per_param=bytes_per_param, measured=measured,
                         memory_key=memory_key, setup=setup, v_shape=parallel.pp_schedule in V_SCHEDULES)


def make_plan(model: nn.Module, ctx: ParallelContext, model_cfg: ModelConfig, parallel: ParallelConfig,
              train: TrainConfig) -> PipelinePlan:
    """The stage split, identical on every rank (profile: measured by the tp group of rank 0 and
    broadcast); memory limits are checked for this run's device and precision.

    Profiling times each layer under the run's precision (bf16 autocast when train.precision gives
    bf16) and tp degree: a model on the meta device is materialised one piece at a time with random
    weights (profile_meta_layer_times: the peak is one layer, not the model); under tp each rank of
    rank 0's tp group (pp rank 0, dp rank 0) materialises and times its own shard of each piece,
    with the tp collectives. A model built with real tensors (families with buffers; none today)
    is timed whole and unsharded on rank 0."""
    measured = None
    if parallel.pp_balance == "profile":
        box: list[Any] = [None]
        bf16 = train.uses_bf16(has_bf16(ctx.device))  # timed under the run's precision
        autocast = (lambda: torch.autocast(ctx.device.type, dtype=torch.bfloat16)) if bf16 else None
        if is_meta(model) and ctx.pp_rank == 0 and ctx.dp_rank == 0:  # one piece at a time on the device
            tp = (TPShard(ctx.tp_group, ctx.tp_rank, ctx.tp, model_cfg, parallel.sequence_parallel)
                  if ctx.tp > 1 else None)
            box[0] = profile_meta_layer_times(model, train.micro_batch, model_cfg.seq_len, ctx.device,
                                              autocast=autocast, tp=tp)
        elif not is_meta(model) and dist.get_rank() == 0:
            box[0] = profile_layer_times(copy.deepcopy(model), train.micro_batch, model_cfg.seq_len, ctx.device,
                                         autocast=autocast)
        dist.broadcast_object_list(box, src=0)
        measured = box[0]
    return plan_stages(model_cfg, parallel, train, ctx.dp, measured, device=ctx.device)


def strip_model(model: nn.Module, layers: list[int], embedding: bool, head: bool) -> nn.Module:
    """Drop, in place, the blocks not in `layers`, and the embedding / final norm + head if not owned."""
    keep = {str(i) for i in layers}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if not embedding:
        model.tok_embeddings = None
    if not head:
        model.norm = None
        model.output = None
    return model


def chunk_view(module: nn.Module, layers: list[int], embedding: bool, head: bool) -> nn.Module:
    """A module sharing `module`'s submodules but running only `layers` (a virtual stage). Its
    registries (submodules, hooks, composable-API state) are its own, so that hooks and an FSDP
    root put on one chunk stay off the others; a parameter directly on `module` would be shared
    by every chunk, and no family has one."""
    assert next(module.parameters(recurse=False), None) is None, "parameters belong to submodules"
    view = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, (dict, set)):
            vars(view)[key] = copy.copy(value)  # own registry, shared entries
    view.layers = nn.ModuleDict({str(i): module.layers[str(i)] for i in layers})
    return strip_model(view, layers, embedding, head)


def build_pipeline(model: nn.Module, ctx: ParallelContext, model_cfg: ModelConfig, parallel: ParallelConfig,
                   train: TrainConfig, parallelize_stage: Callable[[nn.Module, ParallelContext], ParallelModel]
                   ) -> PipelineParallelModel:
    """Keep this pp rank's part of `model`, apply `parallelize_stage` (tp, ...) to it, wire the schedule."""
    plan = make_plan(model, ctx, model_cfg, parallel, train)
    n_stages = len(plan.stages)
    chunk_ids = plan.rank_chunks(ctx.pp_rank)
    own = sorted(i for c in chunk_ids for i in plan.stages[c].layers)
    module = strip_model(model, own, 0 in chunk_ids, n_stages - 1 in chunk_ids)
    inner = parallelize_stage(module, ctx)
    # the pipeline copies the stage's fields; an engine with its own methods would lose them
    assert type(inner) is ParallelModel, f"{type(inner).__name__} cannot be pipelined"
    module = inner.module
    if len(chunk_ids) == 1:
        chunks = [module]
    else:
        chunks = [chunk_view(module, plan.stages[c].layers, c == 0, c == n_stages - 1) for c in chunk_ids]
    inner = apply_zero(inner, parallel, train, chunks=chunks)
    for chunk in chunks:
        dense_stage_io(chunk)
    base = {f.name: getattr(inner, f.name) for f in dataclasses.fields(ParallelModel)}
    return PipelineParallelModel(**base, plan=plan, chunks=chunks, chunk_ids=chunk_ids,
                                 schedule_name=parallel.pp_schedule, microbatches=parallel.microbatches)
