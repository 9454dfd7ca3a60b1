"""One job per run folder: the main rank holds an exclusive lock on RUN/.lock while it trains.

The lock is flock(2) on the file, which the kernel releases when the holding process ends (also
by SIGKILL), so a dead job's lock is free for the next one without any cleanup, and torchrun's
in-job restart takes it over. The file names the holder (host, pid, Slurm job), which a refused
job prints. flock works on local filesystems and on NFSv4 (there as a POSIX lock); on a shared
filesystem without locking the lock is held by nobody and a second job is not refused.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from megatron_taper.validation import ConfigError

LOCK_FILE = ".lock"


class RunLock:
    """Taken on construction (ConfigError naming the holder when another process has it)."""

    def __init__(self, run_dir: str):
        self.fd: int | None = None  # (set first: __del__ runs after a failed __init__ too)
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, LOCK_FILE)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self.fd, 4096, 0).decode("utf-8", "replace").strip() or "unknown"
            os.close(self.fd)
            self.fd = None
            raise ConfigError(f"run.dir={run_dir} is in use by another job ({self.path}: {holder}); wait for it to "
                              f"end or use another run.dir") from None
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job": os.environ.get("SLURM_JOB_ID"),
                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps(holder).encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.release()
