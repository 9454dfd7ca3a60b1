"""Checkpoints that resume exactly and load on another parallel layout.

Layout of `run.dir/checkpoints/step-N/`:
    model-pp{k}.pt   logical (unsharded) parameters of pipeline stage k, keyed by global name
    optim-pp{k}.pt   AdamW state of those parameters, logical tensors keyed by the same names
    trainer.pt       step, skipped steps, RNG states and data positions (one entry per rank)
    deepspeed/...    parallel.zero=deepspeed only: DeepSpeed's own files (same dp/tp size only)
    meta.json        step, config, parallel layout, and size + sha256 of every file above

Writing is atomic: every file goes into `.tmp-step-N/` and is fsynced, then the folder is
renamed to `step-N/` and the parent fsynced, so a folder named step-N is always complete. Only
ranks with dp_rank == 0 and tp_rank == 0 write model/optimizer files (one per pipeline stage);
tensor-parallel shards are gathered to logical tensors through the ParallelModel first (and ZeRO
shards over dp: then every dp rank takes part in the gather; see parallel/zero.py). An engine
with a format of its own (DeepSpeed) adds it next to the logical files through
`pm.save_native` / `pm.load_native`; the logical files are what loads on another layout.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from megatron_taper.config import ModelConfig
from megatron_taper.parallel.model import ParallelModel

if TYPE_CHECKING:
    from megatron_taper.config import CheckpointConfig

STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the folder or file."""


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Complete checkpoints as (step, path), oldest first."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, name)) for name in os.listdir(root) if (m := STEP_DIR.match(name))]
    return sorted(found)


def save_checkpoint(root: str, options: CheckpointConfig, config: dict, pm: ParallelModel,
                    optimizer: torch.optim.Optimizer, step: int, trainer_state: dict, data_state: dict) -> str:
    """Write `root`/step-N (a collective: every rank calls it); `config` is the resolved run
    config, stored in meta.json; keeps the newest `options.keep` checkpoints."""
    ctx = pm.ctx
    final = os.path.join(root, f"step-{step}")
    tmp = os.path.join(root, f".tmp-step-{step}")
    if ctx.is_main:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    per_rank = _gather_objects(ctx, {"rng": _rng_state(), "data": data_state})
    ctx.barrier()

    files: dict[str, dict] = {}
    if ctx.dp_rank == 0 or pm.gathers_on_every_dp_rank:
        model_state, optim_state = pm.logical_state(optimizer)
        if ctx.dp_rank == 0 and ctx.tp_rank == 0:
            for kind, state in (("model", model_state), ("optim", optim_state)):
                name = f"{kind}-pp{ctx.pp_rank}.pt"
                files[name] = _write(os.path.join(tmp, name), state)
    if pm.save_native(tmp):  # an engine's own files (DeepSpeed), next to the logical ones
        ctx.barrier()
        if ctx.is_main:
            files.update(_hash_tree(tmp, skip=set(files)))
    if ctx.is_main:
        trainer = {"step": step, **trainer_state, "ranks": per_rank}
        files["trainer.pt"] = _write(os.path.join(tmp, "trainer.pt"), trainer)
    all_files: dict[str, dict] = {}
    for part in _gather_objects(ctx, files):
        all_files.update(part)
    if ctx.is_main:
        meta = {"step": step, "config": config, "layout": {"pp": ctx.pp, "dp": ctx.dp, "tp": ctx.tp},
                "files": all_files}
        _write_text(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1))
        _fsync_dir(tmp)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        _prune(root, options.keep)
    ctx.barrier()
    return final


