"""Choose the data source for a run from `data.path`.

- "" : the built-in corpus (Python standard library sources), prepared on first use into a cache
- a folder with train/ (and optionally val/) MDS shards, local or on a shared filesystem
- a remote MDS folder, any URL `scheme://...` mosaicml-streaming can download from (s3://, gs://,
  ...): read through a local cache, `data.cache_dir` or the default one; its stats.json (written
  last by tools/preprocess_data.py) is fetched first and says whether there is a val/ split
- a .npy file: a flat token array (eval = its tail, `data.eval_fraction`)

`data.mix` (instead of data.path): a weighted mixture of MDS folders (local or remote, as above),
megatron_taper.data.mixture; each source with a val/ split is a held-out set of its own.
"""
from __future__ import annotations

import functools
import json
import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from megatron_taper.data import BatchSource, is_remote

if TYPE_CHECKING:
    from megatron_taper.config import DataConfig


def default_cache_dir(data: DataConfig) -> str:
    """`data.cache_dir`, or ~/.cache/megatron_taper when it is ""."""
    return data.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "megatron_taper")


@dataclass
class HeldOut:
    """One held-out set: `make()` builds a fresh evaluation source of it."""

    name: str  # "" for data.path; the entry's name for data.mix
    weight: float  # its share in the mixture (1.0 for data.path)
    make: Callable[[], BatchSource]


def build_sources(data: DataConfig, *, seq_len: int, micro_batch: int, seed: int, vocab_size: int, dp_rank: int,
                  dp_size: int, rows: int = 0) -> tuple[BatchSource, list[HeldOut]]:
    """(training source, held-out sets: none when there is no held-out data, one per mixture source
    with a val/ split under data.mix) for this data-parallel rank: sequences of seq_len + 1 tokens,
    micro_batch at a time. `rows` > 0: the training source serves that many global batch rows
    consecutive windows (data.row_streams: streaming.RowStreamSource, one MDS folder or the
    built-in corpus); the held-out sets stay packed samples."""
    mb = micro_batch
    if rows and (data.mix or data.path.endswith(".npy")):
        raise ValueError(f"data.row_streams (on for a model that carries a state, e.g. model.bridge.carry_state) "
                         f"reads one MDS folder or the built-in corpus, not "
                         f"{'data.mix' if data.mix else 'the .npy token file data.path=' + repr(data.path)}")
    if data.mix:
        return _build_mixture(data, seq_len, mb, seed, dp_rank, dp_size, vocab_size)
    path = data.path
    if path.endswith(".npy"):
        from megatron_taper.data.token_file import TokenFileSource

        train = TokenFileSource(path, seq_len, mb, dp_rank, dp_size, seed, "train", data.eval_fraction)
        if data.eval_fraction <= 0:
            return train, []
        return train, [HeldOut("", 1.0, lambda: TokenFileSource(path, seq_len, mb, dp_rank, dp_size, seed, "val",
                                                                 data.eval_fraction))]
    if not path:
        from megatron_taper.data.builtin import prepare_builtin_data

        path = prepare_builtin_data(os.path.join(default_cache_dir(data), "builtin"), vocab_size)
    make, has_val = _mds_dataset(data, path, "data.path", vocab_size)

    def make_split(split: str) -> BatchSource:
        return make(split, seq_len, mb, dp_rank, dp_size, seed)

    train = make("train", seq_len, mb, dp_rank, dp_size, seed, rows) if rows else make_split("train")
    return train, ([HeldOut("", 1.0, lambda: make_split("val"))] if has_val else [])


def _mds_dataset(data: DataConfig, path: str, key: str,
                 vocab_size: int | None = None) -> tuple[Callable[..., BatchSource], bool]:
    """(factory of StreamingSources of the MDS folder `path`, whether it has a val/ split); their
    documents' token ids are checked against `vocab_size` as they are read."""
    from megatron_taper.data import STATS_FILE
    from megatron_taper.data.streaming import RowStreamSource, StreamingSource, cache_folder

    if is_remote(path):
        # A remote folder is always read through a local cache (data.cache_dir "" = the default).
        cache: str | None = os.path.join(default_cache_dir(data), "streaming")
        has_val = "val" in remote_splits(path, cache, key, data.download_timeout_s)
        stats = os.path.join(cache_folder(cache, path), STATS_FILE)
    else:
        check_local_dataset(path, key)
        cache = os.path.join(default_cache_dir(data), "streaming") if data.cache_dir else None
        has_val = os.path.isdir(os.path.join(path, "val"))
        stats = os.path.join(path, STATS_FILE)
    check_tokenizer(stats, data.tokenizer, key, path)

    def make(split: str, seq_len: int, mb: int, dp_rank: int, dp_size: int, seed: int,
             rows: int = 0) -> StreamingSource:
        timeout = {"download_timeout_s": data.download_timeout_s, "vocab_size": vocab_size}
        if rows:
            return RowStreamSource(path, split, seq_len, mb, dp_rank, dp_size, seed, cache, rows=rows, **timeout)
        return StreamingSource(path, split, seq_len, mb, dp_rank, dp_size, seed, cache, **timeout)

    return make, has_val


