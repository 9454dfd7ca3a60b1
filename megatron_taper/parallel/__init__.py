"""Parallelism applied to single-device models from outside, in a fixed order:
pipeline split -> tensor parallel -> activation checkpointing -> compile -> ZeRO.

The Trainer talks to parallelism only through a `ParallelModel`: the (possibly sharded) module,
how its parameters map to logical (unsharded) tensors for checkpoints, how gradients are
reduced and clipped, and the loss function matching how the logits are laid out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

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

    def full_tensor(self, name: str, local: torch.Tensor) -> torch.Tensor:
        fn = self.to_full.get(name)
        return local if fn is None else fn(local)

    def local_tensor(self, name: str, full: torch.Tensor) -> torch.Tensor:
        fn = self.to_local.get(name)
        return full if fn is None else fn(full)

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
        """Average gradients over data-parallel replicas (plain DP; ZeRO engines do their own)."""
        if self.ctx.dp == 1:
            return
        group = self.ctx.dp_group
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=group)

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm over all parameters of the model (all ranks), clipped to max_norm."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True) if grads else torch.zeros(())
        if max_norm > 0 and math.isfinite(max_norm):
            torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm, foreach=True)
        return norm


def parallelize(model: nn.Module, ctx: ParallelContext, cfg: Config) -> ParallelModel:
    """Apply the configured parallelism to an initialised single-device model."""
    return ParallelModel(model.to(ctx.device), ctx)
