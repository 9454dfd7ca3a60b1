"""The files of a sharded checkpoint: per-rank record files, the index, verified partial reads.

A logical tensor (a parameter or an AdamW state tensor, full shape, keyed `model/<name>` or
`optim/<name>/<state key>`) is stored as records: boxes of it (offsets and sizes per dimension),
each written once by the rank that owns that box (replicas write nothing). Rank r writes all its
records into `shards/rank-<r>.safetensors`; the index in meta.json lists, per key, its full shape,
dtype and records {file, offsets, sizes, sha256 of the record's bytes, and name: the tensor's name in the file
when it is not the key (a key's second and later boxes on one rank, `key#i`)}.

Reading a box (a rank's local piece under any layout) loads only the records that overlap it
(plain reads of one record's bytes at the offsets of the safetensors header; a record that is
exactly the box is read straight into the destination), checks each record's sha256 and copies
the overlap. At the same layout a rank reads exactly its own records; at another, the records that
intersect its piece. `CheckpointReader.bytes_read` counts what was read.

SwiGLU's two parameter layouts (model.fused_swiglu, models/layers.py) read from either: a reader
also serves, for every stored pair `...w1.weight` / `...w3.weight` (and their AdamW states), the
fused `...w13.weight` (rows interleaved: gate row i at 2i, up row i at 2i + 1), and for every stored
`...w13.weight` the pair, assembled from the stored records (gate_up_aliases). So a checkpoint of
one layout resumes, initialises or evaluates a model of the other, at any tp or dp layout.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import pickle
import re
import struct
from dataclasses import dataclass, field
from typing import Iterator

import torch

SHARD_DIR = "shards"
FORMAT = 2  # 1: logical per-stage files (model-ppK.pt), read for compatibility


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the folder or file."""


def shard_file(rank: int) -> str:
    return f"{SHARD_DIR}/rank-{rank:05d}.safetensors"


def tensor_sha256(t: torch.Tensor) -> str:
    data = t.detach().contiguous().reshape(-1).view(torch.uint8) if t.dim() else t.detach().reshape(1).view(torch.uint8)
    return hashlib.sha256(data.numpy()).hexdigest()


@dataclass
class Piece:
    """A box of a logical tensor: full shape, the box's offsets, its data (CPU, contiguous)."""

    key: str
    full_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    data: torch.Tensor


