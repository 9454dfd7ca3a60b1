"""Checkpoints that resume exactly, load on another parallel layout, and cost each rank its shard.

Layout of `run.dir/checkpoints/step-N/` (format 2):
    shards/rank-R.safetensors   the boxes of parameters and AdamW state that rank R owns, as
                                records of the logical tensors (checkpoint/files.py)
    trainer.pt                  step, skipped steps, RNG states and data positions (one entry per rank)
    deepspeed/...               parallel.zero=deepspeed only: DeepSpeed's own files (same dp/tp size)
    meta.json                   format, step, config, layout, the index of every record (full shape,
                                box, sha256) and the size of every file (+ sha256 of trainer.pt and
                                DeepSpeed's files)

Saving: each rank copies its own pieces to the CPU (no communication, except DeepSpeed's gather of
logical tensors) and writes one file; rank 0 gathers the small per-rank indexes (a gather to rank
0, not an all-gather), writes meta.json last, and renames `.tmp-step-N/` to `step-N/` (fsynced),
so a folder named step-N is complete. Rank 0 never deletes while the others wait in a
collective: a folder to replace is renamed aside, and deleting it, leftovers of unfinished saves
(`.tmp-step-N`, and `.trash-...` folders set aside; only in a run's checkpoints folder, beside its
config.yaml) and checkpoints beyond `checkpoint.keep` (except the multiples of
`checkpoint.keep_every`) runs in a thread after the barrier. A run that resumed from an earlier
step leaves a branch behind: at its first save, checkpoints of later steps are renamed
`abandoned-step-N` with a warning (never resumed from, never pruned, never deleted by us). The names,
listings and renames of the checkpoints folder live in checkpoint/folders.py.
With `checkpoint.async_save`, the writing runs in a background thread after the copy (from a GPU:
non-blocking copies into pinned buffers kept for the next save, ParallelModel.checkpoint_pieces);
once the Trainer's per-step vote (training/stop.py) says every rank has written, `finalise` renames
the folder. A kill before that leaves only a `.tmp-` folder, which is never loaded (and removed
after the next save); the previous checkpoint stays the newest.

Loading: every rank reads from the records only the boxes of its own parameters and state
(`CheckpointReader`, each record's sha256 checked as it is read), so a resume reads about the rank's
shard at the same layout, and the overlapping records at another (pp, dp, tp) layout or engine.
An engine's own files (DeepSpeed's) are verified by the ranks that read them, each its own.
With `run.resume=auto` a newest checkpoint that fails verification on any rank is skipped with a
warning naming the file, and the next older one is loaded; an explicit `run.resume=PATH` refuses.
Format 1 checkpoints (logical per-stage files model-ppK.pt / optim-ppK.pt) still load, every rank
reading all of them.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import threading
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from megatron_taper.checkpoint.files import (
    FORMAT,
    CheckpointError,
    CheckpointReader,
    fsync_file,
    merge_index,
    write_pieces,
)
from megatron_taper.checkpoint.folders import (
    checkpoint_root,
    leftovers,
    list_checkpoints,
    remove_all,
    resume_candidates,
    set_aside_abandoned,
    to_prune,
    trash_name,
)
from megatron_taper.config import ModelConfig
from megatron_taper.parallel.model import ParallelModel
from megatron_taper.validation import inside_folder

if TYPE_CHECKING:
    from megatron_taper.config import CheckpointConfig

__all__ = ["CheckpointError", "CheckpointWriteError", "Checkpointer", "checkpoint_root", "list_checkpoints",
           "resume_candidates", "load_checkpoint", "load_logical", "verify_checkpoint", "broadcast_from_main"]

@dataclass
class _Pending:
    step: int
    tmp: str
    final: str
    config: dict
    thread: threading.Thread
    result: dict  # filled by the thread: index, files, error


class Checkpointer:
    """Saves (synchronously or in the background) and loads the checkpoints of one run folder.

    Every method is a collective: every rank calls it at the same step."""

    def __init__(self, root: str, options: CheckpointConfig, pm: ParallelModel):
        self.root, self.options, self.pm, self.ctx = root, options, pm, pm.ctx
        self.pending: _Pending | None = None
        self.cleanups: list[threading.Thread] = []  # the main rank's deletions, off the step
        self.bytes_read = 0  # of parameter and optimizer records by this rank's last load
        self.before_write: Callable[[int], None] | None = None  # called with the step in the writer

    # -- saving --------------------------------------------------------------------------------

    def save(self, optimizer: torch.optim.Optimizer, step: int, config: dict, trainer_state: dict,
             data_state: dict) -> None:
        """Write step-N; with options.async_save only the copy to the CPU happens before returning."""
        self.wait()
        ctx = self.ctx
        tmp, final = os.path.join(self.root, f".tmp-step-{step}"), os.path.join(self.root, f"step-{step}")
        if ctx.is_main:
            os.makedirs(self.root, exist_ok=True)
            if os.path.exists(tmp):  # a leftover of this very step: moved aside (deleted off the step)
                os.rename(tmp, trash_name(self.root, tmp))
            os.makedirs(tmp)
        per_rank = _gather_to_main(ctx, {"rng": _rng_state(), "data": data_state})
        ctx.barrier()
        pieces = self.pm.checkpoint_pieces(optimizer, copy=self.options.async_save)
        native: dict[str, dict] = {}
        native_dir = self.pm.save_native(tmp)  # an engine's own files (DeepSpeed), synchronously
        if native_dir is not None:
            ctx.barrier()
            if ctx.is_main:  # only that folder: the other ranks are already writing their pieces beside it
                native = {os.path.join(native_dir, rel): entry
                          for rel, entry in _hash_tree(os.path.join(tmp, native_dir)).items()}
        trainer = {"step": step, **trainer_state, "ranks": per_rank} if ctx.is_main else None
        result: dict[str, Any] = {}

        def write() -> None:
            try:
                if self.before_write is not None:
                    self.before_write(step)
                index, files = write_pieces(tmp, ctx.rank, pieces)
                if trainer is not None:
                    files["trainer.pt"] = _write(os.path.join(tmp, "trainer.pt"), trainer)
                    files.update(native)
                result.update(index=index, files=files)
            except Exception as e:  # noqa: BLE001 - reported on every rank at finalisation
                result["error"] = f"{type(e).__name__}: {e}"

        thread = threading.Thread(target=write, name=f"checkpoint-step-{step}", daemon=True)
        self.pending = _Pending(step, tmp, final, config, thread, result)
        thread.start()
        if not self.options.async_save:
            self.wait()

    def saving(self) -> tuple[int, bool] | None:
        """(step, written by this rank) of the pending background save; None when none is pending."""
        return None if self.pending is None else (self.pending.step, not self.pending.thread.is_alive())

    def finalise(self, step: int) -> None:
        """Complete the background save of `step`, which every rank has written (the Trainer's vote
        says so, training/stop.py); nothing when a later save or a rollback already waited for it."""
        if self.pending is not None and self.pending.step == step:
            self._finalise()

    def wait(self) -> None:
        """Block until a pending save is complete and visible."""
        if self.pending is not None:
            self.pending.thread.join()
            self._finalise()

    def _finalise(self) -> None:
        """Index gathered to the main rank (not to all), meta.json, rename; the main rank does
        nothing slow while the others wait: a replaced folder is renamed aside, and deleting it,
        the leftovers of unfinished saves and the checkpoints beyond options.keep happens in a
        background thread after the barrier."""
        p, ctx = self.pending, self.ctx
        self.pending = None
        p.thread.join()
        results = _gather_to_main(ctx, p.result)
        errors = None
        if ctx.is_main:
            errors = "; ".join(f"rank {r}: {res['error']}" for r, res in enumerate(results) if "error" in res)
        errors = broadcast_from_main(ctx, errors)
        if errors:
            raise CheckpointWriteError(f"{p.tmp}: writing the checkpoint failed: " + errors)
        doomed: list[str] = []
        if ctx.is_main:
            files: dict[str, dict] = {}
            for res in results:
                files.update(res["files"])
            meta = {"format": FORMAT, "step": p.step, "config": p.config,
                    "layout": {"pp": ctx.pp, "dp": ctx.dp, "cp": ctx.cp, "tp": ctx.tp},
                    "tensors": merge_index([res["index"] for res in results]), "files": files}
            _write_text(os.path.join(p.tmp, "meta.json"), json.dumps(meta))
            fsync_file(p.tmp)
            if os.path.exists(p.final):
                aside = trash_name(self.root, p.final)
                os.rename(p.final, aside)
                doomed.append(aside)
            os.rename(p.tmp, p.final)
            set_aside = set_aside_abandoned(self.root, p.step)
            fsync_file(self.root)
            if set_aside:
                warnings.warn(f"checkpoints newer than step {p.step} belong to a branch this run left (it resumed "
                              f"from an earlier step): renamed to {', '.join(set_aside)} so that neither resume "
                              f"nor pruning takes them; delete them when they are not wanted", stacklevel=2)
            doomed += to_prune(self.root, self.options.keep, self.options.keep_every)
            doomed += [path for path in leftovers(self.root) if path not in doomed]
        ctx.barrier()
        if doomed:  # not a daemon: the interpreter finishes it before exiting
            self.cleanups = [t for t in self.cleanups if t.is_alive()]
            self.cleanups.append(threading.Thread(target=remove_all, args=(doomed,), name="checkpoint-prune"))
            self.cleanups[-1].start()

    def join_cleanup(self) -> None:
        """Wait for the main rank's background deletions."""
        for thread in self.cleanups:
            thread.join()
        self.cleanups = []

    # -- loading -------------------------------------------------------------------------------

    def load(self, candidates: list[str], model_cfg: ModelConfig, optimizer: torch.optim.Optimizer,
             explicit: bool) -> tuple[str, dict] | None:
        """Load the first candidate that every rank verifies: (path, trainer state of this rank).
        None when there are no candidates. A failing candidate is an error when `explicit`, else
        skipped with a warning. The candidates are rank 0's on every rank: a rank whose listing of a
        shared folder lags (NFS right after a restart) would otherwise resume another step."""
        listed = _gather_objects(self.ctx, list(candidates))
        if any(other != listed[0] for other in listed):
            lagging = [rank for rank, other in enumerate(listed) if other != listed[0]]
            if self.ctx.is_main:
                warnings.warn(f"ranks {lagging} list other checkpoints than rank 0 (newest {listed[lagging[0]][:1]} "
                              f"against {listed[0][:1]}: a shared filesystem's listing lagging?); every rank "
                              f"follows rank 0's", stacklevel=2)
            candidates = listed[0]
        first_error = ""
        for path in candidates:
            error, other_model = "", False
            try:
                state = load_checkpoint(path, model_cfg, self.pm, optimizer, self)
            except CheckpointError as e:
                error, state, other_model = str(e), None, isinstance(e, OtherModelError)
            errors = [e for e in _gather_objects(self.ctx, (error, other_model)) if e[0]]
            if not errors:
                return path, state
            if explicit or any(other for _, other in errors):  # an older one is for that model too
                raise CheckpointError(errors[0][0])
            errors = [e for e, _ in errors]
            first_error = first_error or errors[0]
            if self.ctx.is_main:
                warnings.warn(f"skipping checkpoint {path}: {errors[0]}", stacklevel=2)
        if candidates and not explicit:
            raise CheckpointError(f"no checkpoint under {self.root} passes verification (newest: {first_error}); "
                                  f"move the folders away or set run.resume=never to start over")
        return None


