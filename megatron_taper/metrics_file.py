"""Reading a run's metrics.jsonl: the one reader for every tool that reads it (sweeps, the
quickstart, benchmarks, tests).

A record is one JSON object per line. A torn last line (a process killed mid-write: no newline,
not JSON) is skipped with a warning naming the file and line; a line longer than MAX_LINE_BYTES
is skipped with a warning, read in pieces of at most that size (a metrics record is a few KB; a
100 MB line parsed whole took ~4.75 GB); any other line that is not a JSON object is a
ValueError naming the file and line. Torch-free.
"""
from __future__ import annotations

import json
import os
import warnings

MAX_LINE_BYTES = 1 << 20  # 1 MiB: far above any record the trainer writes


def read_metrics(path: str | os.PathLike, max_line_bytes: int = MAX_LINE_BYTES) -> list[dict]:
    """The records of the metrics.jsonl at `path`, in file order (blank lines ignored)."""
    records = []
    with open(path, "rb") as f:
        lineno = 0
        while True:
            raw = f.readline(max_line_bytes + 1)
            if not raw:
                break
            lineno += 1
            if len(raw) > max_line_bytes:
                length = len(raw)
                while not raw.endswith(b"\n") and raw:
                    raw = f.readline(max_line_bytes + 1)
                    length += len(raw)
                warnings.warn(f"{path}:{lineno}: a line of {length} bytes, over the {max_line_bytes}-byte cap of a "
                              f"metrics record: skipped", stacklevel=2)
                continue
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except ValueError:
                record = None
            if isinstance(record, dict):
                records.append(record)
            elif not raw.endswith(b"\n"):  # readline stops without a newline only at the end
                warnings.warn(f"{path}:{lineno}: a torn last line (a run killed while writing it?): skipped",
                              stacklevel=2)
            else:
                raise ValueError(f"{path}:{lineno}: not a JSON object: {raw[:80]!r}"
                                 + ("..." if len(raw) > 80 else ""))
    return records