def find_resume_checkpoint(mode: str, root: str) -> str | None:
    """The checkpoint run.resume=`mode` names: auto = the newest complete one under `root` (None
    when there is none), never = None, else the folder given."""
    if mode == "never":
        return None
    if mode != "auto":
        if not os.path.isfile(os.path.join(mode, "meta.json")):
            raise CheckpointError(f"run.resume={mode!r} is not a complete checkpoint folder (no meta.json)")
        return mode
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def load_checkpoint(path: str, model_cfg: ModelConfig, pm: ParallelModel, optimizer: torch.optim.Optimizer) -> dict:
    """Restore model, optimizer, RNG; returns the trainer state (step, ..., data state of this rank)."""
    ctx = pm.ctx
    meta = verify_checkpoint(path)
    _check_compatible(meta, model_cfg, path)
    if not pm.load_native(path, meta):
        model_state, optim_state = load_logical(path, meta)
        pm.load_logical_state(optimizer, model_state, optim_state,
                              missing=lambda name: CheckpointError(f"{path}: no tensor for parameter {name!r}"))

    trainer = _load(os.path.join(path, "trainer.pt"))
    ranks = trainer.pop("ranks")
    mine = ranks[ctx.rank] if len(ranks) == ctx.world_size else ranks[0]
    _set_rng_state(mine["rng"])
    same_dp = meta["layout"]["dp"] == ctx.dp and len(ranks) == ctx.world_size
    trainer["data"] = mine["data"] if same_dp else ranks[0]["data"]
    return trainer


def load_logical(path: str, meta: dict | None = None) -> tuple[dict, dict]:
    """All stages' logical parameters and optimizer state of a checkpoint, keyed by name (CPU)."""
    meta = meta or _read_meta(path)
    model_state: dict[str, torch.Tensor] = {}
    optim_state: dict[str, dict] = {}
    for name in sorted(n for n in meta["files"] if n.startswith("model-pp")):
        model_state.update(_load(os.path.join(path, name)))
        optim_state.update(_load(os.path.join(path, name.replace("model-", "optim-"))))
    return model_state, optim_state


def verify_checkpoint(path: str) -> dict:
    """Check every file of a checkpoint against meta.json; returns the metadata."""
    meta = _read_meta(path)
    for name, info in meta["files"].items():
        _verify(os.path.join(path, name), info)
    return meta


def _hash_tree(root: str, skip: set[str]) -> dict[str, dict]:
    """size + sha256 of every file under root (relative names), except `skip`."""
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            file = os.path.join(folder, name)
            rel = os.path.relpath(file, root)
            if rel not in skip:
                out[rel] = {"size": os.path.getsize(file), "sha256": _sha256(file)}
    return out


def _check_compatible(meta: dict, model_cfg: ModelConfig, path: str) -> None:
    # keys added to the config after the checkpoint was written count with their default value
    saved_cfg = ModelConfig(arch=model_cfg.arch).architecture_dict()
    saved = {**_flatten(saved_cfg), **_flatten(meta["config"]["model"])}
    current = _flatten(model_cfg.architecture_dict())
    diffs = [f"model.{k}: checkpoint {saved.get(k)!r} vs now {v!r}" for k, v in current.items() if saved.get(k) != v]
    if diffs:
        raise CheckpointError(f"{path} was written for another model; differing keys:\n  " + "\n  ".join(diffs))


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _read_meta(path: str) -> dict:
    meta_path = os.path.join(path, "meta.json")
    try:
        with open(meta_path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_path}: unreadable checkpoint metadata ({e}); delete the folder or set "
                              f"run.resume to another checkpoint") from None


def _verify(file: str, info: dict) -> None:
    if not os.path.isfile(file):
        raise CheckpointError(f"{file}: missing from the checkpoint")
    size = os.path.getsize(file)
    if size != info["size"]:
        raise CheckpointError(f"{file}: truncated or altered ({size} bytes, expected {info['size']}); delete the "
                              f"checkpoint folder or set run.resume to another one")
    if _sha256(file) != info["sha256"]:
        raise CheckpointError(f"{file}: corrupted (checksum mismatch); delete the checkpoint folder or set "
                              f"run.resume to another one")


def _load(file: str):
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means an unusable file
        raise CheckpointError(f"{file}: cannot be loaded ({type(e).__name__}: {e})") from None


def _write(file: str, obj) -> dict:
    with open(file, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return {"size": os.path.getsize(file), "sha256": _sha256(file)}


def _write_text(file: str, text: str) -> None:
    with open(file, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _sha256(file: str) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(root: str, keep: int) -> None:
    if keep <= 0:
        return
    for _, path in list_checkpoints(root)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def _gather_objects(ctx, obj) -> list:
    if ctx.mesh is None:
        return [obj]
    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return _to_plain(state)


def _set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np.asarray(np_state[1], dtype=np.uint32), *np_state[2:]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _to_plain(obj):
    """numpy arrays -> lists so that weights_only loading accepts the RNG states."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (list, tuple)):
        return [_to_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    return obj
