"""Token data for training and evaluation.

Every source hands one data-parallel rank its micro-batches of packed token sequences and has a
state that goes into checkpoints, so that a resumed run sees exactly the samples an
uninterrupted one would have seen.
"""
from __future__ import annotations

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
