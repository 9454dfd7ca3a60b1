"""The non-finite policy's counters (train.max_nonfinite), kept on the device so that a step never
waits for the host; read at log intervals and before saves, where the recovery policy
(fault/recovery.py) also prints one line naming the steps skipped since the last read."""
from __future__ import annotations

import torch


class NonFiniteLossError(RuntimeError):
    pass


class StepHealth:
    """Skipped steps, non-finite steps in a row, the first step at which the run reached
    train.max_nonfinite in a row (0: not reached), and the first and last step skipped since the
    last `new_skips` (0: none)."""

    def __init__(self, device: torch.device, skipped: int = 0):
        self.skipped = torch.tensor(skipped, dtype=torch.int64, device=device)
        self.in_row = torch.zeros((), dtype=torch.int64, device=device)
        self.breach = torch.zeros((), dtype=torch.int64, device=device)
        self.first_new = torch.zeros((), dtype=torch.int64, device=device)
        self.last_new = torch.zeros((), dtype=torch.int64, device=device)
        self.reported = skipped  # host: skipped steps already named on the console

    def update(self, stepped: torch.Tensor, step: int, max_nonfinite: int) -> None:
        bad = (~stepped.to(self.in_row.device)).long()
        self.skipped += bad
        self.in_row = (self.in_row + 1) * bad
        first = (self.breach == 0) & (self.in_row >= max_nonfinite)
        self.breach = torch.where(first, torch.full_like(self.breach, step), self.breach)
        here = torch.full_like(self.last_new, step)
        self.first_new = torch.where((bad == 1) & (self.first_new == 0), here, self.first_new)
        self.last_new = torch.where(bad == 1, here, self.last_new)

    def skipped_steps(self) -> int:
        return int(self.skipped)

    def breach_step(self) -> int:
        return int(self.breach)

    def new_skips(self, max_nonfinite: int) -> str | None:
        """The console line for the steps skipped since the last call (one host read), or None."""
        total, first, last = torch.stack([self.skipped, self.first_new, self.last_new]).tolist()
        new, self.reported = total - self.reported, total
        if not new:
            return None
        self.first_new.zero_()
        self.last_new.zero_()
        which = f"step {last} was" if new == 1 else f"{new} steps from step {first} to step {last} were"
        return (f"{which} skipped: non-finite loss or gradient norm, the optimizer did not step ({total} skipped "
                f"so far; train.max_nonfinite={max_nonfinite} in a row stop the run)")
