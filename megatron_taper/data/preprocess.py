"""Documents -> tokens + EOS -> MDS shards in train/ and val/ splits, stats.json (the writing side of
the format described in megatron_taper.data.streaming).

Output is built in a sibling folder `OUTPUT.partial-*` and renamed to OUTPUT only when complete,
so an interrupted run never leaves anything at OUTPUT (a killed run may leave the `.partial-*`
folder; nothing reads it). A document goes to val when a keyed hash of its text falls below
`val_fraction`: deterministic, independent of input order and worker count, and duplicates of a
document always land in the same split.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator, Sequence

import numpy as np

from megatron_taper.data import STATS_FILE
from megatron_taper.data.corpus import Document, SkipLog, progress_bar
from megatron_taper.data.streaming import (
    INDEX_FILE,
    LENGTHS_FILE,
    SHARD_HASH,
    TOKENIZER_FILE,
    TOKENS_COLUMN,
    token_dtype,
)
from megatron_taper.data.tokenizer import Tokenizer, model_sha256
from megatron_taper.data.torchvision_compat import import_streaming

FORMAT = "megatron_taper-mds-1"
_BATCH_BYTES = 1 << 20
_BATCH_DOCS = 4096


def check_output(output: str, overwrite: bool) -> None:
    """Refuses an existing non-empty output unless `overwrite` (before any work is done)."""
    if os.path.isfile(output):
        raise ValueError(f"--output {output} is a file; it must be a folder")
    if os.path.isdir(output) and os.listdir(output) and not overwrite:
        raise ValueError(f"--output {output} exists and is not empty; pass --overwrite to replace it")


def in_val_split(text: str, val_fraction: float, seed: int) -> bool:
    if val_fraction <= 0.0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=seed.to_bytes(8, "little")).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2.0**64


def preprocess(documents: Iterable[Document], tokenizer_path: str, output: str, *, skips: SkipLog,
               workers: int = 1, val_fraction: float = 0.0, split_seed: int = 0, overwrite: bool = False,
               compression: str | None = None, shard_size: str = "64mb", progress: bool = True,
               inputs: Sequence[str] = ()) -> dict:
    """Tokenizes and writes the dataset; returns the stats written to OUTPUT/stats.json."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction {val_fraction} must be in [0, 1)")
    if workers < 1:
        raise ValueError(f"--workers {workers} must be >= 1")
    if split_seed < 0:
        raise ValueError(f"--split-seed {split_seed} must be >= 0")
    check_output(output, overwrite)
    tokenizer = Tokenizer(tokenizer_path)
    import_streaming()  # kept out of the timed part
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(os.path.abspath(output)) + ".partial-", dir=parent)
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared dataset from other users
    try:
        started = time.time()
        splits = _SplitWriters(tmp, token_dtype(tokenizer.vocab_size), compression, shard_size)
        docs = tokens = in_bytes = 0
        bar = progress_bar("[preprocess]", progress)
        with ThreadPoolExecutor(1) as pool:
            # Encoding (C++ threads, GIL released) of batch i+1 overlaps reading/writing of batch i.
            pending = None
            for batch in _batches(documents):
                job = pool.submit(tokenizer.encode_batch, [d.text for d in batch], workers)
                if pending is not None:
                    tokens += _write(splits, *pending, tokenizer.eos_id, val_fraction, split_seed)
                pending = (batch, job)
                docs += len(batch)
                in_bytes += sum(len(d.text.encode("utf-8")) for d in batch)
                _update(bar, len(batch), docs, tokens, started)
            if pending is not None:
                tokens += _write(splits, *pending, tokenizer.eos_id, val_fraction, split_seed)
        if bar is not None:
            _update(bar, 0, docs, tokens, started)
            bar.close()
        split_stats = splits.finish()
        if "train" not in split_stats:
            raise ValueError("no training document was written (all inputs empty or skipped, or all in val); "
                             f"skipped: {skips.to_dict()['by_reason']}")
        warnings = []
        if val_fraction > 0 and "val" not in split_stats:
            warnings.append(f"--val-fraction {val_fraction} put no document into val; no val split written")
            print(f"[preprocess] warning: {warnings[-1]}", file=sys.stderr)
        shutil.copyfile(tokenizer_path, os.path.join(tmp, TOKENIZER_FILE))
        seconds = time.time() - started
        stats = {
            "format": FORMAT, "complete": True, "documents": docs, "tokens": tokens, "input_bytes": in_bytes,
            "splits": split_stats, "skipped": skips.to_dict(), "warnings": warnings,
            "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
            "dtype": token_dtype(tokenizer.vocab_size), "tokenizer": os.path.abspath(tokenizer_path),
            "tokenizer_sha256": model_sha256(tokenizer_path), "val_fraction": val_fraction,
            "split_seed": split_seed, "compression": compression, "shard_size": shard_size, "workers": workers,
            "inputs": list(inputs), "seconds": round(seconds, 3),
            "mb_per_s": round(in_bytes / 1e6 / max(seconds, 1e-9), 3),
            "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
        }
        with open(os.path.join(tmp, STATS_FILE), "w") as f:
            json.dump(stats, f, indent=1)
        _install(tmp, output)
        return stats
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class _SplitWriters:
    """One MDSWriter per split, opened on the split's first document."""

    def __init__(self, root: str, dtype: str, compression: str | None, shard_size: str) -> None:
        self.root, self.dtype, self.compression, self.shard_size = root, dtype, compression, shard_size
        self.writers: dict = {}
        self.lengths: dict[str, list[int]] = {}

    def write(self, split: str, tokens: np.ndarray) -> None:
        if split not in self.writers:
            import_streaming()
            from streaming.base.format import MDSWriter

            try:
                self.writers[split] = MDSWriter(
                    out=os.path.join(self.root, split), columns={TOKENS_COLUMN: f"ndarray:{self.dtype}"},
                    compression=self.compression, size_limit=self.shard_size, hashes=[SHARD_HASH])
            except ValueError as e:
                raise ValueError(f"--compression {self.compression} / --shard-size {self.shard_size}: {e}") from None
            self.lengths[split] = []
        self.writers[split].write({TOKENS_COLUMN: tokens})
        self.lengths[split].append(len(tokens))

    def finish(self) -> dict:
        stats = {}
        for split, writer in self.writers.items():
            writer.finish()
            lengths = np.array(self.lengths[split], np.uint32)
            np.save(os.path.join(self.root, split, LENGTHS_FILE), lengths)
            assert os.path.isfile(os.path.join(self.root, split, INDEX_FILE))
            stats[split] = {"documents": len(lengths), "tokens": int(lengths.sum(dtype=np.int64))}
        return stats