class CheckpointWriteError(RuntimeError):
    """Writing a checkpoint failed on some rank (disk full, an I/O error): a failure of the run
    (exit 1; launch/torchrun.sh restarts the workers from the previous checkpoint), not bad input."""


class OtherModelError(CheckpointError):
    """A checkpoint written for another model configuration (never skipped by run.resume=auto)."""


def load_checkpoint(path: str, model_cfg: ModelConfig, pm: ParallelModel, optimizer: torch.optim.Optimizer,
                    checkpointer: Checkpointer | None = None) -> dict:
    """Restore model, optimizer, RNG from one checkpoint (no collectives, except in an engine's own
    load: DeepSpeed's); returns the trainer state (step, ..., data state of this rank) and the
    config it was saved with ("config").
    Raises CheckpointError naming the bad file."""
    ctx = pm.ctx
    meta = _read_meta(path)
    if "trainer.pt" not in meta["files"]:
        raise CheckpointError(f"{os.path.join(path, 'meta.json')}: lists no trainer.pt (not a training checkpoint, "
                              f"or an incomplete one)")
    _check_compatible(meta, model_cfg, path)
    def verify(name: str) -> None:  # an engine's own file this rank reads
        if name not in meta["files"]:
            raise CheckpointError(f"{os.path.join(path, name)}: not listed in meta.json")
        _verify(os.path.join(path, name), meta["files"][name])

    if not pm.load_native(path, meta, verify):
        if meta.get("format", 1) >= 2:
            reader = CheckpointReader(path, meta["tensors"], meta["files"])
            pm.load_pieces(optimizer, reader)
            if checkpointer is not None:
                checkpointer.bytes_read = reader.bytes_read
        else:
            for name, info in meta["files"].items():
                _verify(os.path.join(path, name), info)
            model_state, optim_state = load_logical(path, meta)
            pm.load_logical_state(optimizer, model_state, optim_state,
                                  missing=lambda name: CheckpointError(f"{path}: no tensor for parameter {name!r}"))
    _verify(os.path.join(path, "trainer.pt"), meta["files"]["trainer.pt"])
    trainer = _load(os.path.join(path, "trainer.pt"))
    ranks = trainer.pop("ranks")
    mine = ranks[ctx.rank] if len(ranks) == ctx.world_size else ranks[0]
    _set_rng_state(mine["rng"])
    same_dp = meta["layout"]["dp"] == ctx.dp and len(ranks) == ctx.world_size
    trainer["data"] = mine["data"] if same_dp else ranks[0]["data"]
    trainer["config"] = meta["config"]  # the run config it was written with (not part of the saved state)
    return trainer


