"""Hang detection: a watchdog thread per rank (fault.watchdog), with a timeout per section of the
run (startup, step, save, eval, finish; FaultConfig says how each is chosen).

The training thread only records which section it entered and when (`enter`: a tuple assignment,
no I/O, no synchronisation). The watchdog thread, every POLL_S:
- writes this rank's heartbeat, RUN/logs/heartbeat-rank{r}.json (rank, pid, host, step, section,
  when the section began, when the heartbeat was written, torchrun's run id and restart count);
- on expiry of the current section's timeout, or when another rank of the same attempt has
  reported a hang (RUN/logs/ended.json with code EXIT_HANG): writes every Python thread's stack
  (faulthandler) and the last collectives this rank issued (torch's flight recorder; FaultGuard
  turns it on with TORCH_FR_BUFFER_SIZE unless set) to RUN/logs/stacks-rank{r}.txt, prints one
  line naming the rank(s) that stopped first, and exits the process with EXIT_HANG
  (launch/torchrun.sh restarts the workers, which resume from the last checkpoint);
- when another rank of the same attempt has ended on bad input (`report_end`: ended.json with
  code 2, which torchrun counts as success and so would leave this rank waiting for it in a
  collective until a timeout): exits with the same code, rank 0 printing that rank's error.
One file for both, so a poll reads one small file whatever the number of ranks.

"Stopped first", from the heartbeats of the same attempt: the ranks whose heartbeat is no longer
written (frozen or dead: SIGSTOP, a lost node), else the ranks furthest behind (step, then
section), else those that entered the common section last. A rank whose heartbeat is frozen and
that runs on this host is sent SIGKILL, since it can neither write its stacks nor end on the
launcher's SIGTERM (torchrun would wait 30 s for it).

An attempt is torchrun's run id, its restart count and the workers' store (MASTER_ADDR:MASTER_PORT:
a free port per job, so a rendezvous id reused by a later job is another attempt); heartbeats of
other attempts, or written over FRESH_SLACK_S before this process started, are ignored. A PID is
killed only when it is verifiably a worker of this attempt (worker_of_this_attempt): the process
start time in /proc/PID/stat equals the one its heartbeat recorded (not a reused PID) and its
environment (/proc/PID/environ) holds this attempt's run id, restart count, store and the
heartbeat's rank. A stale or forged heartbeat naming another process kills nothing.
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_taper.config import FaultConfig

EXIT_HANG = 4
POLL_S = 0.5
FROZEN_AFTER_S = 3.0  # a heartbeat older than this: the rank's process is not running
# a heartbeat written this long before this process started belongs to an earlier job (the ranks of
# one attempt start within seconds of each other; hosts' clocks may differ a little)
FRESH_SLACK_S = 60.0
ORDER = {"startup": 0, "step": 1, "eval": 2, "save": 3, "finish": 4}  # within one step number
ENDED_FILE = "ended.json"  # the first rank to end this attempt on its own: a hang or bad input


def _attempt(environ: dict | os._Environ = os.environ) -> tuple[str, str, str]:
    """(torchrun's run id, its restart count, the workers' store): one attempt's heartbeats share them."""
    return (environ.get("TORCHELASTIC_RUN_ID", ""), environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
            f"{environ.get('MASTER_ADDR', '')}:{environ.get('MASTER_PORT', '')}")


def _of_attempt(record: dict) -> tuple:
    return record.get("run_id"), record.get("restart"), record.get("store")


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot, /proc/PID/stat field 22); None: no such
    process or no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def process_environ(pid: int) -> dict[str, str]:
    """Process `pid`'s environment from /proc/PID/environ ({} when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def worker_of_this_attempt(beat: dict, attempt: tuple[str, str, str]) -> bool:
    """Whether the process a heartbeat names runs on this host and is verifiably the worker that
    wrote it, in `attempt`: same start time as recorded (not a reused PID), and this attempt's
    run id, restart count, store and the heartbeat's rank in its environment."""
    pid, start = beat.get("pid"), beat.get("start_ticks")
    if beat.get("host") != socket.gethostname() or not isinstance(pid, int) or pid == os.getpid() or start is None:
        return False
    if process_start(pid) != start:
        return False
    environ = process_environ(pid)
    return _attempt(environ) == attempt and environ.get("RANK") == str(beat.get("rank"))


