"""Small corpora, a tokenizer and an MDS dataset for the data tests (built once per session)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from megatron_taper.data.corpus import SkipLog, read_documents, stdlib_root
from megatron_taper.data.preprocess import preprocess
from megatron_taper.data.tokenizer import train_tokenizer

VOCAB = 512
TRICKY = [
    "  leading spaces, trailing spaces   \n\n\n",
    "tabs\tand\t\tmore\ttabs\r\nwindows line end\r\n",
    "Unicode: ÆØÅ äöü ñ 中文 日本語 한국어 🙂🚀 \u200b zero-width, combining e\u0301",
    "x" * 700,
    "\n    indented\n        deeper\n",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment ✓\n",
]


def stdlib_documents(n_bytes: int = 120_000, seed: int = 0) -> list[str]:
    """Pieces of the standard library's sources (every machine has them), cut at line ends."""
    root = Path(stdlib_root())
    rng = random.Random(seed)
    docs, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        lines = text.splitlines(keepends=True)
        while lines and total < n_bytes:
            take = rng.randint(3, 60)
            piece = "".join(lines[:take])
            lines = lines[take:]
            if piece.strip():
                docs.append(piece)
                total += len(piece)
        if total >= n_bytes:
            break
    return docs


def all_documents() -> list[str]:
    return stdlib_documents() + TRICKY


def write_jsonl(path: Path, docs: list[str], key: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({key: doc, "id": i}) + "\n")
    return path


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict:
    """{'jsonl': path of a jsonl file with all documents, 'docs': the documents}."""
    root = tmp_path_factory.mktemp("corpus")
    docs = all_documents()
    return {"jsonl": str(write_jsonl(root / "docs.jsonl", docs)), "docs": docs}


@pytest.fixture(scope="session")
def tokenizer_model(corpus, tmp_path_factory) -> str:
    prefix = tmp_path_factory.mktemp("tok") / "tok"
    train_tokenizer(corpus["docs"], str(prefix), VOCAB, seed=0)
    return str(prefix) + ".model"


@pytest.fixture(scope="session")
def dataset(corpus, tokenizer_model, tmp_path_factory) -> str:
    """An MDS dataset (train + val 20%) of the corpus; small shards so that there are several."""
    out = tmp_path_factory.mktemp("mds") / "data"
    skips = SkipLog(strict=True)
    preprocess(read_documents([corpus["jsonl"]], skips), tokenizer_model, str(out), skips=skips,
               val_fraction=0.2, shard_size="16kb", progress=False)
    return str(out)


@pytest.fixture(scope="session")
def second_dataset(tokenizer_model, tmp_path_factory) -> str:
    """Another MDS dataset (train + val 20%), of other text (upper-cased library sources), same tokenizer."""
    root = tmp_path_factory.mktemp("mds2")
    docs = [d.upper() for d in stdlib_documents(12_000, seed=1)]
    skips = SkipLog(strict=True)
    preprocess(read_documents([str(write_jsonl(root / "upper.jsonl", docs))], skips), tokenizer_model,
               str(root / "upper"), skips=skips, val_fraction=0.2, shard_size="16kb", progress=False)
    return str(root / "upper")