EXPORTED_WEIGHTS, EXPORTED_CONFIG = "model.safetensors", "config.yaml"  # tools/convert_checkpoint.py


@torch.no_grad()
def load_weights_only(path: str, model_cfg: ModelConfig, pm: ParallelModel) -> str:
    """run.init_from: this rank's pieces of the parameters of a checkpoint (a step-N folder, or a
    run folder: its newest) or of an exported folder (model.safetensors + config.yaml), for a model
    of the same configuration; optimizer state, step and data position are not read. Returns the
    folder read. No collectives."""
    from megatron_taper.parallel.model import local_part

    if not os.path.isdir(path):
        raise CheckpointError(f"run.init_from={path!r}: no such folder")
    if not os.path.isfile(os.path.join(path, "meta.json")) and list_checkpoints(checkpoint_root(path)):
        path = list_checkpoints(checkpoint_root(path))[-1][1]
    if os.path.isfile(os.path.join(path, "meta.json")):
        meta = _read_meta(path)
        _check_compatible(meta, model_cfg, path, init=True)
        if meta.get("format", 1) >= 2:
            reader = CheckpointReader(path, meta["tensors"], meta["files"])
            get = None
        else:
            state = load_logical(path, meta)[0]
            get = state.get
    elif os.path.isfile(os.path.join(path, EXPORTED_WEIGHTS)) and os.path.isfile(os.path.join(path, EXPORTED_CONFIG)):
        from safetensors import safe_open

        from megatron_taper.config import load_config

        saved = load_config(os.path.join(path, EXPORTED_CONFIG))
        _check_compatible({"config": {"model": saved.model.architecture_dict()}}, model_cfg, path, init=True)
        weights = safe_open(os.path.join(path, EXPORTED_WEIGHTS), "pt")
        get = lambda name: weights.get_tensor(name) if name in weights.keys() else None  # noqa: E731
    else:
        raise CheckpointError(f"run.init_from={path!r}: neither a checkpoint (meta.json), a run folder with "
                              f"complete checkpoints nor an exported folder ({EXPORTED_WEIGHTS} + {EXPORTED_CONFIG})")
    for name, param in pm.module.named_parameters():
        local = local_part(param.data)
        if get is None:
            _, offsets, _ = pm.piece_box(name, param)
            box = reader.read(f"model/{name}", offsets, tuple(local.shape))
        else:
            full = get(name)
            if full is None:
                raise CheckpointError(f"run.init_from={path}: no tensor for parameter {name!r}")
            box = local_part(pm.local_tensor(name, full))
        if tuple(box.shape) != tuple(local.shape):
            raise CheckpointError(f"run.init_from={path}: {name} has shape {list(box.shape)} there, "
                                  f"{list(local.shape)} here")
        local.copy_(box.to(dtype=local.dtype))
    return path


