"""ZeRO-3 over the data-parallel dimension: `parallel.zero` = fsdp2 | deepspeed (| none).

Applied last, after the pipeline split and tensor parallelism (parallelize() calls `apply_zero`
on the ParallelModel of this rank's stage). Both engines shard parameters, gradients and AdamW
state over the dp group of the (pp, dp, tp) mesh; each tp rank shards its own tp-local tensors
(our TP is Megatron-style: plain local tensors, uneven shards), so the dp shards of different
tp ranks are independent and every dp group only ever sees same-shaped tensors.

fsdp2 (`torch.distributed.fsdp.fully_shard`)
    One FSDP unit per block, plus the stage's root module (embedding, final norm, head).
    Parameters become DTensors sharded (dim 0) over the dp sub-mesh; gradients are
    reduce-scattered in backward in fp32 (`reduce_dtype`), so the ParallelModel only completes tp
    sums, takes the global norm over dp shards and clips. With train.precision=bf16 the blocks
    compute in bf16 from fp32 master shards (MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)); AdamW updates the fp32 shards.
    reshard_after_forward: without pipelining, True for blocks (ZeRO-3: a block's full weights
    exist only while it runs; all-gathered again for its backward) and False for the root (its
    backward follows at once). Under pipelining, False everywhere: 1F1B interleaves the forward
    and backward of many micro-batches, and resharding would all-gather every block twice per
    micro-batch; instead a stage's weights stay gathered from its first forward until the
    schedule's last backward, which reshards them and reduce-scatters the gradients once per step
    (torch.distributed.pipelining drives FSDP's no-sync / post-backward on the stage's root
    module). Memory of a stage is then ZeRO-1-like during the step and fully sharded between
    steps. The interleaved schedule (several chunks per rank sharing one root) is refused.
    With dp = 1 there is nothing to shard and the model is left as is.

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
               pipelined: bool = False) -> ParallelModel:
    """Shard `pm` over the dp group with the engine named by parallel.zero (preflight.py has
    refused the layouts an engine cannot run)."""
    engine = parallel.zero
    if engine == "none":
        return pm
    assert all(k == 1 for k in pm.replicas.values()), "preflight refuses ZeRO with tp > kv heads"
    if engine == "fsdp2":
        return _fsdp2(pm, uses_bf16(train.precision, pm.ctx.device), pipelined)
    assert engine == "deepspeed" and not pipelined, engine
    from megatron_taper.parallel.zero_deepspeed import DeepSpeedParallelModel  # imports deepspeed

    return DeepSpeedParallelModel.wrap(pm, parallel.deepspeed)


def _fsdp2(pm: ParallelModel, bf16: bool, pipelined: bool) -> ParallelModel:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    ctx = pm.ctx
    if ctx.dp == 1:
        return pm
    mesh = ctx.mesh["dp"]
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    module = pm.module
    for block in _blocks(module):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=not pipelined)
    fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    pm.dp_sharded = True
    pm.dp_shard = functools.partial(_dp_shard, mesh=mesh, device=ctx.device)
    return pm


def _blocks(module: nn.Module) -> list[nn.Module]:
    layers = getattr(module, "layers", None)
    assert isinstance(layers, nn.ModuleDict), "every model family keeps its blocks in .layers"
    return list(layers.values())


def _dp_shard(local: torch.Tensor, mesh, device: torch.device) -> torch.Tensor:
    """This rank's FSDP2 shard (dim 0, torch.chunk sizes) of a tp-local tensor, without comms."""
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(local.to(device), mesh, [Shard(0)], src_data_rank=None)
