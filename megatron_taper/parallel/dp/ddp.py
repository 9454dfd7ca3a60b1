"""Data parallelism without ZeRO (parallel.zero=none, dp > 1): torch DistributedDataParallel.

Every dp rank holds the whole (tp-local, stage-local) model; gradients are averaged over the dp
group of the (pp, dp, tp) mesh by DDP's reducer: parameters are grouped into buckets of
`bucket_mb(parallel.ddp_bucket_mb, ...)` (in reverse registration order, re-ordered after the first step by the
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

from collections.abc import Collection

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from megatron_taper.cost.step_time import ddp_bucket_elements
from megatron_taper.parallel.context import ParallelContext


def bucket_mb(configured: float, module: nn.Module, dp: int) -> float:
    """The gradient bucket size in MiB for `module` (cost/step_time.ddp_bucket_elements: the rule
    the step-time model counts DDP's all-reduces with); gradients are fp32 (docs/precision.md)."""
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return ddp_bucket_elements(configured, trainable, dp) * 4 / 2**20


def average_gradients(module: nn.Module, group: dist.ProcessGroup, bucket_bytes: float,
                      ignore: Collection[str] = ()) -> None:
    """Average the gradients of `module` over `group` in place: one all-reduce per flat bucket of
    at most `bucket_bytes` (gradients of one dtype, in registration order, the same on every rank
    of the group, which holds the same stage); the parameters named in `ignore` (expert-parallel
    ones, parallel/ep.py) are left alone."""
    world = dist.get_world_size(group)
    buckets: list[list[torch.Tensor]] = []
    size, dtype = 0.0, None
    for name, p in module.named_parameters():
        if p.grad is None or name in ignore:
            continue
        nbytes = p.grad.numel() * p.grad.element_size()
        if not buckets or p.grad.dtype != dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size, dtype = 0.0, p.grad.dtype
        buckets[-1].append(p.grad)
        size += nbytes
    for grads in buckets:
        all_reduce_flat_(grads, group)
        torch._foreach_div_(grads, world)


def all_reduce_flat_(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Sum `tensors` over `group` in place: one all-reduce of their flat concatenation."""
    flat = torch.cat([t.reshape(-1) for t in tensors])  # [sum of numels]
    dist.all_reduce(flat, group=group)
    for t, summed in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(summed.view_as(t))


def wrap_ddp(module: nn.Module, ctx: ParallelContext, configured_mb: float,
             ignore: list[str] | None = None) -> DistributedDataParallel:
    """`module` (this rank's materialised part) behind DDP over the dp group (flattened with cp
    when parallel.cp > 1: ParallelContext.grad_group), buckets of bucket_mb(configured_mb, module,
    dp x cp); the parameters named in `ignore` (expert-parallel ones, parallel/ep.py) are left alone."""
    on_gpu = ctx.device.type == "cuda"
    if ignore:
        module._ddp_params_and_buffers_to_ignore = list(ignore)  # the attribute DDP's constructor reads
    return DistributedDataParallel(
        module,
        device_ids=[ctx.device.index] if on_gpu else None,
        output_device=ctx.device.index if on_gpu else None,
        process_group=ctx.grad_group,
        bucket_cap_mb=bucket_mb(configured_mb, module, ctx.dp * ctx.cp),
        init_sync=False,
        gradient_as_bucket_view=True,
    )
