"""Expert parallelism (parallel.ep): each MoE layer's N experts split over the ep ranks of the dp
group (parallel/context.py: ep consecutive dp ranks, rank e holding experts e*N/ep .. (e+1)*N/ep - 1),
and copied over the dp / ep groups of them (cost/preflight.py check_moe_layout says which layouts).
Everything else stays data-parallel as the engine makes it (DDP averages it, fsdp2 shards it over dp).

Per MoE layer and micro-batch (models/moe.py hands its expert-sorted rows to `dispatch`):

    counts [N]        assignments of this rank's tokens per expert
    all-to-all        counts -> received [ep, N/ep]: rows each rank sends to each of my experts
    (host read)       the row counts per peer, for the uneven all-to-all's splits
    all-to-all        rows [A, D] -> rows for my experts, by sending rank then expert [A', D]
    permute           -> expert-major, my experts on their contiguous rows; GroupedExperts
    permute back, all-to-all back (the reverse splits) -> [A, D] in this rank's original order

Both row exchanges are autograd functions whose backward is the reverse exchange, so an expert's
gradient sums the contributions of the ep group's tokens. Gradients of the experts (excluded from
DDP; under fsdp2 excluded from the dp shards) then become those of the mean of the dp ranks'
losses, as DDP's average gives the replicated weights (`_reduce_expert_grads`):
    ep = dp                    scaled by 1 / dp
    ep < dp, zero=none         summed over the dp / ep copies (all-reduce), scaled by 1 / dp
    ep < dp, zero=fsdp2        the experts are fsdp2-sharded over the dp / ep copies (dp/fsdp2.py),
                               whose reduce-scatter averages them; scaled by 1 / ep
Under tp the experts are replicated over the tp ranks (each runs the MoE on the same tokens; the
ep group is the dp group of its tp rank); under pp each stage's MoE layers use the stage's dp
group. The gradient norm sums the experts' squares over the ranks holding distinct pieces.
Checkpoints hold the logical [N, ...] tensors: each rank writes and reads its rows
(ParallelModel.ep_specs), so a checkpoint resumes at any ep.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from megatron_taper.models.moe import GroupedExperts, moe_modules
from megatron_taper.parallel.context import ParallelContext
from megatron_taper.parallel.dp.ddp import all_reduce_flat_
from megatron_taper.parallel.model import ParallelModel, local_part
from megatron_taper.parallel.tp.layers import ShardSpec

EXPERT_WEIGHTS = ("w1", "w2", "w3")  # GroupedExperts' parameters, [N, ...] each


class _AllToAll(torch.autograd.Function):
    """Rows [sum(in_splits), ...] -> [sum(out_splits), ...]: in_splits[j] rows go to rank j,
    out_splits[i] rows arrive from rank i; backward sends the gradients back the same way. Adds
    the bytes this rank sends to other ranks, both ways, to `dispatch.sent_bytes`."""

    @staticmethod
    def forward(ctx, rows, out_splits, in_splits, dispatch):
        ctx.splits, ctx.dispatch = (in_splits, out_splits), dispatch
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=dispatch.group)
        dispatch.count(rows, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(out_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), out_splits, in_splits, group=ctx.dispatch.group)
        ctx.dispatch.count(grad, in_splits)
        return back, None, None, None


class ExpertDispatch:
    """The exchange of one MoE layer's rows with the ranks holding their experts (module doc)."""

    def __init__(self, group: dist.ProcessGroup, ep: int, n_experts: int):
        self.group, self.ep, self.local = group, ep, n_experts // ep
        self.rank = dist.get_rank(group)
        self.sent_bytes = 0  # rows' bytes sent to other ranks so far, forward and backward (a statistic)

    def count(self, rows: torch.Tensor, splits: list[int]) -> None:
        self.sent_bytes += (sum(splits) - splits[self.rank]) * rows[:1].numel() * rows.element_size()

    def __call__(self, experts: GroupedExperts, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [A, D] sorted by global expert, counts [N] -> the experts' outputs [A, D], same order."""
        if torch.is_autocast_enabled(rows.device.type):  # sent in the compute dtype the experts run in
            rows = rows.to(torch.get_autocast_dtype(rows.device.type))
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # [ep * N/ep]: from rank i, for my experts
        per_peer = torch.stack((counts.view(self.ep, self.local).sum(1), received.view(self.ep, self.local).sum(1)))
        send, recv = per_peer.tolist()  # (a host read: the splits of the uneven all-to-all)
        mine = _AllToAll.apply(rows, recv, send, self)  # by sending rank, then my expert
        # the block (rank i, expert e) of each row, and the expert-major order of the blocks
        block = torch.repeat_interleave(torch.arange(received.numel(), device=rows.device), received)
        expert_major = (block % self.local) * self.ep + block // self.local
        order = expert_major.argsort(stable=True)
        out = experts(mine[order], received.view(self.ep, self.local).sum(0))
        out = out[order.argsort()]  # back to the order the rows arrived in
        return _AllToAll.apply(out, send, recv, self)


def apply_expert_parallel(pm: ParallelModel, ep: int, zero: str) -> None:
    """Keep this rank's experts of every MoE layer of `pm.module` (meta or real), hand each layer its
    dispatch, and record the layouts for checkpoints, gradients and the gradient norm. `zero`: the
    engine applied afterwards (fsdp2 shards the experts over their dp / ep copies: dp/fsdp2.py)."""
    ctx = pm.ctx
    assert ctx.ep == ep, "init_parallel builds the ep groups of parallel.ep"
    group, rank = ctx.ep_group, ctx.ep_rank
    names = []
    for prefix, moe in moe_modules(pm.module):
        moe.dispatch = ExpertDispatch(group, ep, moe.n_experts)
        local = moe.n_experts // ep
        spec = ShardSpec.split(0, [local] * ep)
        for weight in EXPERT_WEIGHTS:
            full = getattr(moe.experts, weight)
            with torch.no_grad():
                kept = full.narrow(0, rank * local, local).clone() if not full.is_meta else \
                    torch.empty((local, *full.shape[1:]), device="meta", dtype=full.dtype)
            setattr(moe.experts, weight, nn.Parameter(kept))
            name = f"{prefix}.experts.{weight}"
            pm.ep_specs[name] = spec
            pm.to_local[name] = functools.partial(spec.local, rank=rank)
            pm.to_full[name] = functools.partial(_gather_rows, group=group)
            names.append(name)
    sharded = zero == "fsdp2" and ctx.ep_replicate_mesh is not None
    pm.tp_grad_syncs.append(functools.partial(_reduce_expert_grads, names, ctx, sharded))


def _gather_rows(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The logical tensor from every ep rank's rows (a collective over the ep group)."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts)


def _reduce_expert_grads(names: list[str], ctx: ParallelContext, sharded: bool, module: nn.Module) -> None:
    """The experts' gradients (sums over the ep group's tokens) -> those of the dp ranks' mean loss
    (module doc)."""
    grads = [local_part(g) for g in (module.get_parameter(n).grad for n in names) if g is not None]
    if not grads:
        return
    if sharded:  # fsdp2 averaged them over the dp / ep copies
        torch._foreach_mul_(grads, 1.0 / ctx.ep)
        return
    if ctx.ep_replicate_mesh is not None:
        all_reduce_flat_(grads, ctx.ep_replicate_mesh.get_group())
    torch._foreach_mul_(grads, 1.0 / ctx.dp)
