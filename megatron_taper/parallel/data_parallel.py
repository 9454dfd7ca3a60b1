"""Data parallelism without ZeRO (parallel.zero=none, dp > 1): torch DistributedDataParallel.

Every dp rank holds the whole (tp-local, stage-local) model; gradients are averaged over the dp
group of the (pp, dp, tp) mesh by DDP's reducer: parameters are grouped into buckets of
`parallel.ddp_bucket_mb` (in reverse registration order, re-ordered after the first step by the
order gradients actually became ready) and each bucket's all-reduce is launched as soon as its
last gradient is accumulated, so communication overlaps the rest of the backward pass. Gradients
are views into the buckets (`gradient_as_bucket_view`), so no second copy of them exists.

Applied after the parameters are materialised (build.py), since DDP registers hooks on real
tensors; the ParallelModel keeps the unwrapped module for names and checkpoints and runs
forward through the wrapper. Gradient accumulation runs the non-final micro-batches under
`no_sync()` (one reduction per step); under pipelining torch.distributed.pipelining does the
same for each stage chunk wrapped here (its no-sync forward and backward for every micro-batch
but the last). The weights start identical on every rank (models/init.py's rule), so DDP's
initial broadcast is skipped (`init_sync=False`): at 70B it would send the whole model.
"""
from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from megatron_taper.parallel.context import ParallelContext


def wrap_ddp(module: nn.Module, ctx: ParallelContext, bucket_mb: float) -> DistributedDataParallel:
    """`module` (this rank's materialised part) behind DDP over the dp group."""
    on_gpu = ctx.device.type == "cuda"
    return DistributedDataParallel(
        module,
        device_ids=[ctx.device.index] if on_gpu else None,
        output_device=ctx.device.index if on_gpu else None,
        process_group=ctx.dp_group,
        bucket_cap_mb=bucket_mb,
        init_sync=False,
        gradient_as_bucket_view=True,
    )
