"""Tokenizer: byte-exact round trips, deterministic training, the tool's outputs."""
import json
import os

import pytest

from megatron_taper.data.tokenizer import Tokenizer, train_tokenizer
from tests.helpers.datahelpers import TRICKY, VOCAB, corpus, stdlib_documents, tokenizer_model  # noqa: F401


def test_byte_exact_round_trip(tokenizer_model):
    tok = Tokenizer(tokenizer_model)
    assert tok.vocab_size == VOCAB and tok.eos_id == 2
    unseen = ["Ω≈ç√∫ unseen symbols ☃ \x00\x01 control", "", " ", "\n", "a\r\n\r\nb"]
    for text in TRICKY + unseen + stdlib_documents(20_000, seed=3):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode(ids + [tok.eos_id]) == text  # EOS decodes to nothing
    batch = TRICKY * 3
    assert tok.encode_batch(batch, num_threads=2) == [tok.encode(t) for t in batch]


def test_space_mark_round_trips(tmp_path):
    """U+2581, sentencepiece's own whitespace symbol, comes back as itself, not as a space."""
    import sentencepiece as spm

    from megatron_taper.data.tokenizer import SPACE_MARK

    docs = stdlib_documents(30_000) + [f"a{SPACE_MARK}b {SPACE_MARK}{SPACE_MARK} c\n"] * 20
    train_tokenizer(docs, str(tmp_path / "m"), 400, seed=0)
    tok = Tokenizer(str(tmp_path / "m.model"))
    raw = spm.SentencePieceProcessor(model_file=str(tmp_path / "m.model"))
    marked = [SPACE_MARK, f"a{SPACE_MARK}b", f" {SPACE_MARK} ", f"{SPACE_MARK}{SPACE_MARK}x{SPACE_MARK}",
              f"def f():\n    return '{SPACE_MARK}'  # ✓ 🙂\n", f"\t{SPACE_MARK}\r\n\u00e9{SPACE_MARK}\U0001f680"]
    assert raw.decode(raw.encode(f"a{SPACE_MARK}b")) == "a b"  # what plain sentencepiece does
    for text in marked:
        ids = tok.encode(text)
        assert tok.decode(ids) == text and tok.decode(ids + [tok.eos_id]) == text
    # ordinary text: byte-exact round trip with exactly sentencepiece's ids (existing data unchanged)
    ordinary = TRICKY + stdlib_documents(20_000, seed=4)
    for text in ordinary:
        assert tok.encode(text) == raw.encode(text)
        assert tok.decode(tok.encode(text)).encode("utf-8") == text.encode("utf-8")
    batch = marked + ordinary[:10] + marked
    assert tok.encode_batch(batch, num_threads=2) == [tok.encode(t) for t in batch]
    assert tok.encode_batch(ordinary[:10]) == raw.encode(ordinary[:10])
    # a model that is not byte-exact (dummy prefix) keeps plain sentencepiece encoding
    train_tokenizer(docs, str(tmp_path / "n"), 400, seed=0, byte_exact=False)
    loose = Tokenizer(str(tmp_path / "n.model"))
    raw_loose = spm.SentencePieceProcessor(model_file=str(tmp_path / "n.model"))
    assert loose.encode(marked[1]) == raw_loose.encode(marked[1])


def test_training_is_deterministic_for_a_seed(tmp_path):
    docs = stdlib_documents(40_000)
    a = train_tokenizer(docs, str(tmp_path / "a"), 400, seed=5)
    b = train_tokenizer(docs, str(tmp_path / "sub" / "b"), 400, seed=5)
    assert a["sha256"] == b["sha256"]
    assert (tmp_path / "a.model").read_bytes() == (tmp_path / "sub" / "b.model").read_bytes()
    # a sample of training lines drawn with another seed gives another model
    c = train_tokenizer(docs, str(tmp_path / "c"), 400, seed=6, max_sentences=200)
    d = train_tokenizer(docs, str(tmp_path / "d"), 400, seed=7, max_sentences=200)
    assert c["sha256"] != d["sha256"]
    for name in ("a.model", "a.vocab", "a.json"):
        assert (tmp_path / name).is_file()
    settings = json.loads((tmp_path / "a.json").read_text())
    assert settings["byte_exact"] and settings["trainer_options"]["normalization_rule_name"] == "identity"
    assert len((tmp_path / "a.vocab").read_text(encoding="utf-8").splitlines()) == 400


def test_unigram_and_bad_settings(tmp_path):
    docs = stdlib_documents(30_000)
    train_tokenizer(docs, str(tmp_path / "u"), 400, model_type="unigram", seed=0)
    tok = Tokenizer(str(tmp_path / "u.model"))
    assert tok.decode(tok.encode(docs[0])) == docs[0]
    with pytest.raises(ValueError, match="--vocab-size"):
        train_tokenizer(docs, str(tmp_path / "v"), 100)
    with pytest.raises(ValueError, match="--model-type"):
        train_tokenizer(docs, str(tmp_path / "v"), 400, model_type="wordpiece")
    with pytest.raises(ValueError, match="no text"):
        train_tokenizer(["", "  \n "], str(tmp_path / "v"), 300)
    with pytest.raises(ValueError, match="not found"):
        Tokenizer(str(tmp_path / "missing.model"))
    assert not any(n.startswith("v") for n in os.listdir(tmp_path))


def test_train_tokenizer_tool(corpus, tmp_path, capsys):
    from tools.train_tokenizer import main

    gz = tmp_path / "in" / "docs.txt.gz"
    gz.parent.mkdir()
    import gzip

    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write("\n\n".join(d.strip("\n") for d in corpus["docs"][:80]))
    rc = main(["--input", corpus["jsonl"], str(tmp_path / "in"), "--vocab-size", "400",
               "--output", str(tmp_path / "out" / "tok"), "--threads", "1"])
    assert rc == 0, capsys.readouterr().err
    settings = json.loads((tmp_path / "out" / "tok.json").read_text())
    assert settings["skipped"]["total"] == 0 and len(settings["inputs"]) == 2
    tok = Tokenizer(str(tmp_path / "out" / "tok.model"))
    assert tok.decode(tok.encode(TRICKY[2])) == TRICKY[2]
    assert main(["--input", str(tmp_path / "nope"), "--vocab-size", "400", "--output", str(tmp_path / "x")]) == 2
    assert "nope: no such file or folder" in capsys.readouterr().err
