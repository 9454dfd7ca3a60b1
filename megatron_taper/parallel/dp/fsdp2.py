"""ZeRO-3 over the data-parallel dimension: `parallel.zero` = fsdp2 | deepspeed (| none).

Applied last, after the pipeline split and tensor parallelism (parallelize() calls `apply_zero`
on the ParallelModel of this rank's stage). Both engines shard parameters, gradients and AdamW
state over the dp group of the (pp, dp, tp) mesh; each tp rank shards its own tp-local tensors
(our TP is Megatron-style: plain local tensors, uneven shards), so the dp shards of different
tp ranks are independent and every dp group only ever sees same-shaped tensors.

fsdp2 (`torch.distributed.fsdp.fully_shard`)
    FSDP units (each one all-gather per pass and one reduce-scatter: the fsdp2 "bucket"): the
    stage's blocks grouped consecutively by cost/memory.py `fsdp_units` (until a unit holds
    min(1M x dp_shard, 40M) elements: every rank's share of a collective at least 1M elements,
    what is gathered at once bounded; a larger block is a unit alone), plus the stage's root
    module (embedding, final norm, head); under schedules with several chunks per pp rank
    (interleaved, zero-bubble) the same per chunk, with one root per chunk (pipeline.py's chunk
    views: the chunk's blocks, and the embedding / norm and head when it holds them), as
    torchtitan shards each model part: units never span chunks. Forward prefetch depth 1: a piece's pre-forward issues
    the next unit's all-gathers (the root's: the first unit's); backward keeps FSDP2's own
    depth-1 prefetch. Parameters become DTensors sharded (dim 0) over `ctx.dp_mesh`: the dp
    sub-mesh, or under HSDP (parallel.dp_replicate > 1) the 2-D (dp_replicate, dp_shard) mesh,
    Replicate() x Shard(0), where FSDP2 reduce-scatters inside dp_shard and all-reduces the shard
    over dp_replicate. Gradients are reduced in backward in fp32 (`reduce_dtype`), so the
    ParallelModel only completes tp sums, takes the global norm over the dp_shard shards (each
    replica holds the same shard: counted once) and clips. Precision (docs/precision.md, one policy
    at every layout): parameters, gradients and AdamW state stay fp32 shards; the forward runs
    under bf16 autocast as everywhere else. Each unit (and the root) is two FSDP groups: its
    matmul-only layers (`matmul_only_layers`) are gathered in bf16 (MixedPrecisionPolicy
    param_dtype=bf16: the same rounding autocast applies to them at dp = 1, at half the
    all-gather bytes), the rest (norms, embeddings, gates) in fp32, so norms, embeddings and the
    residual stream compute in fp32 at any dp. Gradients are reduce-scattered in fp32.
    reshard_after_forward: without pipelining, True for the units of blocks (ZeRO-3: a unit's full
    weights exist only while it runs; all-gathered again for its backward) but the last one, and
    False for the root and the last unit (their backward follows at once, as in torchtitan).
    Under pipelining, False everywhere: 1F1B interleaves the forward
    and backward of many micro-batches, and resharding would all-gather every block twice per
    micro-batch; instead a chunk's weights stay gathered from its first forward until its last
    backward of the step. torch.distributed.pipelining drives each chunk root: every backward
    runs without gradient sync (unsharded fp32 gradients accumulate over the micro-batches);
    after the chunk's last backward (zero-bubble schedules: its last weight-gradient pass) the
    schedule's REDUCE_GRAD action reshards the chunk and reduce-scatters its gradients, once per
    FSDP unit per step, while the rank's other chunks still have backwards to run; the pipeline
    (pipeline.py `_reduce_scatter_chunk`) defers FSDP's wait for it to the step's end, so on
    CUDA it can overlap their backward (gloo collectives block the host anyway). With one chunk
    per rank (1f1b, gpipe) it runs after the last backward, with nothing left to overlap. Multi-
    chunk schedules keep at most 3 chunks of a rank gathered and reshard the others between uses.
    Memory of a stage is then ZeRO-1-like during the step and fully sharded between steps.
    With dp = 1 there is nothing to shard and the model is left as is (same numerics).
    Context parallelism (cp > 1): the shards are over the flattened dp x cp mesh (`ctx.dp_mesh`,
    parallel/context.py; as Megatron-core and torchtitan shard over dp_cp): a cp group's ranks
    hold the same parameters and compute partial gradients of the same sequences, which the
    reduce-scatter over dp x cp averages (the loss shares make that average the whole-sequence
    gradient), so fsdp2 runs at dp = 1 too.

    Expert parallelism (parallel.ep, parallel/ep.py): the experts of the MoE layers stay out of the
    dp shards (`_shard_experts`). With ep = dp each rank's experts are whole plain tensors that
    FSDP ignores; with ep < dp each MoE layer's experts are an FSDP unit of their own over the
    dp / ep ranks holding the same experts (torchtitan's layout), whose reduce-scatter averages
    their gradients over those copies.

deepspeed (DeepSpeed ZeRO stage 3, see `DeepSpeedParallelModel` in zero_deepspeed.py)

Checkpoints (checkpoint/checkpointer.py, format 2) hold boxes of the logical tensors: each rank
writes the pieces it owns (`ParallelModel.piece_box`: its tp slice and its dp_shard rows; under
HSDP only the first replica writes) without gathering, and a resume reads the boxes overlapping
its own pieces, so a checkpoint loads on any (pp, dp, tp), HSDP split and engine. DCP is not used:
it cannot describe our tp layout (uneven Megatron shards held as plain tensors, not DTensors).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from megatron_taper.cost.memory import fsdp_units
from megatron_taper.parallel.context import has_bf16
from megatron_taper.parallel.model import ParallelModel

if TYPE_CHECKING:
    from megatron_taper.config import ParallelConfig, TrainConfig


def apply_zero(pm: ParallelModel, parallel: ParallelConfig, train: TrainConfig,
               chunks: list[nn.Module] | None = None) -> ParallelModel:
    """Shard `pm` over the dp group with the engine named by parallel.zero (cost/preflight.py has
    refused the layouts an engine cannot run). `chunks`: a pipeline stage's chunks (views of
    `pm.module` sharing its blocks; pipeline.py), each made its own FSDP root."""
    engine = parallel.zero
    if engine == "none":
        return pm
    assert all(k == 1 for k in pm.replicas.values()), "preflight refuses ZeRO with tp > kv heads"
    if engine == "fsdp2":
        return _fsdp2(pm, train.uses_bf16(has_bf16(pm.ctx.device)), chunks)
    assert engine == "deepspeed" and chunks is None, engine
    from megatron_taper.parallel.dp.zero_deepspeed import DeepSpeedParallelModel  # imports deepspeed

    return DeepSpeedParallelModel.wrap(pm, parallel.deepspeed)


def _fsdp2(pm: ParallelModel, bf16: bool, chunks: list[nn.Module] | None) -> ParallelModel:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    ctx = pm.ctx
    if ctx.dp * ctx.cp == 1:
        return pm  # nothing to shard; the numerics are those of dp > 1 (docs/precision.md)
    mesh = ctx.dp_mesh  # HSDP: (dp_replicate, dp_shard), parameters Replicate() x Shard(0)
    fp32 = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    matmul = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    module = pm.module
    ignored = _shard_experts(pm, matmul, reshard=chunks is None)
    for root in chunks or [module]:
        blocks = _blocks(root)  # a chunk view's own blocks
        groups = fsdp_units([sum(p.numel() for p in block.parameters()) for block in blocks], ctx.dp_shard)
        units = [_shard_unit([blocks[i] for i in group], mesh, fp32, matmul, ignored,
                             reshard=chunks is None and k < len(groups) - 1) for k, group in enumerate(groups)]
        _prefetch_next([_shard_unit(root, mesh, fp32, matmul, ignored, reshard=False), *units])
    pm.dp_sharded = True
    pm.dp_shard = functools.partial(_dp_shard, mesh=mesh, device=ctx.device)
    return pm


def _shard_experts(pm: ParallelModel, matmul, reshard: bool) -> set[nn.Parameter] | None:
    """Expert parallelism (parallel/ep.py): the experts stay out of the dp shards. With ep < dp each
    MoE layer's experts are an FSDP unit of their own over the dp / ep ranks holding the same rows
    (`ctx.ep_replicate_mesh`; gathered like the matmul-only layers: the grouped GEMMs take them in
    the autocast dtype), their `to_local` then giving this rank's shard of its rows; with ep = dp
    they stay whole, plain tensors FSDP leaves alone. Returns the parameters the dp units must
    ignore (None: none)."""
    from torch.distributed.fsdp import fully_shard

    from megatron_taper.models.moe import moe_modules

    ctx = pm.ctx
    if not pm.ep_specs:
        return None
    experts = [moe.experts for _, moe in moe_modules(pm.module)]
    if ctx.ep_replicate_mesh is None:
        return {p for module in experts for p in module.parameters()}
    for module in experts:
        fully_shard(module, mesh=ctx.ep_replicate_mesh, mp_policy=matmul, reshard_after_forward=reshard)
    shard = functools.partial(_dp_shard, mesh=ctx.ep_replicate_mesh, device=ctx.device)
    for name in pm.ep_specs:
        rows = pm.to_local[name]
        pm.to_local[name] = lambda full, rows=rows: shard(rows(full))
    return None


def _shard_unit(unit: nn.Module | list[nn.Module], mesh, fp32, matmul, ignored: set[nn.Parameter] | None,
                reshard: bool) -> list[nn.Module]:
    """Two FSDP units: the matmul-only layers of `unit` (a module, or consecutive blocks sharded
    as one) gathered in the matmul policy's dtype, inside the unit itself (everything else: norms,
    embeddings, gates, in fp32). Returns one module of each FSDP unit made (the prefetch targets
    of `unit`)."""
    from torch.distributed.fsdp import fully_shard

    modules = unit if isinstance(unit, list) else [unit]
    made = []
    linears = [layer for m in modules for layer in matmul_only_layers(m)]
    if linears and matmul.param_dtype is not None:
        fully_shard(linears, mesh=mesh, mp_policy=matmul, reshard_after_forward=reshard, ignored_params=ignored)
        made.append(linears[0])
    fully_shard(unit, mesh=mesh, mp_policy=fp32, reshard_after_forward=reshard, ignored_params=ignored)
    return [modules[0], *made]


def _prefetch_next(units: list[list[nn.Module]]) -> None:
    """Forward prefetch of depth 1: when a piece (the root, then each block in order) starts its
    forward, the all-gathers of the next piece's units are issued, so they run while this piece
    computes (without it FSDP2 issues them when the next piece starts, which overlaps only as
    far as the host runs ahead of the device). Backward keeps FSDP2's own depth-1 prefetch (the
    piece before, in reverse forward order); recomputation under activation checkpointing
    prefetches nothing."""
    for piece, following in zip(units, units[1:]):
        piece[0].set_modules_to_forward_prefetch(following)


def matmul_only_layers(unit: nn.Module) -> list[nn.Module]:
    """The layers of `unit` (not yet in an FSDP unit) whose parameters feed only F.linear, the
    one op autocast casts them for: nn.Linear, ColumnParallelLinear, and RowParallelLinear without
    a bias (its bias is added after the reduction, outside the matmul). A parameter shared with
    any other module (a tied embedding) keeps them out."""
    from torch.distributed.fsdp import FSDPModule

    from megatron_taper.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear

    def matmul_only(m: nn.Module) -> bool:
        return (isinstance(m, (nn.Linear, ColumnParallelLinear))
                or (isinstance(m, RowParallelLinear) and m.bias is None))

    candidates, others = [], set()
    stack = [unit]
    while stack:
        m = stack.pop()
        if m is not unit and isinstance(m, FSDPModule):
            continue  # an inner unit (a block inside the root) keeps its own parameters
        if m is not unit and matmul_only(m):
            candidates.append(m)
        else:
            others.update(id(p) for p in m.parameters(recurse=False))
        stack.extend(m.children())
    return [m for m in candidates if not any(id(p) in others for p in m.parameters())]


def _blocks(module: nn.Module) -> list[nn.Module]:
    layers = getattr(module, "layers", None)
    assert isinstance(layers, nn.ModuleDict), "every model family keeps its blocks in .layers"
    return list(layers.values())


def _dp_shard(local: torch.Tensor, mesh, device: torch.device) -> torch.Tensor:
    """This rank's FSDP2 shard (dim 0, torch.chunk sizes over the last mesh dimension; replicated
    over an HSDP mesh's first) of a tp-local tensor, without comms."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return distribute_tensor(local.to(device), mesh, [Replicate()] * (mesh.ndim - 1) + [Shard(0)], src_data_rank=None)


def add_to_shards(param: torch.Tensor, update: torch.Tensor) -> None:
    """param += update in place, `update` the logical (tp-local) tensor: a DTensor parameter (ZeRO
    shards) takes its own shard of it, without comms."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        update = distribute_tensor(update, param.device_mesh, param.placements, src_data_rank=None)
    param.add_(update)
