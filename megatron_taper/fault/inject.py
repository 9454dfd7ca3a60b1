"""The fault-injection hook for tests and drills (benchmarks/fault_drill.py), off unless the
environment variable MEGATRON_TAPER_FAULT=KIND:RANK:STEP[:ARG] is set (several faults: a comma
separated list); it is read once, at start, and a malformed value is one error (exit 2) naming the
variable.

    kill        rank RANK sends itself SIGKILL just before step STEP
    stop        ... SIGSTOP (a hang: the process is frozen, threads included)
    term        ... SIGTERM (the trainer checkpoints and exits 3, as on a slurm warning)
    raise       ... raises InjectedFault (an exception on one rank)
    bad_input   ... raises ConfigError (bad input found by one rank alone, e.g. in its shard: exit 2)
    nan         the loss of step STEP on rank RANK is NaN (the step is skipped everywhere)
    spike       the loss of step STEP on rank RANK is multiplied by ARG (default 10); gradients unchanged
    sleep       rank RANK sleeps ARG seconds (default 0.5) before every step from STEP on (a slow rank)
    write_fail  rank RANK's first checkpoint write of a step >= STEP fails with ENOSPC (disk full)

Every kind but sleep fires once per run folder: firing appends a line to RUN/logs/faults.jsonl
(kind, rank, step, wall time) before it acts, and a line there keeps a restarted or resumed run
from firing it again. The main rank also appends the first step each process completes
(`first_step`, with torchrun's restart count), so a drill can measure fault -> training again.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import time
from dataclasses import dataclass

from megatron_taper.validation import ConfigError

FAULT_ENV = "MEGATRON_TAPER_FAULT"
KINDS = ("kill", "stop", "term", "raise", "bad_input", "nan", "spike", "sleep", "write_fail")
DEFAULT_ARG = {"spike": 10.0, "sleep": 0.5}
EVENTS_FILE = "faults.jsonl"  # under RUN/logs


class InjectedFault(RuntimeError):
    """The exception of MEGATRON_TAPER_FAULT=raise:..."""


@dataclass(frozen=True)
class FaultPlan:
    kind: str
    rank: int
    step: int
    arg: float


def parse_faults(value: str | None) -> list[FaultPlan]:
    """MEGATRON_TAPER_FAULT's value as plans; [] when unset or empty."""
    return [_parse_one(item, value) for item in value.split(",")] if value else []


def _parse_one(item: str, value: str) -> FaultPlan:
    parts = item.strip().split(":")
    usage = (f"{FAULT_ENV}={value!r}: {item!r} must be KIND:RANK:STEP[:ARG] with KIND one of {', '.join(KINDS)}, "
             f"RANK >= 0, STEP >= 1 and ARG a number > 0 (spike: loss factor, sleep: seconds)")
    if len(parts) not in (3, 4) or parts[0] not in KINDS:
        raise ConfigError(usage)
    try:
        rank, step = int(parts[1]), int(parts[2])
        arg = float(parts[3]) if len(parts) == 4 else DEFAULT_ARG.get(parts[0], 0.0)
    except ValueError:
        raise ConfigError(usage) from None
    if rank < 0 or step < 1 or (len(parts) == 4 and not 0 < arg < float("inf")):
        raise ConfigError(usage)
    return FaultPlan(parts[0], rank, step, arg)


def read_events(log_dir: str) -> list[dict]:
    """RUN/logs/faults.jsonl (none: [])."""
    path = os.path.join(log_dir, EVENTS_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def append_event(log_dir: str, event: dict) -> None:
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, EVENTS_FILE), "a") as f:
        f.write(json.dumps({**event, "time": time.time()}) + "\n")
        f.flush()
        os.fsync(f.fileno())


class Injector:
    """Fires this rank's `plans`; the Trainer calls the three points below."""

    def __init__(self, plans: list[FaultPlan], rank: int, log_dir: str):
        self.plans, self.log_dir = [p for p in plans if p.rank == rank], log_dir

    def before_step(self, step: int) -> None:
        """Just before step `step` (1-based) runs."""
        for p in self.plans:
            if p.kind == "sleep" and step >= p.step:
                time.sleep(p.arg)
            elif step == p.step and p.kind in ("kill", "stop", "term", "raise", "bad_input") and self._fire(p, step):
                if p.kind == "raise":
                    raise InjectedFault(f"{FAULT_ENV}: injected exception on rank {p.rank} before step {step}")
                if p.kind == "bad_input":
                    raise ConfigError(f"{FAULT_ENV}: injected bad input on rank {p.rank} before step {step}")
                os.kill(os.getpid(), {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}[p.kind])

    def loss(self, loss, step: int):
        """The loss of step `step` as this rank reports it (a tensor; NaN or scaled when planned)."""
        for p in self.plans:
            if step == p.step and p.kind in ("nan", "spike") and self._fire(p, step):
                loss = loss * (float("nan") if p.kind == "nan" else p.arg)
        return loss

    def before_write(self, step: int) -> None:
        """In the checkpoint writer of step `step`, before any file is written."""
        for p in self.plans:
            if p.kind == "write_fail" and step >= p.step and self._fire(p, step):
                raise OSError(errno.ENOSPC, f"No space left on device ({FAULT_ENV}: injected on rank {p.rank})")

    def _fire(self, p: FaultPlan, step: int) -> bool:
        """Record the firing; False when it already fired in this run folder."""
        for e in read_events(self.log_dir):
            if e.get("event") == "fired" and (e["kind"], e["rank"], e["planned_step"]) == (p.kind, p.rank, p.step):
                return False
        append_event(self.log_dir, {"event": "fired", "kind": p.kind, "rank": p.rank, "planned_step": p.step,
                                    "step": step})
        return True
