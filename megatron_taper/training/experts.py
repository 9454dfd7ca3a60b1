"""ExpertRouting: the Trainer's part for a mixture of experts (model.moe, models/moe.py): the
routing biases moved after every optimizer step (auxiliary-loss-free balancing), and every MoE
layer's load and routing losses for the step records at log intervals. Both sum the counts over
the ranks that saw other tokens (dp x cp), on the device; only the records are read on the host.
Under fsdp2 each rank moves its shard of the biases."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_taper.models.moe import balance_experts, load_metrics
from megatron_taper.parallel.dp.fsdp2 import add_to_shards

if TYPE_CHECKING:
    from torch import nn

    from megatron_taper.config import MoEConfig
    from megatron_taper.parallel.context import ParallelContext


class ExpertRouting:
    def __init__(self, moe: MoEConfig, ctx: ParallelContext, module: nn.Module):
        self.moe, self.ctx, self.module = moe, ctx, module

    def after_step(self, stepped: torch.Tensor) -> None:
        """After the optimizer step (`stepped`: whether it was taken): the routing biases follow
        this step's expert load."""
        if self.moe.bias_balance:
            balance_experts(self.module, self.moe.bias_rate, stepped, self._sum_over_dp, add_to_shards)

    def record(self) -> dict:
        """Every MoE layer's load and routing losses since the last record, over all dp ranks; under
        pp the stages' layers gathered on every rank (a collective of the whole job)."""
        metrics = load_metrics(self.module, self._sum_over_dp)
        if self.ctx.pp == 1:
            return metrics
        stages: list = [None] * self.ctx.pp
        dist.all_gather_object(stages, {k: float(v) for k, v in metrics.items()}, group=self.ctx.pp_group)
        return {k: v for stage in stages for k, v in stage.items()}

    def _sum_over_dp(self, tensor: torch.Tensor) -> None:
        """In place: the sum over the ranks that saw other tokens (dp x cp); nothing on one of them."""
        if self.ctx.dp * self.ctx.cp > 1:
            dist.all_reduce(tensor, group=self.ctx.grad_group)
