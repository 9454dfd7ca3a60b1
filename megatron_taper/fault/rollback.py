"""The non-finite and spike policy: bad steps tracked on the device, rollback decided at log
intervals and before saves, and the data windows a rollback skips (RUN/data_skips.json).

A step is bad when its loss or gradient norm is non-finite (the step was skipped), or, with
fault.spike_rollback, when it is a spike: a finite loss above fault.spike_factor x the running
mean of the earlier good losses (an exponential mean, decay SPIKE_DECAY, once SPIKE_WARMUP good
steps have been seen). Spikes are logged either way. After fault.rollback_after bad steps in a
row, the Trainer reloads the newest checkpoint from before the first of them and skips the data
batches those steps drew; the window is appended to RUN/data_skips.json first, so a resume, or a
fresh run started with the same file in its run folder, skips the same samples.

Batches are counted in steps' worth: batch b is what the b-th step drew since the start of the
run, skipped windows included (b = step + batches skipped so far).
"""
from __future__ import annotations

import json
import os

import torch

SKIPS_FILE = "data_skips.json"
SPIKE_DECAY = 0.9
SPIKE_WARMUP = 5


class DataSkips:
    """The windows of batches (first, last; inclusive) that the run never trains on. A batch is
    train.global_batch sequences, which the file records when the trainer writes it: read with
    another global batch, its windows would skip other samples, so that is refused."""

    def __init__(self, run_dir: str, global_batch: int):
        self.path = os.path.join(run_dir, SKIPS_FILE)
        self.global_batch = global_batch
        self.windows: list[tuple[int, int]] = []
        if os.path.exists(self.path):
            try:
                with open(self.path) as f:
                    saved = json.load(f)
                self.windows = [(int(a), int(b)) for a, b in saved["windows"]]
                written_for = int(saved.get("global_batch", global_batch))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{self.path}: not a list of data windows {{\"windows\": [[first, last], ...]}} "
                                 f"({e})") from None
            if written_for != global_batch:
                raise ValueError(f"{self.path}: its windows count batches of train.global_batch={written_for}, "
                                 f"this run has train.global_batch={global_batch}, so they would skip other "
                                 f"samples; resume with train.global_batch={written_for}")

    def covers(self, batch: int) -> bool:
        return any(a <= batch <= b for a, b in self.windows)

    def add(self, first: int, last: int, write: bool) -> None:
        self.windows.append((first, last))
        if write:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"windows": self.windows, "global_batch": self.global_batch}, f)
            os.replace(tmp, self.path)


class BadSteps:
    """Device-side counters (no host sync per step): bad steps in a row, the first batch and step
    of the current streak, the trigger (the streak that reached rollback_after), and the last
    spike (step, loss, running mean) with a spike count."""

    def __init__(self, device: torch.device, rollback_after: int, spike_factor: float, spike_rollback: bool):
        self.rollback_after, self.spike_factor, self.spike_rollback = rollback_after, spike_factor, spike_rollback
        z = lambda dtype=torch.int64: torch.zeros((), dtype=dtype, device=device)  # noqa: E731
        self.in_row, self.first_batch, self.first_step, self.good = z(), z(), z(), z()
        # the streak that reached rollback_after: step reached, first step, first batch, last batch
        self.trigger = torch.zeros(4, dtype=torch.int64, device=device)
        self.mean = z(torch.float64)
        self.spikes, self.spike = z(), torch.zeros(3, dtype=torch.float64, device=device)  # step, loss, mean
        self.spikes_seen = 0  # host: spikes already reported

    def update(self, loss: torch.Tensor, stepped: torch.Tensor, step: int, batch: int) -> None:
        if not (self.rollback_after or self.spike_factor):
            return  # the policy is off: no device work per step
        loss = loss.detach().to(self.mean.device, torch.float64)
        finite = stepped.to(self.in_row.device) & torch.isfinite(loss)
        spike = torch.zeros_like(finite)
        if self.spike_factor > 0:
            spike = finite & (self.good >= SPIKE_WARMUP) & (loss > self.spike_factor * self.mean)
            self.spikes += spike.long()
            self.spike = torch.where(spike, torch.stack([torch.full_like(loss, step), loss, self.mean]), self.spike)
        good = finite & ~spike
        self.mean = torch.where(good, torch.where(self.good == 0, loss, SPIKE_DECAY * self.mean
                                                  + (1 - SPIKE_DECAY) * loss), self.mean)
        self.good += good.long()
        bad = (~finite | (spike if self.spike_rollback else torch.zeros_like(spike))).long()
        starts = (bad == 1) & (self.in_row == 0)
        self.first_batch = torch.where(starts, torch.full_like(self.first_batch, batch), self.first_batch)
        self.first_step = torch.where(starts, torch.full_like(self.first_step, step), self.first_step)
        self.in_row = (self.in_row + 1) * bad
        if self.rollback_after:
            now = (self.trigger[0] == 0) & (self.in_row >= self.rollback_after)
            here = torch.stack([torch.full_like(self.in_row, step), self.first_step, self.first_batch,
                                torch.full_like(self.in_row, batch)])
            self.trigger = torch.where(now, here, self.trigger)

    def new_spikes(self) -> tuple[int, list[float]]:
        """(spikes since the last call, [step, loss, running mean] of the last one): a host read."""
        count = int(self.spikes)
        new, self.spikes_seen = count - self.spikes_seen, count
        return new, [float(x) for x in self.spike]
