"""ZeRO-3 over the data-parallel dimension: `parallel.zero` = fsdp2 | deepspeed (| none).

Applied last, after the pipeline split and tensor parallelism (parallelize() calls `apply_zero`
on the ParallelModel of this rank's stage). Both engines shard parameters, gradients and AdamW
state over the dp group of the (pp, dp, tp) mesh; each tp rank shards its own tp-local tensors
(our TP is Megatron-style: plain local tensors, uneven shards), so the dp shards of different
tp ranks are independent and every dp group only ever sees same-shaped tensors.

fsdp2 (`torch.distributed.fsdp.fully_shard`)
    One FSDP unit per block, plus the stage's root module (embedding, final norm, head); under
    schedules with several chunks per pp rank (interleaved, zero-bubble) one root per chunk
    (pipeline.py's chunk views: the chunk's blocks, and the embedding / norm and head when it holds
    them), as torchtitan shards each model part.
    Parameters become DTensors sharded (dim 0) over the dp sub-mesh; gradients are
    reduce-scattered in backward in fp32 (`reduce_dtype`), so the ParallelModel only completes tp
    sums, takes the global norm over dp shards and clips. Precision (docs/precision.md, one policy
    at every layout): parameters, gradients and AdamW state stay fp32 shards; the forward runs
    under bf16 autocast as everywhere else. Each block (and the root) is two FSDP units: its
    matmul-only layers (`matmul_only_layers`) are gathered in bf16 (MixedPrecisionPolicy
    param_dtype=bf16: the same rounding autocast applies to them at dp = 1, at half the
    all-gather bytes), the rest (norms, embeddings, gates) in fp32, so norms, embeddings and the
    residual stream compute in fp32 at any dp. Gradients are reduce-scattered in fp32.
    reshard_after_forward: without pipelining, True for blocks (ZeRO-3: a block's full weights
    exist only while it runs; all-gathered again for its backward) and False for the root (its
    backward follows at once). Under pipelining, False everywhere: 1F1B interleaves the forward
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

deepspeed (DeepSpeed ZeRO stage 3, see `DeepSpeedParallelModel` in zero_deepspeed.py)

Checkpoints (checkpoint.py) stay in the logical, layout-free format: full tensors keyed by
parameter name, gathered shard by shard (`ParallelModel.full_tensor`: DTensor.full_tensor over dp,
then the tp gather). DCP cannot describe our tp layout (uneven Megatron shards held as plain
tensors, not DTensors), and the logical format already resumes on any (pp, dp, tp) and engine.
The cost is that dp/tp rank 0 of each stage holds that stage's full state in CPU memory while
writing; for models beyond a few billion parameters per stage a DCP writer would be needed.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from megatron_taper.parallel.context import uses_bf16
from megatron_taper.parallel.model import ParallelModel

if TYPE_CHECKING:
    from megatron_taper.config import ParallelConfig, TrainConfig


def apply_zero(pm: ParallelModel, parallel: ParallelConfig, train: TrainConfig,
               chunks: list[nn.Module] | None = None) -> ParallelModel:
    """Shard `pm` over the dp group with the engine named by parallel.zero (preflight.py has
    refused the layouts an engine cannot run). `chunks`: a pipeline stage's chunks (views of
    `pm.module` sharing its blocks; pipeline.py), each made its own FSDP root."""
    engine = parallel.zero
    if engine == "none":
        return pm
    assert all(k == 1 for k in pm.replicas.values()), "preflight refuses ZeRO with tp > kv heads"
    if engine == "fsdp2":
        return _fsdp2(pm, uses_bf16(train.precision, pm.ctx.device), chunks)
    assert engine == "deepspeed" and chunks is None, engine
    from megatron_taper.parallel.zero_deepspeed import DeepSpeedParallelModel  # imports deepspeed

    return DeepSpeedParallelModel.wrap(pm, parallel.deepspeed)


def _fsdp2(pm: ParallelModel, bf16: bool, chunks: list[nn.Module] | None) -> ParallelModel:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    ctx = pm.ctx
    if ctx.dp == 1:
        return pm  # nothing to shard; the numerics are those of dp > 1 (docs/precision.md)
    mesh = ctx.mesh["dp"]
    fp32 = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    matmul = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    module = pm.module
    for block in _blocks(module):
        _shard_unit(block, mesh, fp32, matmul, reshard=chunks is None)
    for root in chunks or [module]:
        _shard_unit(root, mesh, fp32, matmul, reshard=False)
    pm.dp_sharded = True
    pm.dp_shard = functools.partial(_dp_shard, mesh=mesh, device=ctx.device)
    return pm


def _shard_unit(unit: nn.Module, mesh, fp32, matmul, reshard: bool) -> None:
    """Two FSDP units: the unit's matmul-only layers (gathered in the matmul policy's dtype) inside
    the unit itself (everything else: norms, embeddings, gates, in fp32)."""
    from torch.distributed.fsdp import fully_shard

    linears = matmul_only_layers(unit)
    if linears and matmul.param_dtype is not None:
        fully_shard(linears, mesh=mesh, mp_policy=matmul, reshard_after_forward=reshard)
    fully_shard(unit, mesh=mesh, mp_policy=fp32, reshard_after_forward=reshard)


def matmul_only_layers(unit: nn.Module) -> list[nn.Module]:
    """The layers of `unit` (not yet in an FSDP unit) whose parameters feed only F.linear, the
    one op autocast casts them for: nn.Linear, ColumnParallelLinear, and RowParallelLinear without
    a bias (its bias is added after the reduction, outside the matmul). A parameter shared with
    any other module (a tied embedding) keeps them out."""
    from torch.distributed.fsdp import FSDPModule

    from megatron_taper.parallel.tensor import ColumnParallelLinear, RowParallelLinear

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
    """This rank's FSDP2 shard (dim 0, torch.chunk sizes) of a tp-local tensor, without comms."""
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(local.to(device), mesh, [Shard(0)], src_data_rank=None)
