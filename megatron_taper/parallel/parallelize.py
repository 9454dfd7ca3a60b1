"""parallelize(): apply the configured parallelism to a single-device model.

The model is either on the meta device (build.py: every step below only reshapes parameters and
records layouts, and parallel/meta_init.py materialises this rank's pieces afterwards) or
initialised and identical on every rank.

Order: pipeline split -> tensor parallel -> expert parallel (ep.py: each rank keeps its experts)
-> context parallel (cp/split.py: the sequence split handed to the attention, the loss share) ->
float8 linears (float8.py; the main rank prints how many the rule converts) -> per-block options
(activation checkpointing, compile: block_options.py; the main rank prints how many static graphs
the compile makes) -> ZeRO (dp/: fsdp2 | deepspeed). Plain data parallelism (DDP, dp/ddp.py) comes
after materialisation, in build.py. With pp > 1 the model is first cut to this rank's pipeline
stage (pp/schedule.py), which then calls back here with `whole_model=False` for the rest of the
chain on that stage. The layout was checked by cost/preflight.py before any process group existed.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from megatron_taper.config import ConfigError
from megatron_taper.cost.preflight import compiles, width_alignment_warning
from megatron_taper.models import family
from megatron_taper.parallel.block_options import apply_block_options
from megatron_taper.parallel.context import ParallelContext
from megatron_taper.parallel.cp.split import SequenceSplit, apply_context_parallel, split_loss
from megatron_taper.parallel.dp.ddp import all_reduce_flat_, bucket_mb
from megatron_taper.parallel.dp.fsdp2 import apply_zero
from megatron_taper.parallel.ep import apply_expert_parallel
from megatron_taper.parallel.float8 import apply_float8, float8_hardware
from megatron_taper.parallel.loss import loss_function
from megatron_taper.parallel.meta_init import is_meta
from megatron_taper.parallel.model import ParallelModel, local_part
from megatron_taper.parallel.pp.schedule import build_pipeline
from megatron_taper.parallel.tp.layers import ShardSpec, sum_replicas_
from megatron_taper.parallel.tp.plan import apply_tp
from megatron_taper.taper import layer_widths

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig, ParallelConfig, TrainConfig


def parallelize(model: nn.Module, ctx: ParallelContext, model_cfg: ModelConfig, parallel: ParallelConfig,
                train: TrainConfig, *, whole_model: bool = True) -> ParallelModel:
    """Apply `parallel`'s layout to `model` (on meta, or initialised and identical on every rank).
    `train` gives the batch shape the pipeline splits into micro-batches, and the precision and
    clipping ZeRO engines need."""
    if whole_model and train.device == "auto" and ctx.is_main:  # train.device=cuda: preflight warned already
        message = width_alignment_warning(model_cfg, layer_widths(model_cfg), ctx.device.type)
        if message:
            print(f"warning: {message}", flush=True)
    if ctx.pp > 1 and whole_model:
        stage = functools.partial(parallelize, model_cfg=model_cfg, parallel=parallel, train=train,
                                  whole_model=False)
        return build_pipeline(model, ctx, model_cfg, parallel, train, stage)
    if not is_meta(model):
        model = model.to(ctx.device)
    if ctx.tp == 1:
        pm = ParallelModel(model, ctx, loss_fn=loss_function(train.loss_chunk))
    else:
        pm = _tensor_parallel(model, ctx, model_cfg, parallel, train.loss_chunk)
    if parallel.ep > 1:
        apply_expert_parallel(pm, parallel.ep, parallel.zero)
    if ctx.cp > 1:
        split = SequenceSplit(ctx.cp, ctx.cp_rank, ctx.cp_group, attention=parallel.cp_attention,
                              balanced=family(model_cfg.arch).cp_balanced)
        apply_context_parallel(pm.module, split)
        pm.split = split
        pm.loss_fn = functools.partial(split_loss, inner=pm.loss_fn, split=split)
    compile_blocks = compiles(model_cfg, parallel, train, ctx.device.type)
    if train.float8:
        if float8_hardware(ctx.device) and not compile_blocks:
            raise ConfigError(f"train.float8=true on {ctx.device} needs the compiled blocks (train.compile="
                              f"{train.compile_setting} does not compile this layout; eager float8 ran 2.4x slower "
                              f"than bf16 on an H200): set train.compile=true or train.float8=false")
        linears = sum(type(m) is nn.Linear for m in pm.module.layers.modules())
        # float8 all-gathers only over NCCL: gloo has no float8 dtype ("Invalid scalar type")
        converted = apply_float8(pm.module, ctx.device, train, fsdp_all_gather=parallel.zero == "fsdp2"
                                 and ctx.dp > 1 and ctx.device.type == "cuda")
        if ctx.is_main:
            print(f"float8: {len(converted)} of the blocks' {linears} linears in float8 "
                  f"({train.float8_recipe}; in and out features >= train.float8_min_dim={train.float8_min_dim})",
                  flush=True)
    if train.cuda_graphs and ctx.device.type != "cuda":
        raise ConfigError(f"train.cuda_graphs=true needs a CUDA device (this rank runs on {ctx.device.type})")
    lengths = train.seq_len_lengths(model_cfg.seq_len)
    regions = apply_block_options(pm.module, train.activation_checkpointing, train.ac_every, compile_blocks,
                                  train.cuda_graphs, len(lengths))
    if compile_blocks and ctx.is_main:
        warmup = (f"; the sequence-length warmup compiles each {len(lengths)} times in training, once per window "
                  f"length {', '.join(map(str, lengths))}" if len(lengths) > 1 else "")
        print(f"compile: {regions} static graph(s) for the {len(pm.module.layers)} blocks of this rank, one per "
              f"distinct block shape (train.compile={train.compile_setting}; evaluation compiles each once more, "
              f"with grad off{warmup})", flush=True)
    pm.cuda_graphs = train.cuda_graphs and compile_blocks
    if not whole_model:
        return pm  # build_pipeline applies ZeRO once the stage's chunks exist (an FSDP root per chunk)
    return apply_zero(pm, parallel, train)


def _tensor_parallel(model: nn.Module, ctx: ParallelContext, model_cfg: ModelConfig,
                     parallel: ParallelConfig, loss_chunk: int) -> ParallelModel:
    """Shard `model` over the tp group; checkpoints see logical tensors through to_full/to_local
    (to_full is a collective over the tp group: every tp rank must call it)."""
    group, rank = ctx.tp_group, ctx.tp_rank
    plan = apply_tp(model, group, rank, ctx.tp, model_cfg, parallel.sequence_parallel)
    pm = ParallelModel(model, ctx, loss_fn=loss_function(loss_chunk, group, plan.vocab_start))
    shared = []  # tensors some of whose slices several tp ranks hold
    for name, spec in plan.specs.items():
        pm.to_full[name] = functools.partial(spec.gather, group=group)
        pm.to_local[name] = functools.partial(spec.local, rank=rank)
        pm.replicas[name] = spec.replicas(rank)
        pm.tp_specs[name] = spec
        if any(spec.replicas(r) > 1 for r in range(ctx.tp)):
            shared.append((name, spec))
    for bucket in _buckets(shared, model, bucket_mb(parallel.ddp_bucket_mb, model, ctx.dp) * 2**20):
        pm.tp_grad_syncs.append(functools.partial(_sum_replica_grads, bucket, group))
    if plan.seq_local:
        pm.tp_grad_syncs.append(functools.partial(_sum_grads, plan.seq_local, group))
    return pm


def _buckets(shared: list[tuple[str, ShardSpec]], model: nn.Module, cap_bytes: float
             ) -> list[list[tuple[str, ShardSpec]]]:
    """Consecutive groups of `shared` whose full-size buffers stay under `cap_bytes` (at least one each)."""
    out: list[list[tuple[str, ShardSpec]]] = []
    size = cap_bytes
    for name, spec in shared:
        param = model.get_parameter(name)
        nbytes = param.numel() // param.shape[spec.dim] * spec.full * param.element_size()  # same on every rank
        if size + nbytes > cap_bytes:
            out.append([])
            size = 0
        out[-1].append((name, spec))
        size += nbytes
    return out


def _sum_replica_grads(bucket: list[tuple[str, ShardSpec]], group: dist.ProcessGroup, module: nn.Module) -> None:
    """Sum the gradients of tensors held by several tp ranks (e.g. shared kv heads) over them:
    one all-reduce per bucket of data_parallel.bucket_mb."""
    items = []
    for name, spec in bucket:
        grad = module.get_parameter(name).grad
        if grad is not None:
            assert not isinstance(grad, DTensor), "replica sums of ZeRO shards are refused in cost/preflight.py"
            items.append((grad, spec))
    if items:
        sum_replicas_(items, group)


def _sum_grads(names: list[str], group: dist.ProcessGroup, module: nn.Module) -> None:
    """Sum gradients of replicated parameters that each rank computed on its sequence chunk."""
    # elementwise over identical replicas, so a ZeRO shard (same rows on every tp rank) works too
    grads = [local_part(g) for g in (module.get_parameter(n).grad for n in names) if g is not None]
    if grads:
        all_reduce_flat_(grads, group)