def _write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _process_age() -> float:
    """Seconds since this process started (0 without /proc)."""
    start = process_start(os.getpid())
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError):
        return 0.0
    return max(0.0, uptime - start / os.sysconf("SC_CLK_TCK")) if start is not None else 0.0


def last_collectives(n: int = 8) -> list[str]:
    """The last `n` collectives this process issued, from torch's flight recorder (comparing the
    ranks' sequence numbers shows who is behind); a line saying why when there are none."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return ["(no process group)"]
    try:
        import pickle

        from torch._C._distributed_c10d import _dump_fr_trace

        entries = pickle.loads(_dump_fr_trace(includeCollectives=True, includeStackTraces=False,
                                              onlyActive=False)).get("entries", [])
    except Exception as e:  # noqa: BLE001 - a private torch API: report, never fail the dump
        return [f"(torch's flight recorder is not available: {type(e).__name__}: {e})"]
    if not entries:
        return ["(none recorded: TORCH_FR_BUFFER_SIZE=0)"]
    return [f"{e.get('profiling_name')} #{e.get('collective_seq_id')} in process group "
            f"{(e.get('process_group') or ('', '?'))[1]}: input sizes {e.get('input_sizes')}, "
            f"state {e.get('state')}" for e in entries[-n:]]


class Watchdog:
    def __init__(self, options: FaultConfig, rank: int, world: int, log_dir: str):
        self.options, self.rank, self.world, self.log_dir = options, rank, world, log_dir
        self.current = ("startup", 0, time.time())  # (section, step, wall time it began)
        self.longest: dict[str, float] = {}  # completed sections: the longest duration of each kind
        self.started = time.time()
        self.attempt = _attempt()
        self.start_ticks = process_start(os.getpid())
        self.process_started = self.started - _process_age()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def enter(self, section: str, step: int) -> None:
        """The training thread begins `section` at `step` (ends the previous one)."""
        now = time.time()
        previous, _, began = self.current
        if previous != "startup":
            self.longest[previous] = max(self.longest.get(previous, 0.0), now - began)
        self.current = (section, step, now)

    def timeout(self, section: str) -> float:
        o = self.options
        fixed = {"step": o.step_timeout_s, "save": o.save_timeout_s, "eval": o.eval_timeout_s}.get(section, 0.0)
        if fixed > 0:
            return fixed
        if section not in self.longest:
            return o.startup_timeout_s
        return max(o.min_timeout_s, o.timeout_factor * self.longest[section])

    def _key(self, section: str) -> str:
        return {"step": "step_timeout_s", "save": "save_timeout_s", "eval": "eval_timeout_s"}.get(
            section, "startup_timeout_s")

    # -- the watchdog thread --------------------------------------------------------------------

    def _heartbeat_path(self, rank: int) -> str:
        return os.path.join(self.log_dir, f"heartbeat-rank{rank}.json")

    def _beat(self) -> None:
        """Write the heartbeat; skipped while RUN/logs cannot be written (not created yet, disk full)."""
        section, step, began = self.current
        try:
            os.makedirs(self.log_dir, exist_ok=True)
            self._write_beat(section, step, began)
        except OSError:
            pass

    def _write_beat(self, section: str, step: int, began: float) -> None:
        _write_json(self._heartbeat_path(self.rank), {
            "rank": self.rank, "pid": os.getpid(), "start_ticks": self.start_ticks, "host": socket.gethostname(),
            "step": step, "section": section, "began": began, "beat": time.time(), "run_id": self.attempt[0],
            "restart": self.attempt[1], "store": self.attempt[2]})

    def _run(self) -> None:
        while not self._done.wait(POLL_S):
            self._beat()
            section, step, began = self.current
            waited = time.time() - began
            limit = self.timeout(section)
            if waited > limit:
                self.report_end(EXIT_HANG, f"no progress in section {section} of step {step}")
                self._expire(f"rank {self.rank}: no progress for {waited:.1f} s in section {section} of step {step} "
                             f"(fault.{self._key(section)}: {limit:g} s)")
            other = _read_json(os.path.join(self.log_dir, ENDED_FILE))
            if (isinstance(other, dict) and _of_attempt(other) == self.attempt
                    and other.get("time", 0) >= self.started and other.get("rank") != self.rank):
                where = f"this rank was {waited:.1f} s into section {section} of step {step}"
                if other.get("code") == EXIT_HANG:
                    self._expire(f"rank {self.rank}: rank {other['rank']} reported a hang; {where}")
                self._follow(other, where)

    def report_end(self, code: int, what: str) -> None:
        """Record that this rank ends the attempt with exit `code` (EXIT_HANG, or 2: bad input) for
        the other ranks' watchdogs (RUN/logs/ended.json; skipped when it cannot be written)."""
        with contextlib.suppress(OSError):
            os.makedirs(self.log_dir, exist_ok=True)
            _write_json(os.path.join(self.log_dir, ENDED_FILE), {
                "rank": self.rank, "run_id": self.attempt[0], "restart": self.attempt[1], "store": self.attempt[2],
                "time": time.time(), "code": code, "what": what[:2000]})

    def _follow(self, other: dict, where: str) -> None:
        """Another rank ended the attempt with bad input: end this rank with its code, rank 0 saying why."""
        code = other.get("code")
        if not isinstance(code, int) or code in (0, EXIT_HANG):
            return
        if self.rank == 0:
            sys.stdout.flush()
            print(f"error: rank {other['rank']}: {other.get('what', '(no message)')} (every rank exits with {code}; "
                  f"{where})", file=sys.stderr, flush=True)
        os._exit(code)

    def _expire(self, what: str) -> None:
        stacks = os.path.join(self.log_dir, f"stacks-rank{self.rank}.txt")
        try:
            with open(stacks, "w") as f:
                f.write(f"{what}\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
                f.write("\nThe last collectives this rank issued (torch's flight recorder; oldest first):\n"
                        + "".join(f"  {line}\n" for line in last_collectives()))
        except OSError as e:  # the stacks go to the console instead
            stacks = f"not written ({e}); on stderr"
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        first, frozen = self.stopped_first()
        sys.stdout.flush()
        print(f"hang: {what}; stopped first: {first}; stacks: {stacks}; exiting with {EXIT_HANG} "
              f"(restart from the last checkpoint)", file=sys.stderr, flush=True)
        self.kill_frozen(frozen)
        os._exit(EXIT_HANG)

    def kill_frozen(self, frozen: list[dict]) -> list[int]:
        """SIGKILL the frozen ranks' processes that are verifiably this attempt's workers on this
        host (worker_of_this_attempt); their PIDs."""
        killed = []
        for beat in frozen:
            if worker_of_this_attempt(beat, self.attempt):
                with contextlib.suppress(OSError):
                    os.kill(beat["pid"], signal.SIGKILL)
                    killed.append(beat["pid"])
        return killed

    def stopped_first(self) -> tuple[str, list[dict]]:
        """(which rank(s) stopped first, in words; the heartbeats of the frozen ones)."""
        now = time.time()
        beats = {}
        for r in range(self.world):
            beat = _read_json(self._heartbeat_path(r))
            if (isinstance(beat, dict) and _of_attempt(beat) == self.attempt
                    and isinstance(beat.get("beat"), (int, float))
                    and beat["beat"] >= self.process_started - FRESH_SLACK_S):
                beats[r] = beat
        missing = [r for r in range(self.world) if r not in beats]
        frozen = [b for r, b in sorted(beats.items()) if now - b["beat"] > FROZEN_AFTER_S]
        if frozen or missing:
            parts = [f"rank {b['rank']} (heartbeat not written for {now - b['beat']:.1f} s: frozen or dead; "
                     f"its last: step {b['step']}, section {b['section']})" for b in frozen]
            parts += [f"rank {r} (no heartbeat in this attempt)" for r in missing]
            return ", ".join(parts), frozen
        progress = {r: (b["step"], ORDER.get(b["section"], 0)) for r, b in beats.items()}
        behind = min(progress.values())
        ranks = [r for r, p in progress.items() if p == behind]
        if len(ranks) < len(beats):
            return ", ".join(f"rank {r} (behind the others: step {beats[r]['step']}, section {beats[r]['section']})"
                             for r in ranks), []
        latest = max(b["began"] for b in beats.values())
        last = [r for r, b in beats.items() if b["began"] == latest]
        return ", ".join(f"rank {r}" for r in last) + (
            f" (every rank is in section {beats[last[0]]['section']} of step {beats[last[0]]['step']}; "
            f"entered it last)"), []
