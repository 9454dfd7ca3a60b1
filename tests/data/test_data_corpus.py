"""Input readers: kinds of input, each malformed-line case, --strict with file:line, embedded corpus."""
import gzip
import json

import pytest

from megatron_taper.data.corpus import (
    SkipLog,
    embedded_documents,
    embedded_files,
    expand_inputs,
    read_documents,
    stdlib_root,
)

BAD_JSONL_LINES = [
    json.dumps({"text": "good one"}),
    "{not json",                                   # 2 invalid_json
    json.dumps({"body": "no text field"}),         # 3 missing_field
    json.dumps({"text": 42}),                      # 4 missing_field (not a string)
    "",                                            # 5 blank: ignored, not counted
    json.dumps({"text": "   \n "}),                # 6 empty_document
    json.dumps(["a", "list"]),                     # 7 missing_field
    json.dumps({"text": "good two"}),
]


def _write_bad(tmp_path):
    path = tmp_path / "bad.jsonl"
    data = ("\n".join(BAD_JSONL_LINES) + "\n").encode()
    data += b'{"text": "caf\xe9 latin-1"}\n'             # 9 invalid_utf8
    data += b'{"text": "lone \\ud800 surrogate"}\n'       # 10 invalid_utf8
    path.write_bytes(data)
    return path


def test_each_malformed_case_is_skipped_and_counted_with_file_line(tmp_path):
    path = _write_bad(tmp_path)
    skips = SkipLog()
    docs = list(read_documents([str(path)], skips))
    assert [d.text for d in docs] == ["good one", "good two"]
    assert [d.source for d in docs] == [f"{path}:1", f"{path}:8"]
    assert skips.counts == {"invalid_json": 1, "missing_field": 3, "empty_document": 1, "invalid_utf8": 2}
    where = [e.split(": ")[0] for e in skips.examples]
    assert where == [f"{path}:{n}" for n in (2, 3, 4, 6, 7, 9, 10)]


@pytest.mark.parametrize("line, reason", [
    ("{not json", "invalid_json"), (json.dumps({"body": "x"}), "missing_field"),
    (json.dumps({"text": ""}), "empty_document"), (b'{"text": "\xff"}', "invalid_utf8"),
])
def test_strict_fails_with_file_line(tmp_path, line, reason):
    path = tmp_path / "in.jsonl"
    line = line if isinstance(line, bytes) else line.encode()
    path.write_bytes(b'{"text": "fine"}\n\n' + line + b"\n")
    with pytest.raises(ValueError, match=rf"^{path}:3: {reason}: "):
        list(read_documents([str(path)], SkipLog(strict=True)))


def test_text_files_modes_gz_folders_globs(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.txt").write_text("first para\nline two\n\n\nsecond para\n")
    (tmp_path / "d" / "sub" / "b.txt.gz").write_bytes(gzip.compress("gz doc\n".encode()))
    (tmp_path / "d" / ".hidden").write_text("never read")
    (tmp_path / "d" / "bad.txt").write_bytes(b"ok line\nbad \xc3\x28 line\n")
    (tmp_path / "d" / "empty.txt").write_text("  \n")
    (tmp_path / "k.jsonl.gz").write_bytes(gzip.compress(b'{"body": "from key"}\n'))

    files = expand_inputs([str(tmp_path / "d")])
    assert [f.split("/d/")[1] for f in files] == ["a.txt", "bad.txt", "empty.txt", "sub/b.txt.gz"]
    assert expand_inputs([str(tmp_path / "d" / "**" / "*.gz")]) == [str(tmp_path / "d" / "sub" / "b.txt.gz")]

    skips = SkipLog()
    whole = [d.text for d in read_documents([str(tmp_path / "d")], skips)]
    assert whole == ["first para\nline two\n\n\nsecond para\n", "gz doc\n"]
    assert skips.counts["invalid_utf8"] == 1 and skips.examples[0].startswith(f"{tmp_path}/d/bad.txt:2: ")
    assert skips.counts["empty_document"] == 1

    skips = SkipLog()
    lines = [d.text for d in read_documents([str(tmp_path / "d")], skips, text_mode="line")]
    assert lines == ["first para", "line two", "second para", "ok line", "gz doc"]
    paras = read_documents([str(tmp_path / "d" / "a.txt")], SkipLog(), text_mode="paragraph")
    assert [(d.text, d.source.rsplit(":", 1)[1]) for d in paras] == [("first para\nline two", "1"),
                                                                     ("second para", "5")]
    keyed = read_documents([str(tmp_path / "k.jsonl.gz")], SkipLog(), json_key="body")
    assert [d.text for d in keyed] == ["from key"]


def test_user_errors_name_the_input(tmp_path):
    with pytest.raises(ValueError, match="nope: no such file"):
        read_documents([str(tmp_path / "nope")], SkipLog())
    with pytest.raises(ValueError, match="matches no file"):
        read_documents([str(tmp_path / "*.zzz")], SkipLog())
    (tmp_path / "broken.txt.gz").write_bytes(gzip.compress(b"x" * 1000)[:20])
    with pytest.raises(ValueError, match="broken.txt.gz: not a readable gzip"):
        list(read_documents([str(tmp_path / "broken.txt.gz")], SkipLog()))
    with pytest.raises(ValueError, match="--text-mode"):
        read_documents([str(tmp_path)], SkipLog(), text_mode="words")


def test_embedded_corpus_is_sorted_capped_and_from_the_stdlib():
    files = embedded_files(300_000)
    rel = [f[len(stdlib_root()) + 1:] for f in files]
    assert rel == sorted(rel) and all(r.endswith(".py") for r in rel)
    assert not any(part in ("site-packages", "test", "tests") for r in rel for part in r.split("/"))
    import os

    assert 200_000 < sum(os.path.getsize(f) for f in files) <= 300_000
    docs = list(embedded_documents(300_000))
    assert docs == list(embedded_documents(300_000)) and len(docs) >= len(files) - 2
