"""Bad data is one clear line naming the file: an index.json whose `samples` disagrees with its shard
names the shard (it was "not enough values to unpack"); a data.tokenizer other than the one the
shards were written with (stats.json's sha256) is refused naming both, at the launch check and when
the data is built (old folders without the record: a warning); a Latin-1 input is one warning line
naming the file, its first bad byte and the iconv command, and is skipped like other malformed input."""
import json
import shutil
import warnings

import pytest

from megatron_taper.config import load_config
from megatron_taper.data.corpus import SkipLog, read_documents
from megatron_taper.data.sources import build_sources
from megatron_taper.data.streaming import StreamingSource
from megatron_taper.data.tokenizer import train_tokenizer
from tests.helpers.datahelpers import VOCAB, corpus, dataset, stdlib_documents, tokenizer_model  # noqa: F401
from tools.preprocess_data import main as preprocess_main


def test_inflated_samples_in_index_json_names_the_shard(dataset, tmp_path):  # noqa: F811
    copy = tmp_path / "d"
    shutil.copytree(dataset, copy)
    index = json.loads((copy / "train" / "index.json").read_text())
    index["shards"][1]["samples"] += 50
    (copy / "train" / "index.json").write_text(json.dumps(index))
    (copy / "train" / "doc_lengths.npy").unlink()  # lengths come from reading every shard
    shard = copy / "train" / index["shards"][1]["raw_data"]["basename"]
    held = index["shards"][1]["samples"] - 50
    with pytest.raises(ValueError) as e:
        StreamingSource(str(copy), "train", 32, 2, 0, 1, 0)
    assert str(e.value) == (f"damaged MDS shard {shard}: it holds {held} samples where {copy}/train/index.json "
                            f"records {held + 50} (an edited or mismatched index.json); rewrite {copy}/train with "
                            f"tools/preprocess_data.py")


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory) -> str:
    prefix = tmp_path_factory.mktemp("other_tok") / "other"
    train_tokenizer(stdlib_documents(60_000, seed=1), str(prefix), VOCAB, seed=1)
    return str(prefix) + ".model"


def _build(path: str, tokenizer: str):
    data = load_config(None, [f"data.path={path}", f"data.tokenizer={tokenizer}"]).data
    return build_sources(data, seq_len=32, micro_batch=2, seed=0, vocab_size=VOCAB, dp_rank=0, dp_size=1)


def test_another_tokenizer_than_the_shards_is_refused_naming_both(dataset, tokenizer_model, other_tokenizer,  # noqa: F811
                                                                  tmp_path, capsys):
    from megatron_taper.launch_check import main as launch_check

    recorded = json.loads(open(f"{dataset}/stats.json").read())["tokenizer_sha256"]
    with pytest.raises(ValueError) as e:
        _build(dataset, other_tokenizer)
    message = str(e.value)
    assert message.startswith(f"data.tokenizer={other_tokenizer} (sha256 ")
    assert f"is not the tokenizer data.path={dataset} was written with ({tokenizer_model}, sha256 {recorded[:16]}, " \
           f"{VOCAB} ids, in its stats.json)" in message and "\n" not in message
    train, _ = _build(dataset, tokenizer_model)  # the same tokenizer: accepted
    assert train.next_batch().shape == (2, 33)
    code = launch_check(["--world-size", "1", "--config", "configs/tiny_taper.yaml", f"data.path={dataset}",
                         f"data.tokenizer={other_tokenizer}", f"model.vocab_size={VOCAB}",
                         f"run.dir={tmp_path / 'run'}"])
    assert code == 2 and capsys.readouterr().err == f"error: {message}\n"
    old = tmp_path / "old"  # a folder written before the record: a warning, not a refusal
    shutil.copytree(dataset, old)
    stats = json.loads((old / "stats.json").read_text())
    del stats["tokenizer_sha256"]
    (old / "stats.json").write_text(json.dumps(stats))
    with pytest.warns(UserWarning, match=rf"data.path={old}: its stats.json records no tokenizer"):
        _build(str(old), other_tokenizer)


def test_latin1_input_is_one_line_with_the_fix(tmp_path, tokenizer_model, capsys):  # noqa: F811
    latin1 = tmp_path / "notes.txt"
    latin1.write_bytes("first line\ncaf\u00e9 ol\u00e9\n".encode("latin-1"))
    good = tmp_path / "good.txt"
    good.write_text("a good document\n")
    skips = SkipLog()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        docs = list(read_documents([str(latin1), str(good)], skips))
    assert [d.source for d in docs] == [f"{good}:1"] and skips.counts["invalid_utf8"] == 1
    assert [str(w.message) for w in seen] == [
        f"{latin1}:2: byte 0xe9 (byte 4 of line 2) is not UTF-8: the whole input skipped; if the input is Latin-1, "
        f"convert it to UTF-8 and pass that file: iconv -f latin1 -t utf-8 {latin1} > {latin1}.utf8"]
    code = preprocess_main(["--input", str(latin1), str(good), "--tokenizer", tokenizer_model, "--output",
                            str(tmp_path / "out"), "--no-progress", "--val-fraction", "0"])
    err = capsys.readouterr().err
    assert code == 0 and err == f"[preprocess] warning: {seen[0].message}\n"  # one line, no source code
    strict = preprocess_main(["--input", str(latin1), "--tokenizer", tokenizer_model, "--output",
                              str(tmp_path / "strict"), "--no-progress", "--strict"])
    assert strict == 2 and f"{latin1}:2: invalid_utf8: byte 0xe9" in capsys.readouterr().err
