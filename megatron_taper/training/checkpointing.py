"""Checkpointing: the run's policy around its Checkpointer (checkpoint/checkpointer.py): when to
save (checkpoint.interval), one save per step, saving's console lines ("checkpoint saved", once an
async save is complete), and the start: resume (run.resume: the newest valid checkpoint, or the
one named) or, without a checkpoint, run.init_from's weights.

A background save (checkpoint.async_save) is completed once every rank has written its part,
which the ranks agree on in the per-step StopVote (training/stop.py), read one step later: no
per-step host sync of its own.
"""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Callable

from megatron_taper.checkpoint.checkpointer import (
    Checkpointer,
    checkpoint_root,
    load_weights_only,
    resume_candidates,
)
from megatron_taper.console import restart_line
from megatron_taper.training.run_folder import resume_changes

if TYPE_CHECKING:
    import torch

    from megatron_taper.config import Config
    from megatron_taper.parallel.model import ParallelModel
    from megatron_taper.training.metrics import MetricsLogger


class Checkpointing:
    def __init__(self, cfg: Config, pm: ParallelModel, before_write: Callable[[int], None],
                 say: Callable[[str], None]):
        """`before_write`: called with the step in the writer (fault injection); `say`: prints a
        console line (on the main rank)."""
        self.cfg, self.pm, self.say = cfg, pm, say
        self.checkpointer = Checkpointer(checkpoint_root(cfg.run.dir), cfg.checkpoint, pm)
        self.checkpointer.before_write = before_write
        self.last_saved = -1
        self._saving: dict[str, float] = {}  # checkpoint folder -> when its save began

    def due(self, step: int) -> bool:
        interval = self.cfg.checkpoint.interval
        return bool(interval) and step % interval == 0

    def resume(self, optimizer: torch.optim.Optimizer, metrics: MetricsLogger, row_streams: bool,
               restore: Callable[[dict], None]) -> None:
        """Load run.resume's checkpoint and `restore` the run from its trainer state; without one,
        start fresh (run.init_from's weights when set). Says which, and what the resume changes."""
        cfg = self.cfg
        mode = cfg.run.resume
        candidates = resume_candidates(mode, self.checkpointer.root)
        loaded = self.checkpointer.load(candidates, cfg.model, optimizer, explicit=mode != "auto")
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if loaded is None:
            metrics.truncate_after(0)
            if cfg.run.init_from:
                source = load_weights_only(cfg.run.init_from, cfg.model, self.pm)
                self.say(f"initialised from: {source} (weights only; optimizer, step and data start fresh)")
            if restart:
                self.say(restart_line(restart, cfg.run.dir, "no checkpoint yet: training from step 0"))
            return
        path, state = loaded
        changes = resume_changes(state["config"], cfg, state["step"], row_streams)
        restore(state)
        resumed = f"resumed from: {path} at step {state['step']}"
        written = os.path.getmtime(os.path.join(path, "meta.json"))
        self.say(restart_line(restart, cfg.run.dir, resumed, written) if restart else resumed)
        for line in changes:
            self.say(line)

    def load(self, candidates: list[str], optimizer: torch.optim.Optimizer) -> tuple[str, dict]:
        """The first of `candidates` every rank verifies (a rollback's): (path, trainer state)."""
        return self.checkpointer.load(candidates, self.cfg.model, optimizer, explicit=False)

    def save(self, step: int, optimizer: torch.optim.Optimizer, states: Callable[[], tuple[dict, dict]],
             final: bool) -> None:
        """Checkpoint `step` unless it already is; `states`: (trainer state, this rank's data state),
        asked for only when it is written. `final`: also wait until it (and any background save)
        is complete, and for the main rank's deletions of older checkpoints."""
        if step != self.last_saved:
            self.last_saved = step
            self._saving[os.path.join(self.checkpointer.root, f"step-{step}")] = time.perf_counter()
            trainer_state, data_state = states()
            self.checkpointer.save(optimizer, step, self.cfg.to_dict(), trainer_state, data_state)
        if final:
            self.checkpointer.wait()
            self.checkpointer.join_cleanup()

    def report_saved(self) -> None:
        """'checkpoint saved' for every save begun here that is now complete (async: finalised)."""
        pending = self.checkpointer.pending
        for path, began in list(self._saving.items()):
            if pending is None or pending.final != path:
                del self._saving[path]
                self.say(f"checkpoint saved: {path} ({time.perf_counter() - began:.1f} s)")
