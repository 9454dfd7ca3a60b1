"""check_data(cfg): the start-up rules that need the data on disk: data.path / data.mix folders are
MDS folders written by tools/preprocess_data.py or .npy token files whose ids fit model.vocab_size,
and the tokenizer has no more ids than model.vocab_size. Run before any process group exists, next
to cost/preflight.py's layout rules (train.main, the launch check)."""
from __future__ import annotations

import json
import os
import warnings
from typing import TYPE_CHECKING

from megatron_taper.data import is_remote
from megatron_taper.validation import ConfigError

if TYPE_CHECKING:
    from megatron_taper.config import Config


TOKEN_SCAN_ELEMENTS = 1 << 26  # ids per read while scanning a .npy token file (128-512 MiB of host memory)


def check_token_ids(path: str, key: str, vocab_size: int) -> None:
    """A .npy token file is a 1-D integer array whose ids lie in [0, vocab_size): one error naming
    the file, the first bad id and its index otherwise. The whole file is scanned (memory-mapped, in
    slices), about one second per GB read: an out-of-range id would otherwise fail inside the
    embedding at the step that first samples it, hours in."""
    import numpy as np

    from megatron_taper.data.token_file import open_token_array

    tokens = open_token_array(path, key)
    for start in range(0, len(tokens), TOKEN_SCAN_ELEMENTS):
        part = np.asarray(tokens[start: start + TOKEN_SCAN_ELEMENTS])
        if part.size and (int(part.min()) < 0 or int(part.max()) >= vocab_size):
            index = start + int(np.flatnonzero((part < 0) | (part >= vocab_size))[0])
            raise ConfigError(f"{key}: {path} holds token id {int(tokens[index])} at index {index}, outside "
                              f"[0, model.vocab_size={vocab_size}): set model.vocab_size to the tokenizer's size "
                              f"or re-tokenize the file")


def check_data(cfg: Config, warn: bool = True) -> None:
    """Local data folders are MDS folders written by tools/preprocess_data.py (or .npy token files
    whose ids all fit model.vocab_size: check_token_ids), and the tokenizer (data.tokenizer, else
    each folder's stats.json) has no more ids than model.vocab_size; fewer is a warning (when
    `warn`) naming the padding rows. Remote folders are checked when read."""
    from megatron_taper.data.sources import check_local_dataset

    d, m = cfg.data, cfg.model
    paths = [(e["path"], f"data.mix[{i}].path") for i, e in enumerate(d.mix)] or [(d.path, "data.path")]
    vocabs: list[tuple[int, str]] = []
    for path, key in paths:
        if not path or is_remote(path):
            continue
        if path.endswith(".npy"):
            check_token_ids(path, key, m.vocab_size)
            continue
        check_local_dataset(path, key)
        try:
            with open(os.path.join(path, "stats.json")) as f:
                vocab = json.load(f).get("vocab_size")
        except (OSError, ValueError):
            vocab = None
        if isinstance(vocab, int) and not d.tokenizer:
            vocabs.append((vocab, f"the tokenizer of {key}={path} (its stats.json)"))
    if d.tokenizer:
        from megatron_taper.data.tokenizer import Tokenizer

        try:
            vocabs.append((Tokenizer(d.tokenizer).vocab_size, f"data.tokenizer={d.tokenizer}"))
        except ValueError as e:
            raise ConfigError(f"data.tokenizer: {e}") from None
    for vocab, where in vocabs:
        if vocab > m.vocab_size:
            raise ConfigError(f"{where} has {vocab} ids, more than model.vocab_size={m.vocab_size}: ids >= "
                              f"{m.vocab_size} would index past the embedding; set model.vocab_size={vocab} (or "
                              f"more)")
        if vocab < m.vocab_size and warn:
            warnings.warn(f"model.vocab_size={m.vocab_size} is larger than the {vocab} ids of {where}: "
                          f"{m.vocab_size - vocab} embedding and output rows are padding that no token uses",
                          stacklevel=2)
