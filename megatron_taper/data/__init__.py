"""Token data for training and evaluation.

Every source hands one data-parallel rank its micro-batches of packed token sequences and has a
state that goes into checkpoints, so that a resumed run sees exactly the samples an
uninterrupted one would have seen.

sources.py             choose the data source for a run from `data.path`
streaming.py           packed samples from MDS shards, a global sample order, an exact dp-size-free state
order.py               the global sample order over document lengths, O(documents / block) memory
mixture.py             weighted mixtures of MDS datasets (`data.mix`)
token_file.py          a flat token array (.npy) cut into samples
prefetch.py            a background thread preparing the next steps' micro-batches
tokenizer.py           SentencePiece training and a load / encode / decode wrapper
corpus.py              raw text inputs (files, folders, globs, .gz/.zst, jsonl, parquet, datasets)
readers.py             readers of formats that are not lines of text
preprocess.py          documents -> tokens -> MDS shards (train/, val/, stats.json)
builtin.py             the built-in dataset made once from the embedded corpus
torchvision_compat.py  the one way this project imports mosaicml-streaming
checks.py              start-up checks that need the data on disk (folders, token ids, tokenizer size)
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the order and length code imports this package without torch
    import torch


class BatchSource(Protocol):
    def next_batch(self) -> torch.Tensor:
        """The next micro-batch of this rank: int64 [micro_batch, seq_len + 1] on the CPU."""

    def state_dict(self) -> dict:
        """Position in the sample stream (plain Python values, safe for weights_only loading)."""

    def load_state_dict(self, state: dict) -> None:
        """Continue from a position written by `state_dict` (possibly at another dp size)."""


def is_remote(path: str) -> bool:
    """A data path that is a URL (s3://, gs://, ...): read through a local cache, never checked on disk."""
    return "://" in path


STATS_FILE = "stats.json"  # an MDS folder's summary, written last by preprocess.py (format: streaming.py)


def is_complete(folder: str) -> bool:
    """`folder` holds a finished preprocess output (its stats.json says complete). Here, without
    torch, so that launch/quickstart.sh's check of its cached shards starts no torch import."""
    try:
        with open(os.path.join(folder, STATS_FILE)) as f:
            return json.load(f).get("complete") is True
    except (OSError, ValueError):
        return False
