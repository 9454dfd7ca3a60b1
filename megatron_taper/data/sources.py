"""Choose the data source for a run from `data.path`.

- "" : the built-in corpus (Python standard library sources), prepared on first use into a cache
- a folder with train/ (and optionally val/) MDS shards, local or on a shared filesystem
- a remote MDS folder, any URL `scheme://...` mosaicml-streaming can download from (s3://, gs://,
  ...): read through a local cache, `data.cache_dir` or the default one; its stats.json (written
  last by tools/preprocess_data.py) is fetched first and says whether there is a val/ split
- a .npy file: a flat token array (eval = its tail, `data.eval_fraction`)
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Callable

from megatron_taper.data import BatchSource

if TYPE_CHECKING:
    from megatron_taper.config import DataConfig


def default_cache_dir(data: DataConfig) -> str:
    """`data.cache_dir`, or ~/.cache/megatron_taper when it is ""."""
    return data.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "megatron_taper")


def build_sources(data: DataConfig, *, seq_len: int, micro_batch: int, seed: int, vocab_size: int, dp_rank: int,
                  dp_size: int) -> tuple[BatchSource, Callable[[], BatchSource] | None]:
    """(training source, factory of a fresh evaluation source or None when there is no held-out
    data) for this data-parallel rank: sequences of seq_len + 1 tokens, micro_batch at a time."""
    mb = micro_batch
    path = data.path
    if path.endswith(".npy"):
        from megatron_taper.data.token_file import TokenFileSource

        train = TokenFileSource(path, seq_len, mb, dp_rank, dp_size, seed, "train", data.eval_fraction)
        if data.eval_fraction <= 0:
            return train, None
        return train, lambda: TokenFileSource(path, seq_len, mb, dp_rank, dp_size, seed, "val", data.eval_fraction)

    from megatron_taper.data.streaming import StreamingSource, is_remote

    if not path:
        from megatron_taper.data.builtin import prepare_builtin_data

        path = prepare_builtin_data(os.path.join(default_cache_dir(data), "builtin"), vocab_size)
    if is_remote(path):
        # A remote folder is always read through a local cache (data.cache_dir "" = the default).
        cache: str | None = os.path.join(default_cache_dir(data), "streaming")
        has_val = "val" in remote_splits(path, cache)
    else:
        if not os.path.isdir(os.path.join(path, "train")):
            raise ValueError(f"data.path={path!r}: expected a .npy token file or a folder with MDS shards in train/")
        cache = os.path.join(default_cache_dir(data), "streaming") if data.cache_dir else None
        has_val = os.path.isdir(os.path.join(path, "val"))

    def make(split: str) -> BatchSource:
        return StreamingSource(path, split, seq_len, mb, dp_rank, dp_size, seed, cache)

    return make("train"), ((lambda: make("val")) if has_val else None)


def remote_splits(path: str, cache_dir: str) -> list[str]:
    """The splits that the remote dataset's stats.json lists, the file copied once into the
    dataset's cache folder (under a file lock shared by the ranks of a machine, as the shards).

    Listing a remote folder, or telling a missing val/index.json from a failed download, is not
    uniform across mosaicml-streaming's backends (S3 raises botocore's ClientError, others
    FileNotFoundError), so any failure to fetch stats.json is an error and its `splits` decide."""
    from filelock import FileLock

    from megatron_taper.data.streaming import _DOWNLOAD_TIMEOUT_S, STATS_FILE, cache_folder
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
                CloudDownloader.direct_download(remote, local, _DOWNLOAD_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - the backends raise unrelated types
                raise ValueError(f"data.path={path}: cannot fetch {remote} (a remote dataset must be a complete "
                                 f"folder written by tools/preprocess_data.py): {type(e).__name__}: {e}") from e
    with open(local) as f:
        stats = json.load(f)
    splits = stats.get("splits") if isinstance(stats, dict) else None
    if not isinstance(splits, dict) or "train" not in splits:
        raise ValueError(f"data.path={path}: {remote} lists no 'train' split (not written by "
                         f"tools/preprocess_data.py?)")
    return sorted(splits)
