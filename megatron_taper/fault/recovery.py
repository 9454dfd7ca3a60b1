"""Recovery: the run's policy for bad steps, the one part the Trainer asks about them.

- non-finite steps (fault/health.py): skipped on the device by the engine, named on the console at
  the next check, and the run stops (NonFiniteLossError) after train.max_nonfinite in a row;
- loss spikes and rollback (fault/rollback.py): spikes logged; after fault.rollback_after bad steps
  in a row the newest checkpoint from before them is reloaded and their data batches are skipped
  (RUN/data_skips.json, read again by a resume);
- while bad steps are running in a row, no checkpoint is written (the newest one stays one from
  before them, the rollback's).

Everything per step stays on the device; the host reads the counters at checks (log intervals,
checkpoint steps, stops and before every save), where the rollback decision costs one all-reduce.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from megatron_taper.checkpoint.checkpointer import list_checkpoints
from megatron_taper.fault.health import NonFiniteLossError, StepHealth
from megatron_taper.fault.rollback import BadSteps, DataSkips

if TYPE_CHECKING:
    from megatron_taper.checkpoint.checkpointer import Checkpointer
    from megatron_taper.config import Config
    from megatron_taper.parallel.context import ParallelContext


class Recovery:
    def __init__(self, cfg: Config, ctx: ParallelContext, say: Callable[[str], None]):
        """`say`: prints a console line (on the main rank)."""
        self.options, self.max_nonfinite, self.ctx, self.say = cfg.fault, cfg.train.max_nonfinite, ctx, say
        self.health = StepHealth(ctx.device)
        self.bad = self._bad_steps()
        self.skips = DataSkips(cfg.run.dir, cfg.train.global_batch)  # data windows never trained on (rollbacks)

    def _bad_steps(self) -> BadSteps:
        f = self.options
        return BadSteps(self.ctx.device, f.rollback_after, f.spike_factor, f.spike_rollback)

    def skips_batch(self, batch: int) -> bool:
        """Whether data batch `batch` lies in a window a rollback skipped."""
        return self.skips.covers(batch)

    def update(self, loss: torch.Tensor, stepped: torch.Tensor, step: int, batch: int) -> None:
        """After step `step` (which drew batch `batch`): the device counters, no host read."""
        self.health.update(stepped, step, self.max_nonfinite)
        self.bad.update(loss, stepped, step, batch)

    @property
    def skipped(self) -> int:
        return self.health.skipped_steps()

    def state_dict(self) -> dict:
        return {"skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.health = StepHealth(self.ctx.device, skipped=state["skipped"])

    def report_skipped(self) -> None:
        line = self.health.new_skips(self.max_nonfinite)
        if line:
            self.say(line)

    def check_health(self) -> None:
        """Name the steps skipped since the last check; raise NonFiniteLossError if
        train.max_nonfinite steps in a row were non-finite."""
        self.report_skipped()
        breach = self.health.breach_step()
        if breach:
            n = self.max_nonfinite
            raise NonFiniteLossError(
                f"loss or gradient norm was non-finite for {n} steps in a row (up to step {breach}, "
                f"train.max_nonfinite={n}); lower train.lr, enable train.grad_clip or check the data"
            )

    def holds_save(self, step: int) -> bool:
        """True (and says so) when bad steps are running in a row under fault.rollback_after: the
        checkpoint of `step` is not written, so that the newest stays one from before them."""
        if not (self.options.rollback_after and int(self.bad.in_row)):
            return False
        self.say(f"checkpoint of step {step} not written: the steps before it were bad "
                 f"(fault.rollback_after={self.options.rollback_after})")
        return True

    def roll_back_if_due(self, checkpointer: Checkpointer, load: Callable[[list[str]], tuple[str, int]]) -> bool:
        """Name new skipped steps and loss spikes; roll back when fault.rollback_after bad steps in
        a row were reached: `load` (the Trainer's) loads the first loadable checkpoint of a list,
        newest first, and restores the run from it, returning its path and step. A host read of the device
        counters and one all-reduce; True after a rollback."""
        f = self.options
        self.report_skipped()  # before a rollback resets the counters
        if f.spike_factor > 0:
            new, (step, loss, mean) = self.bad.new_spikes()
            if new:
                self.say(f"loss spike at step {step:.0f}: {loss:.4f} > fault.spike_factor={f.spike_factor:g} x "
                         f"the running mean {mean:.4f}" + (f" ({new} spikes since the last check)" if new > 1
                                                           else ""))
        if not f.rollback_after:
            return False
        trigger = self.bad.trigger.clone()
        if self.ctx.mesh is not None:
            dist.all_reduce(trigger, op=dist.ReduceOp.MAX)  # every rank takes the same decision
        reached, first_step, first_batch, last_batch = (int(x) for x in trigger)
        if not reached:
            return False
        checkpointer.wait()
        before = [path for step, path in reversed(list_checkpoints(checkpointer.root)) if step < first_step]
        if not before:
            raise NonFiniteLossError(f"{reached - first_step + 1} bad step(s) from step {first_step} (fault.rollback_"
                                     f"after={f.rollback_after}), and no checkpoint from before step {first_step} "
                                     f"to roll back to; set checkpoint.interval")
        self.skips.add(first_batch, last_batch, write=self.ctx.is_main)
        path, step = load(before)
        self.bad = self._bad_steps()
        self.say(f"rollback: {reached - first_step + 1} bad step(s) from step {first_step} (non-finite"
                 + (" or spike" if f.spike_rollback else "") + f"; fault.rollback_after={f.rollback_after}): "
                 f"reloaded {path} at step {step}; data batches {first_batch}-{last_batch} are skipped "
                 f"(recorded in {self.skips.path})")
        return True
