"""Input readers: tools/preprocess_data.py on parquet (text in another column, --text-key), .jsonl.zst,
a saved `datasets` folder and hf:<local folder> writes the same token stream as on the equivalent
jsonl; formats are told by content (a gzip file without .gz); binary input is one error naming the
file; tools/train_tokenizer.py reads parquet like jsonl and shows its progress."""
import gzip
import json
import os

import numpy as np
import pytest
from megatron_taper_tools import preprocess_data, train_tokenizer

from megatron_taper.data import tokenizer as tokenizer_module
from megatron_taper.data.corpus import SkipLog, read_documents
from megatron_taper.data.streaming import ShardReader
from tests.helpers.datahelpers import (  # noqa: F401
    TRICKY,
    VOCAB,
    corpus,
    stdlib_documents,
    tokenizer_model,
    write_jsonl,
)

DOCS = stdlib_documents(8_000, seed=3) + TRICKY


def _stream(out):
    """Every split's documents' tokens, concatenated in storage order."""
    parts = []
    for split in ("train", "val"):
        if os.path.isdir(os.path.join(out, split)):
            reader = ShardReader(str(out), split)
            parts += [reader[i].astype(np.int64) for i in range(len(reader))]
    return np.concatenate(parts)


def _preprocess(inputs, tokenizer, out, *extra):
    args = ["--input", *inputs, "--tokenizer", tokenizer, "--output", str(out), "--val-fraction", "0.2",
            "--no-progress", *extra]
    assert preprocess_data.main(args) == 0
    return _stream(out)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    root = tmp_path_factory.mktemp("readers")
    jsonl = write_jsonl(root / "docs.jsonl", DOCS)
    table = pa.table({"id": list(range(len(DOCS))), "body": DOCS})
    pq.write_table(table, root / "docs.parquet", row_group_size=7)  # several row groups
    (root / "docs.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl.read_bytes()))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS})}).save_to_disk(str(root / "saved"))
    os.makedirs(root / "hub")
    write_jsonl(root / "hub" / "train.jsonl", DOCS)
    return root


def test_parquet_zstd_and_datasets_give_the_jsonl_token_stream(inputs, tokenizer_model, tmp_path):
    reference = _preprocess([str(inputs / "docs.jsonl")], tokenizer_model, tmp_path / "jsonl")
    assert len(reference) > 2000
    runs = {"parquet": ([str(inputs / "docs.parquet")], ["--text-key", "body"]),
            "zst": ([str(inputs / "docs.jsonl.zst")], []),
            "saved": ([str(inputs / "saved")], []),
            "hub": ([f"hf:{inputs / 'hub'}"], [])}
    for name, (paths, extra) in runs.items():
        assert np.array_equal(_preprocess(paths, tokenizer_model, tmp_path / name, *extra), reference), name


def test_formats_are_told_by_content_and_binary_input_is_refused(inputs, tokenizer_model, tmp_path, capsys):
    plain = (inputs / "docs.jsonl").read_bytes()
    (tmp_path / "docs.jsonl.data").write_bytes(gzip.compress(plain))  # gzip without .gz: read as gzip
    (tmp_path / "docs.jsonl.data").rename(tmp_path / "docs.jsonl")
    texts = [d.text for d in read_documents([str(tmp_path / "docs.jsonl")], SkipLog(strict=True))]
    assert texts == DOCS
    # a parquet file read by content whatever its name; a missing column names the file and the columns
    (tmp_path / "rows.bin").write_bytes((inputs / "docs.parquet").read_bytes())
    assert [d.text for d in read_documents([str(tmp_path / "rows.bin")], SkipLog(), json_key="body")] == DOCS
    with pytest.raises(ValueError, match=r"rows.bin: no column 'text' \(columns: id, body\); choose one with "
                                         r"--text-key"):
        list(read_documents([str(tmp_path / "rows.bin")], SkipLog()))
    (tmp_path / "weights.bin").write_bytes(np.arange(1000, dtype=np.float32).tobytes())
    (tmp_path / "fake.parquet").write_text("not parquet\n")
    (tmp_path / "archive.tar.gz").write_bytes(gzip.compress(b"name\x00\x00\x00" + b"\x00" * 500))
    (tmp_path / "a.zip").write_bytes(b"PK\x03\x04" + b"x" * 100)
    for name, message in {"weights.bin": r"weights.bin: unsupported binary input \(NUL bytes",
                          "fake.parquet": r"fake.parquet: the name says parquet but the content is not",
                          "archive.tar.gz": r"archive.tar.gz \(decompressed\): unsupported binary input",
                          "a.zip": r"a.zip: unsupported binary input \(a zip archive\)"}.items():
        with pytest.raises(ValueError, match=message):
            list(read_documents([str(tmp_path / name)], SkipLog()))
    # through the tool: one line on stderr, exit code 2, nothing written
    assert preprocess_data.main(["--input", str(tmp_path / "weights.bin"), "--tokenizer", tokenizer_model,
                                 "--output", str(tmp_path / "never"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("preprocess_data: error: ") and "weights.bin: unsupported" in err[0]
    assert not (tmp_path / "never").exists()
    with pytest.raises(ValueError, match=r"saved: no split 'test' \(splits: train\)"):
        list(read_documents([str(inputs / "saved")], SkipLog(), hf_split="test"))


def test_tokenizer_from_parquet_equals_from_jsonl_and_shows_progress(inputs, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "HEARTBEAT_S", 0.01)
    common = ["--vocab-size", str(VOCAB), "--threads", "1"]
    assert train_tokenizer.main(["--input", str(inputs / "docs.jsonl"), "--output", str(tmp_path / "a"),
                                 "--no-progress", *common]) == 0
    assert capsys.readouterr().err == ""
    assert train_tokenizer.main(["--input", str(inputs / "docs.parquet"), "--text-key", "body", "--output",
                                 str(tmp_path / "b"), *common]) == 0
    err = capsys.readouterr().err
    assert "[tokenizer] reading" in err and f"{len(DOCS)}doc" in err.replace(" ", "")
    assert f"[tokenizer] training bpe (vocab {VOCAB}) on " in err and ": done in " in err
    assert (tmp_path / "a.model").read_bytes() == (tmp_path / "b.model").read_bytes()


def test_a_named_pipe_is_read_once_from_its_first_byte(tmp_path):
    """bash's `--input <(zcat x.jsonl.gz)` is a pipe: nothing may be lost to sniffing its format
    (its bytes can be read only once), so its name decides."""
    import threading

    fifo = tmp_path / "docs.jsonl"
    os.mkfifo(fifo)
    texts = [f"document {i} " * 7 for i in range(2000)]

    def write():
        with open(fifo, "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)

    writer = threading.Thread(target=write)
    writer.start()
    got = [d.text for d in read_documents([str(fifo)], SkipLog())]
    writer.join(10)
    assert got == texts