def load_logical(path: str, meta: dict | None = None) -> tuple[dict, dict]:
    """All stages' logical parameters and optimizer state of a format-1 checkpoint (CPU)."""
    meta = meta or _read_meta(path)
    model_state: dict[str, torch.Tensor] = {}
    optim_state: dict[str, dict] = {}
    for name in sorted(n for n in meta["files"] if n.startswith("model-pp")):
        model_state.update(_load(os.path.join(path, name)))
        optim_state.update(_load(os.path.join(path, name.replace("model-", "optim-"))))
    return model_state, optim_state


def verify_checkpoint(path: str) -> dict:
    """Check every file of a checkpoint against meta.json (format 2: every record's sha256);
    returns the metadata. Reads the whole checkpoint: for tools, not for resuming."""
    meta = _read_meta(path)
    if meta.get("format", 1) >= 2:
        reader = CheckpointReader(path, meta["tensors"], meta["files"])
        for key, entry in meta["tensors"].items():
            for rec in entry["records"]:
                reader.read(key, tuple(rec["offsets"]), tuple(rec["sizes"]))
        checked = {rec["file"] for entry in meta["tensors"].values() for rec in entry["records"]}
        for name, info in meta["files"].items():
            if name not in checked:
                _verify(os.path.join(path, name), info)
        return meta
    for name, info in meta["files"].items():
        _verify(os.path.join(path, name), info)
    return meta


