"""Straggler statistics: how long each rank takes to be ready for a step, compared across ranks
at log intervals (fault.straggler_factor; 0 = off; one process: nothing to compare).

In synchronous training every rank's step takes as long as the slowest rank's, so a rank's step
time says nothing about who is slow. What differs is how long each rank needs before it can
join the step's collectives: from the start of its step to having the step's batches in hand
(data fetch, host work, an injected `sleep`), `ready_s`. Each rank sums it over the log
interval (host clock only, no device sync); at the log interval one all-gather of one number per
rank gives ready_s_min / _median / _max and ready_s_max_rank in the metrics. When the slowest
rank's excess over the other ranks' median makes the step straggler_factor x longer than it would
be without it, at PATIENCE log intervals in a row, a warning names the rank.
Slowness inside the device's compute (a throttled GPU) is not seen by this host-side measure.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

PATIENCE = 3  # log intervals in a row


class StragglerWatch:
    def __init__(self, factor: float, ctx):
        self.factor, self.ctx = factor, ctx
        self.on = factor > 0 and ctx.mesh is not None and ctx.world_size > 1
        self._began = 0.0
        self._ready = 0.0
        self._steps = 0
        self._suspect: tuple[int, int] = (-1, 0)  # (rank, log intervals in a row)

    def begin(self) -> None:
        if self.on:
            self._began = time.perf_counter()

    def ready(self) -> None:
        """The step's batches are in hand."""
        if self.on:
            self._ready += time.perf_counter() - self._began
            self._steps += 1

    def report(self, step_time: float) -> tuple[dict, str | None]:
        """(metrics, a warning or None) at a log interval: a collective on every rank."""
        if not self.on:
            return {}, None
        mine = torch.tensor([self._ready / max(self._steps, 1)], dtype=torch.float64, device=self.ctx.device)
        self._ready, self._steps = 0.0, 0
        out = [torch.zeros_like(mine) for _ in range(self.ctx.world_size)]
        dist.all_gather(out, mine)
        ready = [float(t) for t in out]  # the host read
        slowest = max(range(len(ready)), key=ready.__getitem__)
        metrics = {"ready_s_min": min(ready), "ready_s_median": statistics.median(ready), "ready_s_max": ready[slowest],
                   "ready_s_max_rank": slowest}
        excess = ready[slowest] - statistics.median(ready[:slowest] + ready[slowest + 1:])
        slow = excess > (self.factor - 1) * max(step_time - excess, 1e-9)
        rank, count = self._suspect
        self._suspect = (slowest, count + 1 if rank == slowest else 1) if slow else (-1, 0)
        warning = None
        if self._suspect[1] == PATIENCE:
            warning = (f"straggler: rank {slowest} needs {excess:.3f} s more than the other ranks' median before "
                       f"each step (data, host work) for {PATIENCE} log intervals in a row: the steps take "
                       f"{step_time / max(step_time - excess, 1e-9):.2f}x as long "
                       f"(fault.straggler_factor={self.factor:g})")
        return metrics, warning
