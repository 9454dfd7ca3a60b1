"""Parallelism applied to single-device models from outside, in a fixed order:
pipeline split -> tensor parallel -> activation checkpointing -> compile -> ZeRO.

The Trainer talks to parallelism only through a `ParallelModel`: the (possibly sharded) module,
how its parameters map to logical (unsharded) tensors for checkpoints, how gradients are
reduced and clipped, and the loss function matching how the logits are laid out.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from megatron_taper.config import Config
from megatron_taper.models.layers import cross_entropy
from megatron_taper.parallel.context import ParallelContext


@dataclass
class ParallelModel:
    module: nn.Module
    ctx: ParallelContext
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
    # name -> function turning this rank's local tensor into the logical one, and back
    to_full: dict[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    to_local: dict[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    # name -> number of tp ranks holding an identical copy (gradient-norm weight 1 / replicas);
    # names not listed are replicated over the whole tp group
    replicas: dict[str, int] = field(default_factory=dict)
    # run in reduce_gradients before the dp average: tp-level sums of partial gradients
    # (parameters looked up by name at call time, so later wrappers may replace them)
    tp_grad_syncs: list[Callable[[nn.Module], None]] = field(default_factory=list)
    # set by ZeRO (parallel/zero.py): parameters, gradients and optimizer state are DTensors
    # sharded over the dp group; `dp_shard` turns a tp-local tensor into this rank's dp shard
    dp_sharded: bool = False
    dp_shard: Callable[[torch.Tensor], torch.Tensor] | None = None

    def full_tensor(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The logical tensor of parameter `name` (or of a state tensor shaped like it). For a
        tensor-parallel shard this is a collective: every rank of the tp group must call it; for
        a ZeRO shard also every rank of the dp group."""
        if isinstance(local, DTensor):
            local = local.full_tensor()
        fn = self.to_full.get(name)
        return local if fn is None else fn(local)

    def local_tensor(self, name: str, full: torch.Tensor) -> torch.Tensor:
        fn = self.to_local.get(name)
        local = full if fn is None else fn(full)
        return local if self.dp_shard is None else self.dp_shard(local)

    # -- optimizer (engines that own their optimizer, e.g. DeepSpeed, override these) -------------

    def build_optimizer(self, cfg: Config) -> torch.optim.Optimizer:
        from megatron_taper.optim import build_optimizer

        return build_optimizer(self.module, cfg, self.ctx.device)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, max_norm: float,
                       loss_finite: bool = True) -> tuple[torch.Tensor, bool]:
        """Reduce and clip gradients, then step unless the loss or the gradient norm is
        non-finite; gradients are cleared either way. Returns (global grad norm, stepped)."""
        self.reduce_gradients()
        norm = self.clip_gradients(max_norm)
        stepped = loss_finite and math.isfinite(float(norm))
        if stepped:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm, stepped

    # -- checkpoints (checkpoint.py) ---------------------------------------------------------------

    @property
    def gathers_on_every_dp_rank(self) -> bool:
        """Whether logical_state is a collective over the dp group (ZeRO shards) or is called by
        dp rank 0 alone (replicas)."""
        return self.dp_sharded

    def logical_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """(parameters, optimizer state) as logical CPU tensors keyed by parameter name."""
        model_state, optim_state = {}, {}
        for name, param in self.module.named_parameters():
            model_state[name] = self.full_tensor(name, param.detach()).cpu()
            state = optimizer.state.get(param, {})
            optim_state[name] = {k: (self.full_tensor(name, v) if v.dim() else v).detach().cpu()
                                 for k, v in state.items()}
        return model_state, optim_state

    def load_logical_state(self, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict,
                           missing: Callable[[str], Exception]) -> None:
        """Inverse of logical_state: this rank's slices of the logical tensors into the model."""
        with torch.no_grad():
            for name, param in self.module.named_parameters():
                if name not in model_state:
                    raise missing(name)
                param.copy_(self.local_tensor(name, model_state[name]).to(param.dtype))
        by_name = dict(self.module.named_parameters())
        for name, state in optim_state.items():
            if name in by_name:
                p = by_name[name]
                optimizer.state[p] = {k: (self.local_tensor(name, v) if v.dim() else v).to(p.device)
                                      for k, v in state.items()}

    def forward_backward(self, micro_batches: list[torch.Tensor], autocast: Callable) -> torch.Tensor:
        """Forward and backward over one rank's micro-batches ([b, S + 1] tokens each) of one step.

        Returns the mean loss over the micro-batches (detached, float32 scalar on the device);
        gradients are accumulated as for that mean. Pipeline-parallel models override this.
        """
        total = torch.zeros((), device=self.ctx.device)
        for tokens in micro_batches:
            tokens = tokens.to(self.ctx.device, non_blocking=True)
            with autocast():
                loss = self.loss_fn(self.module(tokens[:, :-1]), tokens[:, 1:])
            (loss / len(micro_batches)).backward()
            total += loss.detach().float()
        return total / len(micro_batches)

    @torch.no_grad()
    def evaluate(self, tokens: torch.Tensor, autocast: Callable) -> torch.Tensor:
        """Mean loss of one micro-batch without gradients (float32 scalar, same on every rank)."""
        tokens = tokens.to(self.ctx.device, non_blocking=True)
        with autocast():
            return self.loss_fn(self.module(tokens[:, :-1]), tokens[:, 1:]).float()

    def reduce_gradients(self) -> None:
        """Complete partial tp gradients, then average over data-parallel replicas (plain DP;
        ZeRO engines do their own)."""
        for sync in self.tp_grad_syncs:
            sync(self.module)
        if self.ctx.dp == 1 or self.dp_sharded:  # ZeRO reduce-scattered them in backward
            return
        group = self.ctx.dp_group
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=group)

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Global L2 gradient norm over all parameters of the model (all ranks), clipped to max_norm.

        Every logical value counts once: a tp shard with weight 1, a tensor held by k tp ranks with
        1/k (summed over the tp group), disjoint pipeline stages summed over the pp group.
        """
        grads, by_replicas = [], {}
        for name, p in self.module.named_parameters():
            if p.grad is not None:
                grad = _local(p.grad)  # a ZeRO shard: its part of the norm, summed over dp below
                grads.append(grad)
                by_replicas.setdefault(self.replicas.get(name, self.ctx.tp), []).append(grad)
        device = grads[0].device if grads else self.ctx.device
        sq = torch.zeros((), device=device, dtype=torch.float32)
        for k, gs in by_replicas.items():
            sq += torch.nn.utils.get_total_norm(gs, foreach=True).float().square() / k
        if self.ctx.tp > 1:
            dist.all_reduce(sq, group=self.ctx.tp_group)
        if self.ctx.pp > 1:
            dist.all_reduce(sq, group=self.ctx.pp_group)
        if self.dp_sharded and self.ctx.dp > 1:
            dist.all_reduce(sq, group=self.ctx.dp_group)
        norm = sq.sqrt()
        if grads and max_norm > 0 and math.isfinite(max_norm):
            # (torch.nn.utils.clip_grads_with_norm_ takes parameters, not gradients: scale here)
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        return norm


def parallelize(model: nn.Module, ctx: ParallelContext, cfg: Config, *, whole_model: bool = True) -> ParallelModel:
    """Apply the configured parallelism to an initialised single-device model.

    With pp > 1 the model is first cut to this rank's pipeline stage (pipeline.py), which then
    calls back here with `whole_model=False` for the rest of the chain on that stage."""
    if ctx.pp > 1 and whole_model:
        from megatron_taper.parallel.pipeline import build_pipeline

        return build_pipeline(model, ctx, cfg, functools.partial(parallelize, whole_model=False))
    model = model.to(ctx.device)
    pm = ParallelModel(model, ctx) if ctx.tp == 1 else _tensor_parallel(model, ctx, cfg)
    if cfg.parallel.zero == "none":
        return pm
    from megatron_taper.parallel.zero import apply_zero

    return apply_zero(pm, cfg, pipelined=not whole_model)


def _tensor_parallel(model: nn.Module, ctx: ParallelContext, cfg: Config) -> ParallelModel:
    """Shard `model` over the tp group; checkpoints see logical tensors through to_full/to_local
    (to_full is a collective over the tp group: every tp rank must call it)."""
    from megatron_taper.parallel.tensor import vocab_parallel_cross_entropy
    from megatron_taper.parallel.tp_plan import apply_tp

    group, rank = ctx.tp_group, ctx.tp_rank
    plan = apply_tp(model, group, rank, ctx.tp, cfg)
    pm = ParallelModel(model, ctx, loss_fn=functools.partial(
        vocab_parallel_cross_entropy, group=group, vocab_start=plan.vocab_start))
    for name, spec in plan.specs.items():
        pm.to_full[name] = functools.partial(spec.gather, group=group)
        pm.to_local[name] = functools.partial(spec.local, rank=rank)
        pm.replicas[name] = spec.replicas(rank)
        if any(spec.replicas(r) > 1 for r in range(ctx.tp)):
            pm.tp_grad_syncs.append(functools.partial(_sum_replica_grads, name, spec, group))
    if plan.seq_local:
        pm.tp_grad_syncs.append(functools.partial(_sum_grads, plan.seq_local, group))
    return pm


def _sum_replica_grads(name: str, spec, group, module: nn.Module) -> None:
    """Sum the gradient of a tensor held by several tp ranks (e.g. a shared kv head) over them."""
    param = module.get_parameter(name)
    if param.grad is not None:
        assert not isinstance(param.grad, DTensor), "replica sums of ZeRO shards are refused in zero.py"
        spec.sum_replicas_(param.grad, group)


def _sum_grads(names: list[str], group, module: nn.Module) -> None:
    """Sum gradients of replicated parameters that each rank computed on its sequence chunk."""
    # elementwise over identical replicas, so a ZeRO shard (same rows on every tp rank) works too
    grads = [_local(g) for g in (module.get_parameter(n).grad for n in names) if g is not None]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        for g, summed in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(summed.view_as(g))


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ZeRO (DTensor) tensor; a plain tensor unchanged."""
    return t.to_local() if isinstance(t, DTensor) else t
