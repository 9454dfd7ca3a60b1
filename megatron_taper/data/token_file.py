"""A flat token array (.npy) cut into samples of seq_len + 1 tokens.

Samples are consecutive, non-overlapping windows. Training order: a permutation per epoch drawn
from (seed, epoch). The stream of samples is global: each "round" of dp_size * micro_batch
consecutive samples is split between the data-parallel ranks in rank order, and the state is
the number of global samples consumed. A step consumes whole rounds, so a run resumed at another
dp size (same global batch) continues at the same sample with nothing repeated or skipped.
Torch is imported where a batch is made, not at import: the start-up checks (data/checks.py,
launch_check) read token files without it.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from megatron_taper.validation import ConfigError

if TYPE_CHECKING:
    import torch


def open_token_array(path: str, key: str) -> np.ndarray:
    """The 1-D integer token array of the .npy file at `path`, memory-mapped; one error naming
    `key` and the file when it is missing, unreadable or of another shape or dtype."""
    if not os.path.isfile(path):
        raise ConfigError(f"{key}: token file not found: {path}")
    try:
        tokens = np.load(path, mmap_mode="r")
    except (ValueError, OSError) as e:
        raise ConfigError(f"{key}: {path} is not a readable .npy token array: {e}") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ConfigError(f"{key}: {path} must hold a 1-D integer token array, got {tokens.dtype} {tokens.shape}")
    return tokens


class TokenFileSource:
    def __init__(self, path: str, seq_len: int, micro_batch: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, split: str = "train", eval_fraction: float = 0.05):
        tokens = open_token_array(path, "data.path")
        self.sample_len = seq_len + 1
        n_all = len(tokens) // self.sample_len
        n_eval = int(round(n_all * eval_fraction))
        first, count = (0, n_all - n_eval) if split == "train" else (n_all - n_eval, n_eval)
        if count < micro_batch * dp_size:
            raise ValueError(
                f"data.path: {path} has {count} {split} samples of {self.sample_len} tokens, fewer than one "
                f"round of micro_batch x dp = {micro_batch * dp_size}"
            )
        self.tokens, self.first, self.count = tokens, first, count
        self.micro_batch, self.dp_rank, self.dp_size = micro_batch, dp_rank, dp_size
        self.seed, self.shuffle = seed, split == "train"
        self.consumed = 0  # global samples consumed by all ranks
        self._epoch, self._order = -1, None

    def _sample_index(self, position: int) -> int:
        epoch, offset = divmod(position, self.count)
        if not self.shuffle:
            return self.first + offset
        if epoch != self._epoch:
            import torch

            gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._order, self._epoch = torch.randperm(self.count, generator=gen).numpy(), epoch
        return self.first + int(self._order[offset])

    def next_batch(self) -> torch.Tensor:
        import torch

        start = self.consumed + self.dp_rank * self.micro_batch
        rows = []
        for position in range(start, start + self.micro_batch):
            i = self._sample_index(position) * self.sample_len
            rows.append(np.asarray(self.tokens[i: i + self.sample_len], dtype=np.int64))
        self.consumed += self.micro_batch * self.dp_size
        return torch.from_numpy(np.stack(rows))

    def state_dict(self) -> dict:
        return {"kind": "token_file", "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "token_file":
            raise ValueError(f"data state of kind {state.get('kind')!r} cannot resume a token-file source")
        self.consumed = int(state["consumed"])
