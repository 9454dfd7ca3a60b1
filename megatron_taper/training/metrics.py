"""Run metrics: metrics.jsonl (one JSON object per record), tensorboard scalars, Weights & Biases.

Only the main rank writes. Floats go to JSON with full precision (Python's repr round-trips), so
two runs can be compared exactly. On resume the records after the checkpoint's step are dropped
first, so the file reads as if the run had never stopped.

metrics.jsonl keeps flat keys (`loss`, `eval_loss`, `tokens_per_s`, ...); tensorboard and wandb
get the same numbers under grouped names (`scalar_tag`): eval_* -> eval/* (eval_loss/<source>
-> eval/loss/<source>), the timing and memory keys in PERF_KEYS -> perf/*, a key that already has
a group (mix/<source>) keeps it, everything else -> train/*.

read_metrics is the one reader of a metrics.jsonl (sweeps, the quickstart, benchmarks, tests, and
the resume's truncation above): a torn last line (a process killed mid-write: no newline, not
JSON) is skipped with a warning naming the file and line; a line longer than MAX_LINE_BYTES is
skipped with a warning, read in pieces of at most that size (a metrics record is a few KB; a 100
MB line parsed whole took ~4.75 GB); any other line that is not a JSON object is a ValueError
naming the file and line. Torch-free.
"""
from __future__ import annotations

import json
import math
import os
import time
import uuid
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_taper.config import WandbConfig

# keys measured rather than computed: they differ between two runs of the same config
PERF_KEYS = ("tokens_per_s", "step_time_s", "mfu", "peak_memory_gb", "ready_s_min", "ready_s_median", "ready_s_max",
             "ready_s_max_rank")
WANDB_ID_FILE = "wandb_id"
MAX_LOSS_FOR_PPL = 50.0  # exp() of larger losses overflows nothing useful; ppl is capped there


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(MAX_LOSS_FOR_PPL): the one rule for the trainer, evaluation and sweeps."""
    return math.exp(min(loss, MAX_LOSS_FOR_PPL))


def timestamp() -> str:
    """Local wall-clock time as the console lines start with it."""
    return time.strftime("%Y-%m-%d %H:%M:%S")


def scalar_tag(key: str) -> str:
    """The tensorboard tag / wandb key of a metrics.jsonl key."""
    if key.startswith("eval_"):
        return "eval/" + key.removeprefix("eval_")
    if "/" in key:
        return key
    if key in PERF_KEYS:
        return "perf/" + key
    return "train/" + key


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a record (not its step) under their grouped tags."""
    return {scalar_tag(k): v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class MetricsLogger:
    def __init__(self, run_dir: str, enabled: bool, tensorboard: bool = True,
                 wandb: WandbConfig | None = None, config: dict[str, Any] | None = None):
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._file = None
        self._tb = None
        # created at the first record, so a run refused before training (a refused resume) leaves no event file
        self._tb_dir = os.path.join(run_dir, "tb") if enabled and tensorboard else None
        self._wandb = None
        if not enabled:
            return
        if wandb is not None and wandb.enabled:
            self._wandb = start_wandb(wandb, run_dir, config or {})

    @property
    def wandb_dir(self) -> str | None:
        """The local folder of the wandb run (offline: the one `wandb sync` uploads), if any."""
        return None if self._wandb is None else os.path.dirname(self._wandb.dir)

    def truncate_after(self, step: int) -> None:
        """Drop records of steps > step (left by a run that stopped after its last checkpoint)."""
        if not self.enabled or not os.path.exists(self.path):
            return
        if self._file is not None:  # a rollback during the run: the next record reopens the new file
            self._file.close()
            self._file = None
        kept = [json.dumps(r, allow_nan=True) + "\n" for r in read_metrics(self.path) if r.get("step", 0) <= step]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)
        if self._tensorboard() is not None:
            self._tb.add_text("resume", f"resumed after step {step}", step)

    def log(self, record: dict[str, Any], console: str | None = None) -> None:
        """Write `record` everywhere; `console`: also print this line, after a timestamp."""
        if not self.enabled:
            return
        if self._file is None:
            self._file = open(self.path, "a")
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()
        values = scalars(record)
        if self._tensorboard() is not None:
            for tag, value in values.items():
                self._tb.add_scalar(tag, value, record["step"])
        if self._wandb is not None and values:
            self._wandb.log(values, step=record["step"])
        if console:
            print(f"{timestamp()} {console}", flush=True)

    def _tensorboard(self):
        """The tensorboard writer (None when off), created on first use."""
        if self._tb is None and self._tb_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(self._tb_dir)
        return self._tb

    def close(self) -> None:
        self._tb_dir = None  # a closed logger writes nothing more
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def start_wandb(options: WandbConfig, run_dir: str, config: dict[str, Any]):
    """A wandb run writing under RUN/wandb/; a resumed run continues the same wandb run (its id
    is kept in RUN/wandb_id). wandb is imported only here: it is an optional dependency."""
    try:
        import wandb
    except ImportError as e:
        raise ImportError("run.wandb.enabled=true needs the wandb package: pip install 'megatron_taper[wandb]'") from e
    id_file = os.path.join(run_dir, WANDB_ID_FILE)
    if os.path.exists(id_file):
        with open(id_file) as f:
            run_id = f.read().strip()
    else:
        run_id = uuid.uuid4().hex[:12]
        with open(id_file, "w") as f:
            f.write(run_id + "\n")
    name = options.name or os.path.basename(os.path.normpath(run_dir))
    # console="off": wandb does not wrap stdout / stderr (the console stays ours)
    return wandb.init(project=options.project, entity=options.entity or None, name=name,
                      group=options.group or None, mode=options.mode, dir=run_dir, id=run_id, resume="allow",
                      config=config, settings=wandb.Settings(console="off", silent=True))


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
