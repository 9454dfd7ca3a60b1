"""The built-in dataset: a byte-exact BPE tokenizer and MDS shards made from the embedded corpus
(the Python standard library's sources), built once per cache folder and reused.

Concurrent callers (e.g. every torchrun rank) are safe: one builds under a file lock in a private
temporary folder and renames it into place; the others wait on the lock and then reuse it.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import sentencepiece
from filelock import FileLock

from megatron_taper.data import is_complete
from megatron_taper.data.corpus import EMBEDDED_MAX_BYTES, SkipLog, embedded_documents, embedded_files, stdlib_root
from megatron_taper.data.preprocess import preprocess
from megatron_taper.data.tokenizer import train_tokenizer

BUILTIN_VERSION = 1
BUILTIN_VAL_FRACTION = 0.05
BUILTIN_SEED = 0


def builtin_data_dir(cache_dir: str, vocab_size: int, max_bytes: int = EMBEDDED_MAX_BYTES) -> str:
    """The folder the built-in data for these settings lives in (a key of everything it depends on)."""
    root = stdlib_root()
    files = [(os.path.relpath(p, root), os.path.getsize(p)) for p in embedded_files(max_bytes)]
    key = json.dumps([BUILTIN_VERSION, platform.python_version(), sentencepiece.__version__, vocab_size,
                      max_bytes, BUILTIN_VAL_FRACTION, BUILTIN_SEED, files])
    return os.path.join(os.path.abspath(cache_dir),
                        f"builtin-stdlib-v{vocab_size}-{hashlib.sha256(key.encode()).hexdigest()[:12]}")


def prepare_builtin_data(cache_dir: str, vocab_size: int, max_bytes: int = EMBEDDED_MAX_BYTES) -> str:
    """Returns the data folder (train/, val/, stats.json, tokenizer.model), building it if needed."""
    if vocab_size < 260:
        raise ValueError(f"model.vocab_size={vocab_size} is too small for the built-in byte-fallback tokenizer "
                         f"(>= 260)")
    out = builtin_data_dir(cache_dir, vocab_size, max_bytes)
    if is_complete(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with FileLock(out + ".lock"):
        if is_complete(out):
            return out
        started = time.time()
        print(f"[data] building the built-in dataset (Python stdlib sources, {max_bytes / 1e6:.1f} MB, "
              f"vocab {vocab_size}) into {out} ...", end="", file=sys.stderr, flush=True)
        work = tempfile.mkdtemp(prefix=".building-", dir=os.path.dirname(out))
        try:  # the progress line is finished (newline) on success and on failure
            docs = list(embedded_documents(max_bytes))
            prefix = os.path.join(work, "tokenizer")
            train_tokenizer((d.text for d in docs), prefix, vocab_size, seed=BUILTIN_SEED,
                            num_threads=min(4, os.cpu_count() or 1), extra={"corpus": "python-stdlib"})
            preprocess(docs, prefix + ".model", os.path.join(work, "data"), skips=SkipLog(),
                       workers=min(4, os.cpu_count() or 1), val_fraction=BUILTIN_VAL_FRACTION,
                       split_seed=BUILTIN_SEED, progress=False, inputs=[stdlib_root()])
            shutil.copyfile(prefix + ".json", os.path.join(work, "data", "tokenizer.json"))
            if os.path.isdir(out):  # a stale incomplete folder (not written by this code) is replaced
                shutil.rmtree(out)
            os.replace(os.path.join(work, "data"), out)
        except BaseException:
            print(" failed", file=sys.stderr, flush=True)
            raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(f" done in {time.time() - started:.1f} s", file=sys.stderr, flush=True)
    return out
