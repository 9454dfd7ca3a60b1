"""The checkpoints folder of a run (`run.dir/checkpoints/`): which folders are checkpoints, which
one a resume may load, and what a save sets aside and prunes.

    step-N/                  a complete checkpoint (renamed from `.tmp-step-N/` once written)
    .tmp-step-N/             an unfinished save: never loaded, removed after the next save
    .trash-NAME-K/           a folder a save replaced, set aside to be deleted off the step
    abandoned-step-N[-K]/    a checkpoint of a branch the run left by resuming from an earlier
                             step: never resumed from, never pruned, never deleted by us

Deleting (`remove_all`) runs in the Checkpointer's background thread; everything else here is a
listing or a rename, done by the main rank.
"""
from __future__ import annotations

import os
import re
import shutil

from megatron_taper.checkpoint.files import CheckpointError

STEP_DIR = re.compile(r"^step-(\d+)$")
# what an unfinished save or a replaced folder leaves (`trash_name`): removed only in a run's checkpoints/
LEFTOVER = re.compile(r"^\.(tmp-step-\d+|trash-(\.tmp-)?step-\d+-\d+)$")


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Complete checkpoints as (step, path), oldest first."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, name)) for name in os.listdir(root) if (m := STEP_DIR.match(name))]
    return sorted(found)


def resume_candidates(mode: str, root: str) -> list[str]:
    """The checkpoints run.resume=`mode` may load, best first: auto = the complete ones under
    `root`, newest first (none: a fresh start); never = none; else the one folder given."""
    if mode == "never":
        return []
    if mode != "auto":
        if not os.path.isfile(os.path.join(mode, "meta.json")):
            raise CheckpointError(f"run.resume={mode!r} is not a complete checkpoint folder (no meta.json)")
        return [mode]
    return [path for _, path in reversed(list_checkpoints(root))]


def trash_name(root: str, path: str) -> str:
    """A free name in `root` to rename `path` to before deleting it (`.trash-NAME-K`)."""
    n = 0
    while os.path.exists(aside := os.path.join(root, f".trash-{os.path.basename(path)}-{n}")):
        n += 1
    return aside


def set_aside_abandoned(root: str, step: int) -> list[str]:
    """Complete checkpoints of steps after `step` (just saved) are an abandoned branch: renamed
    abandoned-step-N (not a checkpoint name: auto-resume and pruning skip it). Their new names."""
    names = []
    for later, path in list_checkpoints(root):
        if later > step:
            n, aside = 0, os.path.join(root, f"abandoned-step-{later}")
            while os.path.exists(aside):
                n += 1
                aside = os.path.join(root, f"abandoned-step-{later}-{n}")
            os.rename(path, aside)
            names.append(os.path.basename(aside))
    return names


def leftovers(root: str) -> list[str]:
    """The leftovers of unfinished saves and replaced folders (LEFTOVER) in `root`, when it is a
    run's checkpoints folder (RUN/checkpoints beside RUN/config.yaml); [] anywhere else."""
    parent = os.path.dirname(os.path.abspath(root))
    if os.path.basename(os.path.abspath(root)) != "checkpoints" or not os.path.isfile(
            os.path.join(parent, "config.yaml")):
        return []
    return [os.path.join(root, n) for n in os.listdir(root) if LEFTOVER.match(n)]


def to_prune(root: str, keep: int, keep_every: int = 0) -> list[str]:
    """The complete checkpoints beyond the newest `keep` (keep <= 0: none), except those whose
    step is a multiple of `keep_every` (> 0)."""
    older = list_checkpoints(root)[:-keep] if keep > 0 else []
    return [path for step, path in older if not (keep_every > 0 and step % keep_every == 0)]


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def remove_all(paths: list[str]) -> None:
    for path in paths:
        remove_tree(path)
