"""Nothing lost or corrupted silently: shard hashes checked on open (a flipped byte, a truncated
shard: one error naming the shard), an input that yields no document under --text-key is an
error naming it (fallback keys read both), one name rule for parquet and jsonl, a held-out split
by default."""
import json
import os
import shutil

import pytest

from megatron_taper.data.corpus import SkipLog, read_documents
from megatron_taper.data.preprocess import preprocess
from megatron_taper.data.streaming import ShardReader, StreamingSource
from tests.helpers.datahelpers import corpus, tokenizer_model, write_jsonl  # noqa: F401
from tools.preprocess_data import main as preprocess_main


@pytest.fixture(scope="module")
def small_dataset(corpus, tokenizer_model, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("integrity") / "data"
    skips = SkipLog(strict=True)
    preprocess(read_documents([corpus["jsonl"]], skips), tokenizer_model, str(out), skips=skips,
               val_fraction=0.2, shard_size="16kb", progress=False)
    return out


def _damaged_copy(src, dst, damage):
    shutil.copytree(src, dst)
    index = json.loads((dst / "train" / "index.json").read_text())
    shard = index["shards"][1]
    assert shard["raw_data"]["hashes"].get("xxh64")  # written by preprocess
    path = dst / "train" / shard["raw_data"]["basename"]
    data = bytearray(path.read_bytes())
    path.write_bytes(damage(data))
    return str(path)


def test_flipped_byte_in_a_shard_is_detected_naming_it(small_dataset, tmp_path):
    def flip(data):
        data[len(data) // 2] ^= 0x01  # one bit of one token: would otherwise train silently
        return bytes(data)

    shard = _damaged_copy(small_dataset, tmp_path / "d", flip)
    reader = ShardReader(str(tmp_path / "d"), "train")
    assert len(reader[0]) > 0  # shard 0 is intact and reads
    with pytest.raises(ValueError, match=rf"damaged MDS shard {shard}: its xxh64 hash .* \(damaged bytes\); "
                                         r"rewrite .* with tools/preprocess_data.py"):
        reader[int(reader._shard_ends[0])]  # the first document of shard 1


def test_truncated_shard_is_detected_naming_it(small_dataset, tmp_path):
    shard = _damaged_copy(small_dataset, tmp_path / "d", lambda data: bytes(data[: len(data) // 3]))
    (tmp_path / "d" / "train" / "doc_lengths.npy").unlink()  # lengths come from reading every shard
    with pytest.raises(ValueError, match=rf"damaged MDS shard {shard}: \d+ bytes where index.json records \d+ "
                                         r"\(truncated or overwritten\)"):
        StreamingSource(str(tmp_path / "d"), "train", 32, 2, 0, 1, 0)


def test_input_without_documents_under_the_key_fails_naming_it(tokenizer_model, tmp_path):  # noqa: F811
    body = write_jsonl(tmp_path / "body.jsonl", ["first document", "second document"], key="body")
    text = write_jsonl(tmp_path / "text.jsonl", ["third document", "fourth document", "fifth"], key="text")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=rf"{text}: no document in this input \(skipped: 3 missing_field; last: "
                                         rf"{text}:3: missing_field: no field 'body'\); is the text under another "
                                         r"field\? --text-key takes a comma-separated list"):
        preprocess(read_documents([str(body), str(text)], SkipLog(), json_key="body"), tokenizer_model, str(out),
                   skips=SkipLog(), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["body.jsonl", "text.jsonl"]  # nothing written, no partial folder
    # the tool: one line, exit 2
    assert preprocess_main(["--input", str(body), str(text), "--tokenizer", tokenizer_model, "--output", str(out),
                            "--text-key", "body", "--no-progress"]) == 2
    # fallback keys, tried in order per record, read every document
    docs = list(read_documents([str(body), str(text)], SkipLog(strict=True), json_key="body,text"))
    assert [d.text for d in docs] == ["first document", "second document", "third document", "fourth document",
                                      "fifth"]


def test_empty_inputs_error_for_records_and_warn_for_text(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "full.txt").write_text("a document\n")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.warns(UserWarning, match=r"empty.txt: no document in this input \(skipped: 1 empty_document"):
        docs = list(read_documents([str(tmp_path / "full.txt"), str(tmp_path / "empty.txt")], SkipLog()))
    assert [d.text for d in docs] == ["a document\n"]
    with pytest.raises(ValueError, match=r"empty.jsonl: no document in this input \(it is empty\)"):
        list(read_documents([str(tmp_path / "full.txt"), str(tmp_path / "empty.jsonl")], SkipLog()))


def test_tokenizer_that_is_not_sentencepiece_is_one_line(corpus, tmp_path, capsys):  # noqa: F811
    assert preprocess_main(["--input", corpus["jsonl"], "--tokenizer", corpus["jsonl"], "--output",
                            str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"preprocess_data: error: {corpus['jsonl']} is not a sentencepiece model (") and \
        err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_parquet_named_jsonl_is_refused_like_jsonl_named_parquet(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "rows.jsonl")
    with pytest.raises(ValueError, match=r"rows.jsonl: the name says JSON lines but the content is parquet"):
        list(read_documents([str(tmp_path / "rows.jsonl")], SkipLog()))
    write_jsonl(tmp_path / "rows.parquet", ["a"])
    with pytest.raises(ValueError, match=r"rows.parquet: the name says parquet but the content is not"):
        list(read_documents([str(tmp_path / "rows.parquet")], SkipLog()))


def test_preprocess_writes_a_held_out_split_by_default(corpus, tokenizer_model, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "out"
    assert preprocess_main(["--input", corpus["jsonl"], "--tokenizer", tokenizer_model, "--output", str(out),
                            "--no-progress"]) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert stats["val_fraction"] == 0.01 and stats["splits"]["val"]["documents"] > 0
