"""The held-out evaluation loop shared by the Trainer's periodic evaluation and post-training
evaluation (inference/evaluate.py).

`evaluate_source(pm, source, batches, autocast)`: `batches` micro-batches of this data-parallel
rank through `ParallelModel.evaluate` (which handles tp, pp and ZeRO), the mean loss averaged over
the dp group (`dp_mean`; every micro-batch has the same number of tokens, so this is the mean over
all tokens seen). `evaluate_held_out` runs it on a fresh source of each held-out set; `combined_loss`
weights the per-source losses by their mixture shares; `held_out_losses` is the Trainer's record of
both.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from megatron_taper.training.metrics import perplexity

if TYPE_CHECKING:
    from megatron_taper.data import BatchSource
    from megatron_taper.data.sources import HeldOut
    from megatron_taper.parallel.context import ParallelContext
    from megatron_taper.parallel.model import ParallelModel



@dataclass
class EvalResult:
    loss: float  # mean next-token loss (nats) over every token evaluated by all dp ranks
    tokens: int  # predicted tokens over all dp ranks
    batches: int  # micro-batches per dp rank

    @property
    def ppl(self) -> float:
        return perplexity(self.loss)


def evaluate_source(pm: ParallelModel, source: BatchSource, batches: int,
                    autocast: Callable = contextlib.nullcontext) -> EvalResult:
    """Mean loss of `batches` micro-batches of `source` on every dp rank (a collective over the
    whole mesh: pp broadcasts the loss, dp averages it). The module is left in train mode."""
    ctx = pm.ctx
    pm.module.eval()
    try:
        losses, tokens = [], 0
        for _ in range(batches):
            batch = source.next_batch()
            losses.append(pm.evaluate(batch, autocast))
            tokens += batch[:, 1:].numel()
    finally:
        pm.module.train()
    loss = dp_mean(ctx, torch.stack(losses).mean().float())
    return EvalResult(float(loss), tokens * ctx.dp, batches)


def dp_mean(ctx: ParallelContext, value: torch.Tensor) -> torch.Tensor:
    """The mean of `value` over the data-parallel group (an all-reduce into a copy when dp > 1)."""
    if ctx.dp > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.AVG, group=ctx.dp_group)
    return value


def evaluate_held_out(pm: ParallelModel, held_out: list[HeldOut], batches: int,
                      autocast: Callable = contextlib.nullcontext) -> dict[str, EvalResult]:
    """evaluate_source on a fresh source of each held-out set (data.mix: one per source), by name."""
    return {h.name: evaluate_source(pm, h.make(), batches, autocast) for h in held_out}


def held_out_losses(pm: ParallelModel, held_out: list[HeldOut], batches: int,
                    autocast: Callable = contextlib.nullcontext) -> dict[str, float] | None:
    """The Trainer's evaluation: "" the held-out loss (data.mix: the sources' losses weighted by the
    mixture), and under data.mix each source's own loss by its name; None without held-out data."""
    if not held_out:
        return None
    results = evaluate_held_out(pm, held_out, batches, autocast)
    return {"": combined_loss(results, held_out), **{h.name: results[h.name].loss for h in held_out if h.name}}


def combined_loss(results: dict[str, EvalResult], held_out: list[HeldOut]) -> float:
    """The held-out losses weighted by their mixture shares (renormalised over the sources that
    have a val split): the expected loss under the mixture; for one data.path, its loss."""
    total = sum(h.weight for h in held_out)
    return sum(h.weight * results[h.name].loss for h in held_out) / total
