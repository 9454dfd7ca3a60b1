"""Stops by signal: SIGUSR1 (Slurm's warning), SIGTERM (Slurm, torchrun, `kill`) and SIGINT (Ctrl-C;
torchrun forwards it to every worker's process group) are recorded by StopSignal and acted on at
the next step boundary on every rank, agreed by StopVote; the Trainer then writes a checkpoint and
exits with EXIT_REQUEUE. A second SIGINT ends the process at once, without a checkpoint.

The agreement costs no per-step wait for the device: at the end of step k every rank puts its
flag (the signal, and the step at whose end it saw it) into a three-element all-reduce (MAX) over
all ranks, issued without waiting (NCCL: on its stream, the result copied to pinned host memory
with a non-blocking copy and an event recorded behind it). The result is read at the end of step
k + 1, when the device has had a whole step to finish it: the host waits on that event only
if the device is more than a step behind (on CPU / gloo the all-reduce itself is a short blocking
call). Every rank reads the same result at the same step, so all stop after the same step: the
step after the one during which the first rank got the signal, i.e. within two step times.

The same vote completes a background checkpoint save (checkpoint.async_save): its third element
says whether this rank is still writing the pending save, and once the vote says no rank is, every
rank finalises that save (Checkpointer.finalise) at the same step, one step after the vote; one
process finalises it as soon as it is written.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megatron_taper.checkpoint.checkpointer import Checkpointer

EXIT_REQUEUE = 3
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
NOT_SEEN = -(2**62)  # the vote's "step first seen" (negated) of a rank without a signal


class StopSignal:
    """Records SIGUSR1 / SIGTERM / SIGINT (the first one received); the Trainer asks StopVote
    whether some rank got one. A second SIGINT falls to the default action (the process ends)."""

    def __init__(self):
        self.received: int | None = None
        self._previous = {}

    def install(self) -> bool:
        """Install the handlers; False when they already were (uninstall is then the installer's)."""
        if self._previous:
            return False
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def _handle(self, signum, frame) -> None:
        self.received = self.received or signum
        if signum == signal.SIGINT:  # the next Ctrl-C is not caught: it ends the process at once
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        if int(os.environ.get("RANK", "0")) == 0:  # os.write: print may be mid-write on this thread
            os.write(2, f"{signal.Signals(signum).name}: stopping within two steps with a checkpoint (exit "
                        f"{EXIT_REQUEUE})".encode() + (b"; Ctrl-C again to stop at once, without one"
                                                       if signum == signal.SIGINT else b"") + b"\n")

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


@dataclass(frozen=True)
class Stop:
    """The agreed stop: the signal (the largest number any rank got) and the first step at whose
    end some rank had it."""
    signum: int
    seen_at: int

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class StopVote:
    """The per-step agreement of the module docstring; `ctx.mesh is None` (one process): the
    signal is acted on at the end of the step it arrived in. `checkpointer`: the one whose
    background saves the vote completes (None: no saves to complete)."""

    def __init__(self, ctx, stop: StopSignal, checkpointer: Checkpointer | None = None):
        self.ctx, self.stop, self.checkpointer = ctx, stop, checkpointer
        self.seen_at = 0  # the step at whose end this rank first had a signal
        self.pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self.voted_save: int | None = None  # the step of the save pending when the pending vote was issued
        self.agreed: Stop | None = None
        self._host = None
        if ctx.device.type == "cuda":
            self._host = torch.empty(3, dtype=torch.int64, pin_memory=True)

    def at_step_end(self, step: int) -> Stop | None:
        """Every rank calls this at the end of every step (the same steps on all ranks): the stop
        once every rank has agreed on one, else None."""
        if self.agreed is not None:
            return self.agreed
        if self.stop.received and not self.seen_at:
            self.seen_at = step
        if self.ctx.mesh is None:
            saving = self._saving()
            if saving is not None and saving[1]:
                self.checkpointer.finalise(saving[0])
            self.agreed = Stop(self.stop.received, self.seen_at) if self.stop.received else None
            return self.agreed
        if self.pending is not None:  # the vote issued at the end of the previous step
            result, event = self.pending
            if event is not None:
                event.synchronize()
            signum, negated_step, writing = result.tolist()
            if self.voted_save is not None and not writing:  # every rank has written that save
                self.checkpointer.finalise(self.voted_save)
            if signum:
                self.agreed = Stop(signum, -negated_step)
                return self.agreed
        saving = self._saving()
        self.voted_save = saving[0] if saving is not None else None
        self.pending = self._issue(writing=saving is not None and not saving[1])
        return None

    def _saving(self) -> tuple[int, bool] | None:
        return self.checkpointer.saving() if self.checkpointer is not None else None

    def _issue(self, writing: bool) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        vote = torch.empty(3, dtype=torch.int64, device=self.ctx.device)
        vote[0].fill_(self.stop.received or 0)  # fills from host scalars: kernels, no copy, no sync
        vote[1].fill_(-self.seen_at if self.seen_at else NOT_SEEN)
        vote[2].fill_(int(writing))
        dist.all_reduce(vote, op=dist.ReduceOp.MAX)  # all ranks; NCCL: enqueued, the stream waits on it
        if self._host is None:
            return vote, None
        self._host.copy_(vote, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return self._host, event