def document_end_id(data: DataConfig, vocab_size: int) -> int:
    """The token id that ends every document of the run's data (data.document_mask: the model's
    doc_start marks the positions right after it, models/documents.py). tools/preprocess_data.py
    writes each document as its tokens followed by the tokenizer's EOS and records that id as
    `eos_id` in the folder's stats.json (the built-in corpus is such a folder; a remote one's
    stats.json is read from its cache); every data.mix folder must record the same id. ConfigError
    naming the key for a folder whose stats.json records none, or mixture folders that disagree (a
    .npy token file, which records none, is refused by DataConfig.validate)."""
    from megatron_taper.data import STATS_FILE
    from megatron_taper.data.streaming import cache_folder
    from megatron_taper.validation import ConfigError

    found: dict[str, int] = {}
    for i, entry in enumerate(data.mix or [{"path": data.path}]):
        path, key = entry["path"], f"data.mix[{i}].path" if data.mix else "data.path"
        if not path:
            from megatron_taper.data.builtin import prepare_builtin_data

            path = prepare_builtin_data(os.path.join(default_cache_dir(data), "builtin"), vocab_size)
        if is_remote(path):
            cache = os.path.join(default_cache_dir(data), "streaming")
            remote_splits(path, cache, key, data.download_timeout_s)  # copies stats.json into the cache
            stats_file = os.path.join(cache_folder(cache, path), STATS_FILE)
        else:
            stats_file = os.path.join(path, STATS_FILE)
        try:
            with open(stats_file) as f:
                stats = json.load(f)
        except (OSError, ValueError):
            stats = None
        eos = stats.get("eos_id") if isinstance(stats, dict) else None
        if isinstance(eos, bool) or not isinstance(eos, int):
            raise ConfigError(f"data.document_mask=true: {key}={path} records no end-of-document id (eos_id in "
                              f"{stats_file}); write the folder again with tools/preprocess_data.py, or "
                              f"data.document_mask=false")
        found[key] = eos
    if len(set(found.values())) > 1:
        raise ConfigError("data.document_mask=true needs one end-of-document id, but the data.mix folders record "
                          + ", ".join(f"{key}: {eos}" for key, eos in found.items()))
    return next(iter(found.values()))


def check_local_dataset(path: str, key: str = "data.path") -> None:
    """ValueError with the fix when a local `path` is not an MDS folder written by
    tools/preprocess_data.py (missing; a raw input file; its train/ or val/ split; no train/)."""
    npy = "a .npy token file or " if key == "data.path" else ""
    if not os.path.exists(path):
        raise ValueError(f"{key}={path!r}: no such file or folder (write one with tools/preprocess_data.py "
                         f"--output {path}" + (", or leave data.path empty for the built-in corpus)"
                                                if key == "data.path" else ")"))
    if os.path.isfile(path):
        raise ValueError(f"{key}={path!r} is a file, not {npy}an MDS folder: tokenize raw text first with "
                         f"tools/preprocess_data.py --input {path} --tokenizer TOK.model --output DIR, then "
                         f"{key}=DIR")
    if os.path.isdir(os.path.join(path, "train")):
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isfile(os.path.join(path, "index.json")) and os.path.isdir(os.path.join(parent, "train")):
        raise ValueError(f"{key}={path!r} is the {os.path.basename(os.path.normpath(path))}/ split of an MDS "
                         f"folder; pass the folder itself: {key}={parent}")
    raise ValueError(f"{key}={path!r} has no train/ split: not a folder written by tools/preprocess_data.py "
                     f"(expected {npy}a folder with MDS shards in train/)")


