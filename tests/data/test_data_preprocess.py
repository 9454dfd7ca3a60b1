"""tools/preprocess_data.py: round trip, splits, workers, refusal, interrupted runs, strict mode."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from megatron_taper.data import is_complete
from megatron_taper.data import preprocess as preprocess_module
from megatron_taper.data.corpus import SkipLog, read_documents
from megatron_taper.data.preprocess import in_val_split, preprocess
from megatron_taper.data.streaming import ShardReader
from megatron_taper.data.tokenizer import Tokenizer
from tests.helpers.datahelpers import VOCAB, corpus, dataset, tokenizer_model, write_jsonl  # noqa: F401
from tests.helpers.runner import REPO
from tools.preprocess_data import main


def _decoded(path, split, tok):
    reader = ShardReader(path, split)
    docs = [reader[i] for i in range(len(reader))]
    assert all(d[-1] == tok.eos_id and tok.eos_id not in d[:-1] for d in docs)
    assert reader.lengths.read(0, len(reader)).tolist() == [len(d) for d in docs]
    return [tok.decode(d.tolist()) for d in docs]


def test_round_trip_every_token_decodes_to_the_input_documents(corpus, dataset, tokenizer_model):
    tok = Tokenizer(os.path.join(dataset, "tokenizer.model"))
    train, val = _decoded(dataset, "train", tok), _decoded(dataset, "val", tok)
    expected_val = [d for d in corpus["docs"] if in_val_split(d, 0.2, 0)]
    assert val == expected_val and 0 < len(val) < len(corpus["docs"]) / 3
    assert train == [d for d in corpus["docs"] if not in_val_split(d, 0.2, 0)]
    stats = json.loads(open(os.path.join(dataset, "stats.json")).read())
    assert stats["complete"] and stats["documents"] == len(corpus["docs"])
    assert stats["splits"]["val"]["documents"] == len(val)
    assert stats["tokens"] == sum(s["tokens"] for s in stats["splits"].values())
    assert stats["vocab_size"] == VOCAB and stats["dtype"] == "uint16"
    assert len([f for f in os.listdir(os.path.join(dataset, "train")) if f.endswith(".mds")]) > 3


def test_tool_workers_give_identical_shards_and_counts_skips(corpus, tokenizer_model, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine doc"}\n{oops\n{"text": ""}\n')
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        rc = main(["--input", corpus["jsonl"], str(bad), "--tokenizer", tokenizer_model, "--output", str(out),
                   "--workers", str(workers), "--val-fraction", "0.2", "--no-progress", "--compression", "zstd"])
        assert rc == 0, capsys.readouterr().err
        outs.append(out)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["skipped"] == {"invalid_json": 1, "missing_field": 0, "invalid_utf8": 0, "empty_document": 1}
    stats = json.loads((outs[1] / "stats.json").read_text())
    assert stats["skipped"]["examples"][0].startswith(f"{bad}:2: invalid_json")
    for split in ("train", "val"):
        a, b = ShardReader(str(outs[0]), split), ShardReader(str(outs[1]), split)
        assert len(a) == len(b) and all(np.array_equal(a[i], b[i]) for i in range(len(a)))
    assert any(f.endswith(".mds.zstd") for f in os.listdir(outs[0] / "train"))


def test_strict_fails_with_file_line_and_writes_nothing(corpus, tokenizer_model, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine doc"}\n{"text": "x", "t": 1}\n{"other": "x"}\n')
    out = tmp_path / "out"
    rc = main(["--input", str(bad), "--tokenizer", tokenizer_model, "--output", str(out), "--strict", "--no-progress"])
    assert rc == 2
    assert f"{bad}:3: missing_field" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["bad.jsonl"]


def test_non_empty_output_is_refused_without_overwrite(corpus, tokenizer_model, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    args = ["--input", corpus["jsonl"], "--tokenizer", tokenizer_model, "--output", str(out), "--no-progress"]
    assert main(args) == 2
    assert "exists and is not empty; pass --overwrite" in capsys.readouterr().err
    assert os.listdir(out) == ["keep.txt"]
    assert main(args + ["--overwrite"]) == 0
    assert sorted(os.listdir(out)) == ["stats.json", "tokenizer.model", "train", "val"]  # val: the default 1%
    assert sorted(os.listdir(tmp_path)) == ["out"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(args[:5] + [str(empty), "--no-progress"]) == 0 and is_complete(str(empty))


def test_interrupted_run_leaves_no_complete_looking_output(corpus, tokenizer_model, tmp_path, monkeypatch):
    docs = list(read_documents([corpus["jsonl"]], SkipLog()))

    def interrupted():
        for i, doc in enumerate(docs):
            if i == len(docs) - 3:
                raise KeyboardInterrupt
            yield doc

    monkeypatch.setattr(preprocess_module, "_BATCH_DOCS", 16)
    with pytest.raises(KeyboardInterrupt):
        preprocess(interrupted(), tokenizer_model, str(tmp_path / "out"), skips=SkipLog(), progress=False)
    assert os.listdir(tmp_path) == []


def test_killed_run_leaves_no_output(tokenizer_model, tmp_path):
    """SIGKILL (no cleanup possible) while the tool is reading its input: nothing at --output."""
    fifo = tmp_path / "input.jsonl"
    os.mkfifo(fifo)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", str(fifo),
                             "--tokenizer", tokenizer_model, "--output", str(out), "--no-progress"],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE)
    with open(fifo, "w") as f:
        for i in range(3000):
            f.write(json.dumps({"text": f"document number {i} " * 5}) + "\n")
        f.flush()
        deadline = time.time() + 120
        while not any(n.startswith("out.partial-") for n in os.listdir(tmp_path)):
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
            time.sleep(0.1)
        time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not out.exists() and not is_complete(str(out))
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith("out.partial-")]
    assert len(leftovers) == 1 and not is_complete(str(tmp_path / leftovers[0]))


def test_no_val_document_is_reported(tokenizer_model, tmp_path):
    path = write_jsonl(tmp_path / "one.jsonl", ["a single document"])
    stats = preprocess(read_documents([str(path)], SkipLog()), tokenizer_model, str(tmp_path / "out"),
                       skips=SkipLog(), val_fraction=0.01, progress=False)
    assert stats["warnings"] and "val" not in stats["splits"]
    assert not (tmp_path / "out" / "val").exists()
