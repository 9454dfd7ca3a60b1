"""Choose the data source for a run from `data.path`.

- "" : the built-in corpus (Python standard library sources), prepared on first use into a cache
- a folder with train/ (and optionally val/) MDS shards, local or on a shared filesystem
- a .npy file: a flat token array (eval = its tail, `data.eval_fraction`)
"""
from __future__ import annotations

import os
from typing import Callable

from megatron_taper.config import Config
from megatron_taper.data import BatchSource


def default_cache_dir(cfg: Config) -> str:
    return cfg.data.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "megatron_taper")


def build_sources(cfg: Config, dp_rank: int, dp_size: int) -> tuple[BatchSource, Callable[[], BatchSource] | None]:
    """(training source, factory of a fresh evaluation source or None when there is no held-out data)."""
    seq_len, mb, seed = cfg.model.seq_len, cfg.train.micro_batch, cfg.train.seed
    path = cfg.data.path
    if path.endswith(".npy"):
        from megatron_taper.data.token_file import TokenFileSource

        train = TokenFileSource(path, seq_len, mb, dp_rank, dp_size, seed, "train", cfg.data.eval_fraction)
        if cfg.data.eval_fraction <= 0:
            return train, None
        return train, lambda: TokenFileSource(path, seq_len, mb, dp_rank, dp_size, seed, "val", cfg.data.eval_fraction)

    from megatron_taper.data.streaming import StreamingSource

    if not path:
        from megatron_taper.data.builtin import prepare_builtin_data

        path = prepare_builtin_data(os.path.join(default_cache_dir(cfg), "builtin"), cfg.model.vocab_size)
    if not os.path.isdir(os.path.join(path, "train")):
        raise ValueError(f"data.path={path!r}: expected a .npy token file or a folder with MDS shards in train/")
    cache = os.path.join(default_cache_dir(cfg), "streaming") if cfg.data.cache_dir else None

    def make(split: str) -> BatchSource:
        return StreamingSource(path, split, seq_len, mb, dp_rank, dp_size, seed, cache)

    has_val = os.path.isdir(os.path.join(path, "val"))
    return make("train"), ((lambda: make("val")) if has_val else None)