def _build_mixture(data: DataConfig, seq_len: int, mb: int, seed: int, dp_rank: int,
                   dp_size: int, vocab_size: int) -> tuple[BatchSource, list[HeldOut]]:
    from megatron_taper.data.mixture import MixSchedule, MixtureSource

    names, weights = data.mix_names(), [float(e["weight"]) for e in data.mix]
    datasets = [_mds_dataset(data, e["path"], f"data.mix[{i}].path", vocab_size) for i, e in enumerate(data.mix)]
    # every rank reads every source's stream (a mixture sample can come from any of them)
    train = MixtureSource([make("train", seq_len, 1, 0, 1, seed) for make, _ in datasets], names, weights, mb,
                          dp_rank, dp_size)
    shares = MixSchedule(weights).weights
    held_out = [HeldOut(name, share, functools.partial(make, "val", seq_len, mb, dp_rank, dp_size, seed))
                for name, share, (make, has_val) in zip(names, shares, datasets) if has_val]
    return train, held_out


def check_tokenizer(stats_file: str, tokenizer: str, key: str, path: str) -> None:
    """`tokenizer` (data.tokenizer; "" = the folder's own) is the one the MDS folder `path` was
    written with: ValueError naming both when its stats.json records another (sha256 of the .model
    file), a warning when it records none (written before the record was kept)."""
    if not tokenizer or not os.path.isfile(stats_file):
        return
    from megatron_taper.data.tokenizer import model_sha256

    with open(stats_file) as f:
        stats = json.load(f)
    recorded = stats.get("tokenizer_sha256") if isinstance(stats, dict) else None
    if not recorded:
        warnings.warn(f"{key}={path}: its stats.json records no tokenizer (written before tools/preprocess_data.py "
                      f"kept one), so data.tokenizer={tokenizer} is not checked against it", stacklevel=2)
        return
    try:
        ours = model_sha256(tokenizer)
    except OSError as e:
        raise ValueError(f"data.tokenizer={tokenizer}: {e.strerror or e}") from None
    if ours != recorded:
        raise ValueError(f"data.tokenizer={tokenizer} (sha256 {ours[:16]}) is not the tokenizer {key}={path} was "
                         f"written with ({stats.get('tokenizer')}, sha256 {recorded[:16]}, {stats.get('vocab_size')} "
                         f"ids, in its stats.json): leave data.tokenizer empty to use the folder's tokenizer.model, "
                         f"or re-tokenize the data with this tokenizer (tools/preprocess_data.py)")


def remote_splits(path: str, cache_dir: str, key: str = "data.path", download_timeout_s: float = 0.0) -> list[str]:
    """The splits that the remote dataset's stats.json lists, the file copied once into the
    dataset's cache folder (under a file lock shared by the ranks of a machine, as the shards);
    one attempt of `download_timeout_s` (0 = the default, data.download_timeout_s's).

    Listing a remote folder, or telling a missing val/index.json from a failed download, is not
    uniform across mosaicml-streaming's backends (S3 raises botocore's ClientError, others
    FileNotFoundError), so any failure to fetch stats.json is an error and its `splits` decide."""
    from filelock import FileLock

    from megatron_taper.data import STATS_FILE
    from megatron_taper.data.streaming import DOWNLOAD_TIMEOUT_S, cache_folder
    from megatron_taper.data.torchvision_compat import import_streaming

    import_streaming()
    from streaming.base.storage.download import CloudDownloader

    folder = cache_folder(cache_dir, path)
    local = os.path.join(folder, STATS_FILE)
    os.makedirs(folder, exist_ok=True)
    remote = f"{path.rstrip('/')}/{STATS_FILE}"
    with FileLock(os.path.join(folder, ".stats.lock")):
        if not os.path.isfile(local):
            try:
                CloudDownloader.direct_download(remote, local, download_timeout_s or DOWNLOAD_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - the backends raise unrelated types
                raise ValueError(f"{key}={path}: cannot fetch {remote} (a remote dataset must be a complete "
                                 f"folder written by tools/preprocess_data.py): {type(e).__name__}: {e}") from e
    with open(local) as f:
        stats = json.load(f)
    splits = stats.get("splits") if isinstance(stats, dict) else None
    if not isinstance(splits, dict) or "train" not in splits:
        raise ValueError(f"{key}={path}: {remote} lists no 'train' split (not written by "
                         f"tools/preprocess_data.py?)")
    return sorted(splits)
