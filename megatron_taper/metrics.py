"""Run metrics: a console line, metrics.jsonl (one JSON object per record) and tensorboard scalars.

Only the main rank writes. Floats go to JSON with full precision (Python's repr round-trips), so
two runs can be compared exactly. On resume the records after the checkpoint's step are dropped
first, so the file reads as if the run had never stopped.
"""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Any


class MetricsLogger:
    def __init__(self, run_dir: str, enabled: bool, tensorboard: bool = True):
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._file = None
        self._tb = None
        if not enabled:
            return
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(run_dir, "tb"))

    def truncate_after(self, step: int) -> None:
        """Drop records of steps > step (left by a run that stopped after its last checkpoint)."""
        if not self.enabled or not os.path.exists(self.path):
            return
        kept = []
        with open(self.path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    break  # a torn last line from a killed process
                if record.get("step", 0) <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)
        if self._tb is not None:
            self._tb.add_text("resume", f"resumed after step {step}", step)

    def log(self, record: dict[str, Any], console: str | None = None) -> None:
        if not self.enabled:
            return
        if self._file is None:
            self._file = open(self.path, "a")
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = record["step"]
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
        if console:
            print(console, file=sys.stdout, flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