def _hash_tree(root: str) -> dict[str, dict]:
    """size + sha256 of every file under root (relative names)."""
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            file = os.path.join(folder, name)
            out[os.path.relpath(file, root)] = {"size": os.path.getsize(file), "sha256": _sha256(file)}
    return out


def _check_compatible(meta: dict, model_cfg: ModelConfig, path: str, init: bool = False) -> None:
    # keys added to the config after the checkpoint was written count with their default value
    saved_cfg = ModelConfig(arch=model_cfg.arch).architecture_dict()
    saved = {**_flatten(saved_cfg), **_flatten(meta["config"]["model"])}
    current = _flatten(model_cfg.architecture_dict())
    diffs = [f"model.{k}: checkpoint {saved.get(k)!r} vs now {v!r}" for k, v in current.items() if saved.get(k) != v]
    if diffs and init:
        raise OtherModelError(f"run.init_from={path} holds weights of another model; differing keys:\n  "
                              + "\n  ".join(diffs))
    if diffs:
        raise OtherModelError(f"{path} was written for another model; differing keys:\n  " + "\n  ".join(diffs)
                              + "\nto train the new model, give it a new run.dir, or set run.resume=never to start "
                                "over in this one (run.init_from=PATH starts a new run from a checkpoint's weights "
                                "when the model is the same)")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _read_meta(path: str) -> dict:
    meta_path = os.path.join(path, "meta.json")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_path}: unreadable checkpoint metadata ({e}); delete the folder or set "
                              f"run.resume to another checkpoint") from None
    _check_names(meta, meta_path)
    return meta


def _check_names(meta, meta_path: str) -> None:
    """Every file meta.json names (its files and its tensor records') lies inside the checkpoint
    folder: a relative path without '..', so that nothing outside it is read."""
    try:
        names = list(meta["files"]) + [rec["file"] for entry in meta.get("tensors", {}).values()
                                        for rec in entry["records"]]
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{meta_path}: malformed checkpoint metadata (at {e!r}); delete the folder or set "
                              f"run.resume to another checkpoint") from None
    for name in names:
        if not inside_folder(name):
            raise CheckpointError(f"{meta_path}: names the file {name!r}, which is not inside the checkpoint folder")


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


def _gather_objects(ctx, obj) -> list:
    if ctx.mesh is None:
        return [obj]
    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def _gather_to_main(ctx, obj) -> list | None:
    """Every rank's `obj` on the main rank (rank order); None on the others."""
    if ctx.mesh is None:
        return [obj]
    out = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast_from_main(ctx, obj):
    if ctx.mesh is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