def write_pieces(folder: str, rank: int, pieces: list[Piece]) -> tuple[dict[str, list], dict[str, dict]]:
    """Write this rank's pieces to one safetensors file (fsynced); returns (index entries of its
    records by key, {file: {"size": bytes}}). No file when there are no pieces."""
    if not pieces:
        return {}, {}
    from safetensors.torch import save_file

    name = shard_file(rank)
    path = os.path.join(folder, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    index: dict[str, list] = {}
    tensors = {}
    for p in pieces:  # a key's second and later boxes on this rank (DeepSpeed's flat partitions): key#i
        records = index.setdefault(p.key, [])
        record = {"shape": list(p.full_shape), "dtype": str(p.data.dtype).removeprefix("torch."),
                  "file": name, "offsets": list(p.offsets), "sizes": list(p.data.shape),
                  "sha256": tensor_sha256(p.data)}
        if records:
            record["name"] = f"{p.key}#{len(records)}"
        records.append(record)
        tensors[record.get("name", p.key)] = p.data.contiguous()
    save_file(tensors, path)
    fsync_file(path)
    return index, {name: {"size": os.path.getsize(path)}}


def merge_index(parts: list[dict[str, list]]) -> dict[str, dict]:
    """Per-rank record lists -> {key: {shape, dtype, records}}; checks the records tile each key."""
    merged: dict[str, dict] = {}
    for part in parts:
        for key, records in part.items():
            for rec in records:
                entry = merged.setdefault(key, {"shape": rec["shape"], "dtype": rec["dtype"], "records": []})
                assert entry["shape"] == rec["shape"], (key, entry["shape"], rec["shape"])
                entry["records"].append({k: rec[k] for k in ("file", "offsets", "sizes", "sha256", "name") if k in rec})
    for key, entry in merged.items():
        covered = sum(_numel(r["sizes"]) for r in entry["records"])
        assert covered == _numel(entry["shape"]), f"{key}: records cover {covered} of {_numel(entry['shape'])}"
    return merged


@dataclass
class CheckpointReader:
    """Reads boxes of logical tensors from a format-2 checkpoint, verifying every record read."""

    folder: str
    index: dict[str, dict]
    files: dict[str, dict]  # file -> {"size": bytes}
    bytes_read: int = 0
    _open: dict = field(default_factory=dict, repr=False)  # file -> its safetensors header

    aliases: dict[str, tuple] = field(default_factory=dict, repr=False)  # key -> how to read it (gate_up_aliases)

    def __post_init__(self) -> None:
        self.aliases = gate_up_aliases(self.index)
        if self.aliases:
            # an alias's records: those of the first tensor it is read from (where its data lies)
            self.index = {**self.index, **{key: {**self.index[alias[1]], "shape": alias[-1], "alias": True}
                                           for key, alias in self.aliases.items()}}

    def keys(self, prefix: str) -> list[str]:
        """The keys under `prefix`, stored ones and the other SwiGLU layout's (module doc)."""
        return [k for k in self.index if k.startswith(prefix)]

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The box [offsets, offsets + sizes) of logical tensor `key`, assembled from its records."""
        entry = self._entry(key)
        return self.read_into(key, offsets, torch.empty(sizes, dtype=getattr(torch, entry["dtype"])))

    def read_into(self, key: str, offsets: tuple[int, ...], out: torch.Tensor) -> torch.Tensor:
        """Fill `out` (any dtype, on the CPU) with the box of `key` at `offsets` of out's shape,
        record by record: no copy of the whole box is made."""
        entry, sizes = self._entry(key), tuple(out.shape)
        if key in self.aliases:
            return self._read_alias(key, offsets, out)
        if len(sizes) != len(entry["shape"]) or any(o + s > n for o, s, n in zip(offsets, sizes, entry["shape"])):
            raise CheckpointError(f"{self.folder}: {key} has shape {entry['shape']}, cannot read the box at "
                                  f"{list(offsets)} of size {list(sizes)} (was it written for another model?)")
        filled = 0
        for rec in entry["records"]:
            lo = [max(o, r) for o, r in zip(offsets, rec["offsets"])]
            hi = [min(o + s, r + z) for o, s, r, z in zip(offsets, sizes, rec["offsets"], rec["sizes"])]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            whole = list(rec["offsets"]) == list(offsets) and list(rec["sizes"]) == list(sizes)
            if whole and out.dtype == getattr(torch, entry["dtype"]) and out.is_contiguous():
                self._record(key, rec, into=out)  # the same layout: straight into the destination
                filled += out.numel()
                continue
            data = self._record(key, rec)
            src = data[tuple(slice(a - r, b - r) for a, b, r in zip(lo, hi, rec["offsets"]))]
            out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))] = src
            filled += src.numel()
            del data, src
        assert filled == out.numel(), f"{key}: the records cover {filled} of {out.numel()} elements of the box"
        return out

    def _read_alias(self, key: str, offsets: tuple[int, ...], out: torch.Tensor) -> torch.Tensor:
        """A box of the other SwiGLU layout's tensor `key`: fused rows [o, o + s) from the gate (even
        rows) and up (odd rows) tensors, or gate / up rows from the fused tensor's even / odd rows."""
        kind, *stored, _ = self.aliases[key]
        if out.dim() == 0:  # a scalar state (AdamW's step): the same in either layout
            return self.read_into(stored[0], (), out)
        o, s = offsets[0], out.shape[0]
        if kind == "fused":
            first = o % 2  # the first row of the box at an even (gate) index, or odd
            self.read_into(stored[0], ((o + 1) // 2, *offsets[1:]), out[first::2])
            self.read_into(stored[1], (o // 2, *offsets[1:]), out[1 - first::2])
            return out
        parity = 0 if kind == "gate" else 1
        both = self.read(stored[0], (2 * o, *offsets[1:]), (2 * s, *out.shape[1:]))
        out.copy_(both[parity::2])
        return out

    def _entry(self, key: str) -> dict:
        entry = self.index.get(key)
        if entry is None:
            raise CheckpointError(f"{self.folder}: no tensor {key!r} in the checkpoint")
        return entry

    def _record(self, key: str, rec: dict, into: torch.Tensor | None = None) -> torch.Tensor:
        """One record, read with plain file reads (not a memory map, whose pages would stay in the
        process's resident set), into `into` when given (same shape and dtype), sha256-checked."""
        path = os.path.join(self.folder, rec["file"])
        header = self._header(path, rec["file"])
        stored = rec.get("name", key)  # the record's tensor name in the file (default: the key)
        info = header.get(stored)
        if info is None:
            raise CheckpointError(f"{path}: has no record {stored!r}")
        begin, end = info["data_offsets"]
        dtype = getattr(torch, self._entry(key)["dtype"])
        data = into if into is not None else torch.empty(rec["sizes"], dtype=dtype)
        raw = data.reshape(-1).view(torch.uint8) if data.dim() else data.reshape(1).view(torch.uint8)
        if raw.numel() != end - begin:
            raise CheckpointError(f"{path}: record {key!r} has {end - begin} bytes, expected {raw.numel()}")
        with open(path, "rb") as f:
            f.seek(header["__start__"] + begin)
            if f.readinto(memoryview(raw.numpy())) != raw.numel():
                raise CheckpointError(f"{path}: truncated inside record {key!r}")
        self.bytes_read += raw.numel()
        if tensor_sha256(data) != rec["sha256"]:
            raise CheckpointError(f"{path}: record {key!r} is corrupted (checksum mismatch)")
        return data

    def _header(self, path: str, name: str) -> dict:
        header = self._open.get(name)
        if header is None:
            if not os.path.isfile(path):
                raise CheckpointError(f"{path}: missing from the checkpoint")
            size, want = os.path.getsize(path), self.files[name]["size"]
            if size != want:
                raise CheckpointError(f"{path}: truncated or altered ({size} bytes, expected {want})")
            try:
                with open(path, "rb") as f:
                    (length,) = struct.unpack("<Q", f.read(8))
                    header = json.loads(f.read(length))
            except (OSError, struct.error, ValueError) as e:
                raise CheckpointError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
            header["__start__"] = 8 + length
            self._open[name] = header
        return header


_GATE_UP_KEY = re.compile(r"^(model/|optim/)(.*)(w1|w3|w13)\.weight(/[^/]+)?$")


def gate_up_aliases(index: dict[str, dict]) -> dict[str, tuple]:
    """For the index of a checkpoint, the keys of the other SwiGLU layout (module doc) and how each
    is read, with its shape: {fused key: ("fused", gate key, up key, shape)} for each stored
    gate/up pair of equal shapes; {gate key: ("gate", fused key, shape), up key: ("up", fused key,
    shape)} for each stored fused tensor of an even number of rows."""
    out: dict[str, tuple] = {}
    for key, entry in index.items():
        match = _GATE_UP_KEY.match(key)
        if match is None:
            continue
        head, base, which, state = match.group(1), match.group(2), match.group(3), match.group(4) or ""
        name = {part: f"{head}{base}{part}.weight{state}" for part in ("w1", "w3", "w13")}
        shape = list(entry["shape"])
        if which == "w1" and name["w13"] not in index and index.get(name["w3"], {}).get("shape") == shape:
            out[name["w13"]] = ("fused", key, name["w3"], [2 * shape[0], *shape[1:]] if shape else [])
        elif which == "w13" and name["w1"] not in index and name["w3"] not in index and (
                not shape or shape[0] % 2 == 0):
            half = [shape[0] // 2, *shape[1:]] if shape else []
            out[name["w1"]], out[name["w3"]] = ("gate", key, half), ("up", key, half)
    return out


def swiglu_layout(keys: list[str], fused: bool) -> list[str]:
    """Of `keys` that hold both SwiGLU layouts (a reader's: stored ones and aliases), those of one:
    `fused` drops the gate/up keys that have a fused key among them, else the fused keys that have
    their gate/up pair."""
    present, out = set(keys), []
    for key in keys:
        match = _GATE_UP_KEY.match(key)
        if match is not None:
            head, base, which, state = match.group(1), match.group(2), match.group(3), match.group(4) or ""
            other = [f"{head}{base}{part}.weight{state}" for part in (("w13",) if which != "w13" else ("w1", "w3"))]
            if fused == (which != "w13") and all(k in present for k in other):
                continue
        out.append(key)
    return out


def iter_full_tensors(reader: CheckpointReader, prefix: str = "model/") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full logical tensor) for every stored key under `prefix` (not the other SwiGLU
    layout's aliases), one tensor in memory at a time."""
    for key in sorted(k for k in reader.keys(prefix) if k not in reader.aliases):
        shape = tuple(reader.index[key]["shape"])
        yield key[len(prefix):], reader.read(key, (0,) * len(shape), shape)


def write_safetensors_streaming(path: str, shapes: dict[str, tuple[tuple[int, ...], str]],
                                tensors: Iterator[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> None:
    """A safetensors file written tensor by tensor: the header (offsets from `shapes`, name ->
    (shape, dtype name as in torch)) first, then each tensor's bytes as `tensors` yields them (in
    sorted name order). Peak memory: one tensor."""
    codes = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64",
             "int32": "I32", "uint8": "U8"}
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name in sorted(shapes):
        shape, dtype = shapes[name]
        nbytes = _numel(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        header[name] = {"dtype": codes[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, t in tensors:
            shape, dtype = shapes[name]
            assert tuple(t.shape) == tuple(shape) and str(t.dtype).removeprefix("torch.") == dtype, name
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())


def fsync_file(path: str) -> None:
    """fsync a file or a folder (a folder: so that a rename or a new entry in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# The classes DeepSpeed's checkpoint files pickle beyond torch's own tensors and containers (found in
# the files its ZeRO engine writes: the loss scaler objects and the ZeRO stage enum); nothing else in
# such a file is ever unpickled.
DEEPSPEED_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                     "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                     "deepspeed.runtime.zero.config.ZeroStageEnum")


def load_deepspeed_file(path, map_location=None, **kwargs):
    """torch.load of one of DeepSpeed's checkpoint files with weights_only and DEEPSPEED_GLOBALS as
    the only classes allowed beyond torch's: a file whose pickle names any other (a payload that
    would run code) is refused with a CheckpointError naming the file and that global, before
    anything in it runs. `kwargs` (e.g. mmap) go to torch.load."""
    allowed = []
    for name in DEEPSPEED_GLOBALS:
        module, attr = name.rsplit(".", 1)
        allowed.append(getattr(importlib.import_module(module), attr))
    kwargs.pop("weights_only", None)
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        reason = next((line.strip() for line in str(e).splitlines() if "GLOBAL" in line or "global" in line),
                      str(e).splitlines()[0])
        raise CheckpointError(f"{path}: refused to unpickle a DeepSpeed checkpoint file that names a class "
                              f"outside the allow-list (checkpoint/files.py DEEPSPEED_GLOBALS): {reason}") from None


@contextlib.contextmanager
def deepspeed_loads_allowlisted():
    """Inside: every torch.load (DeepSpeed's zero_to_fp32 calls it with weights_only=False) goes
    through load_deepspeed_file: around DeepSpeed's own readers (the engine's load_checkpoint in
    parallel/dp/zero_deepspeed.py, zero_to_fp32 in tools/convert_checkpoint.py)."""
    real = torch.load

    def load(f, map_location=None, **kwargs):
        with swapped(torch, "load", real):
            return load_deepspeed_file(f, map_location, **kwargs)

    with swapped(torch, "load", load):
        yield


@contextlib.contextmanager
def swapped(owner, name: str, value):
    """owner.name = value inside the block, restored after."""
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)