def _write(splits: _SplitWriters, batch: list[Document], job, eos: int, val_fraction: float, seed: int) -> int:
    n = 0
    for doc, ids in zip(batch, job.result()):
        tokens = np.array(ids + [eos], dtype=splits.dtype)
        splits.write("val" if in_val_split(doc.text, val_fraction, seed) else "train", tokens)
        n += len(tokens)
    return n


def _batches(documents: Iterable[Document]) -> Iterator[list[Document]]:
    batch: list[Document] = []
    size = 0
    for doc in documents:
        batch.append(doc)
        size += len(doc.text)
        if size >= _BATCH_BYTES or len(batch) >= _BATCH_DOCS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _install(tmp: str, output: str) -> None:
    """Atomically puts the finished folder at `output` (replacing what check_output allowed)."""
    old = None
    if os.path.isdir(output) and os.listdir(output):
        old = tempfile.mkdtemp(prefix=os.path.basename(os.path.abspath(output)) + ".old-",
                               dir=os.path.dirname(os.path.abspath(output)))
        os.replace(output, os.path.join(old, "data"))
    elif os.path.isdir(output):
        os.rmdir(output)
    os.replace(tmp, output)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)



def _update(bar, n: int, docs: int, tokens: int, started: float) -> None:
    if bar is None:
        return
    bar.update(n)
    bar.set_postfix_str(f"{tokens / max(time.time() - started, 1e-9):,.0f} tok/s", refresh=False)
