"""What a run may do to its run.dir and what a resume may change.

A run trains in a folder that does not exist yet, an empty one, or a run folder: one holding a
config.yaml, metrics.jsonl or checkpoints/ written by a run (a config.yaml with model and train
sections, a metrics.jsonl whose first record has a step, a checkpoints/ holding only checkpoint
folders), or nothing but the other files a run writes (a run that failed before writing
config.yaml, or a folder prepared with data_skips.json). Any other folder is refused with one
line naming it, before anything is written there (its config.yaml would be replaced, its
metrics.jsonl truncated); `lock_run_folder` checks it on the main rank and takes the run's lock.

A resume compares the checkpoint's train section with this run's: train.steps warns (the
learning-rate schedule changes), train.global_batch warns, or refuses where the data would not
continue exactly (data.row_streams, and families with carried state, lay one stream out per row
of the global batch).
"""
from __future__ import annotations

import json
import os
import re

import yaml

from megatron_taper.checkpoint.checkpointer import broadcast_from_main
from megatron_taper.checkpoint.folders import LEFTOVER, STEP_DIR
from megatron_taper.config import Config
from megatron_taper.launch_check import WRITE_PROBE
from megatron_taper.training.run_lock import RunLock
from megatron_taper.validation import ConfigError

MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints")
# everything else a run writes in its folder (megatron_taper/training, checkpoint, fault)
RUN_FILES = frozenset({*MARKERS, "tb", "logs", "wandb", "wandb_id", "data_skips.json", ".lock", "config.yaml.tmp",
                       "metrics.jsonl.tmp", "data_skips.json.tmp"})
ABANDONED = re.compile(r"^abandoned-step-\d+(-\d+)?$")  # checkpoint/folders.py set_aside_abandoned
READ_LIMIT = 1 << 20  # bytes of config.yaml / of metrics.jsonl's first line read to recognise them


class NotARunFolder(ConfigError):
    """run.dir is a folder of something else (nothing is written there, not even RUN/logs)."""


def check_run_folder(run_dir: str) -> None:
    """NotARunFolder when `run_dir` exists and is neither empty nor a run folder (module docstring)."""
    if not os.path.exists(run_dir):
        return
    if not os.path.isdir(run_dir):
        raise NotARunFolder(f"run.dir={run_dir} is a file, not a folder; give a new folder or a run's folder")
    entries = sorted(os.listdir(run_dir))
    foreign = [name for name in MARKERS if name in entries and not _ours(os.path.join(run_dir, name))]
    if not foreign and any(name in entries for name in MARKERS):
        return
    if not foreign:
        # every rank checks run.dir before joining; another rank's write check may be there meanwhile
        foreign = [name for name in entries if name not in RUN_FILES and not name.startswith(WRITE_PROBE)]
    if foreign:
        listed = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise NotARunFolder(f"run.dir={run_dir} is not a run folder (it holds {listed}, which no run wrote); nothing "
                            f"was written there: give a new or empty folder, or the folder of a run to resume")


def lock_run_folder(ctx, run_dir: str) -> RunLock | None:
    """Refuse a run.dir that is not a run folder, then lock it: the main rank's RunLock (None on
    the other ranks); every rank raises when another job holds it."""
    refused, not_a_run, lock = "", False, None
    if ctx.is_main:
        try:
            check_run_folder(run_dir)
            lock = RunLock(run_dir)
        except ConfigError as e:
            refused, not_a_run = str(e), isinstance(e, NotARunFolder)
    refused, not_a_run = broadcast_from_main(ctx, (refused, not_a_run))
    if refused:
        raise (NotARunFolder if not_a_run else ConfigError)(refused)
    return lock


def _ours(path: str) -> bool:
    """Whether a marker of MARKERS was written by a run."""
    name = os.path.basename(path)
    try:
        if name == "checkpoints":
            return os.path.isdir(path) and all(STEP_DIR.match(n) or LEFTOVER.match(n) or ABANDONED.match(n)
                                               for n in os.listdir(path))
        if not os.path.isfile(path):
            return False
        with open(path, "rb") as f:
            head = f.read(READ_LIMIT) if name == "config.yaml" else f.readline(READ_LIMIT)
        if name == "metrics.jsonl":
            return not head.strip() or isinstance(json.loads(head).get("step"), int)
        saved = yaml.safe_load(head)
        return isinstance(saved, dict) and isinstance(saved.get("model"), dict) and isinstance(saved.get("train"), dict)
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return False


def resume_changes(saved: dict, cfg: Config, step: int, row_streams: bool) -> list[str]:
    """Warnings for what this run changes against the checkpoint's config `saved` (its dict)
    at `step`; ConfigError for a change that cannot continue the run exactly."""
    t = cfg.train
    warnings = []
    saved_steps = saved["train"]["steps"]
    if saved_steps != t.steps:
        warnings.append(f"warning: train.steps changed from {saved_steps} (checkpoint) to {t.steps}: the learning-rate "
                        f"schedule (warmup + decay over train.steps) changes from step {step} on; to split a run into "
                        f"parts keep train.steps and set train.exit_after=N")
    saved_batch = saved["train"].get("global_batch", t.global_batch)
    if saved_batch != t.global_batch:
        if row_streams:
            raise ConfigError(f"train.global_batch={t.global_batch} differs from the checkpoint's {saved_batch}: "
                              f"data.row_streams gives each row of the global batch its own stream of windows (and "
                              f"carried state), so the data would not continue where it stopped; resume with "
                              f"train.global_batch={saved_batch}")
        warnings.append(f"warning: train.global_batch changed from {saved_batch} (checkpoint) to {t.global_batch}: "
                        f"from step {step} on each step consumes {t.global_batch} sequences instead of "
                        f"{saved_batch}; the data continues at the same sample of the same order (its position "
                        f"counts samples), while the learning-rate schedule counts steps and train.lr is not "
                        f"rescaled")
    return warnings
