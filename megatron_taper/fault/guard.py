"""FaultGuard: the one object the Trainer calls for the hang watchdog and injected faults: section
changes for the watchdog and the points where an injected fault (MEGATRON_TAPER_FAULT) fires
(bad steps are fault/recovery.py's). Either part may be off (fault.watchdog=false; the variable
unset): its calls then do nothing."""
from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

from megatron_taper.fault.inject import FAULT_ENV, Injector, append_event, parse_faults
from megatron_taper.fault.watchdog import Watchdog

if TYPE_CHECKING:
    from megatron_taper.config import FaultConfig


class FaultGuard:
    def __init__(self, watchdog: Watchdog | None = None, injector: Injector | None = None, log_dir: str = "",
                 is_main: bool = False):
        self.watchdog, self.injector, self.log_dir, self.is_main = watchdog, injector, log_dir, is_main
        self._first_step_done = False

    @classmethod
    def start(cls, options: FaultConfig, run_dir: str, rank: int, world: int) -> FaultGuard:
        """Parse MEGATRON_TAPER_FAULT (ConfigError when malformed) and start the watchdog thread
        (in section startup), before the process group is joined."""
        log_dir = os.path.join(run_dir, "logs")
        plans = parse_faults(os.environ.get(FAULT_ENV))
        injector = Injector(plans, rank, log_dir) if plans else None
        watchdog = None
        if options.watchdog:
            # torch's flight recorder (read when the process group is created): the hang report's
            # last collectives of each rank
            os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "256")
            watchdog = Watchdog(options, rank, world, log_dir).start()
        return cls(watchdog, injector, log_dir, rank == 0)

    def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()

    def report_end(self, code: int, what: str) -> None:
        """This rank ends the attempt with exit `code` on its own (bad input): the other ranks' watchdogs
        end theirs with the same code instead of waiting for it (Watchdog.report_end)."""
        if self.watchdog is not None:
            self.watchdog.report_end(code, what)

    def enter(self, section: str, step: int) -> None:
        if self.watchdog is not None:
            self.watchdog.enter(section, step)

    @contextlib.contextmanager
    def section(self, name: str, step: int, then: str = "step"):
        """`name` at `step`, and back to section `then` afterwards."""
        self.enter(name, step)
        try:
            yield
        finally:
            self.enter(then, step)

    def step_begins(self, step: int) -> None:
        """Step `step` (1-based) is about to run."""
        self.enter("step", step)
        if self.injector is not None:
            self.injector.before_step(step)

    def step_done(self, step: int) -> None:
        """The first step this process completes is recorded (main rank) for the drill's
        recovery time, when a fault is planned."""
        if not self._first_step_done:
            self._first_step_done = True
            if self.injector is not None and self.is_main:
                append_event(self.log_dir, {"event": "first_step", "step": step,
                                            "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")})

    def loss(self, loss, step: int):
        return loss if self.injector is None else self.injector.loss(loss, step)

    def before_write(self, step: int) -> None:
        if self.injector is not None:
            self.injector.before_write(step)
