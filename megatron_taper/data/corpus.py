"""Raw text inputs: files, folders, globs, .gz/.zst, jsonl, parquet, Hugging Face datasets;
malformed-line accounting; embedded corpus.

Input kinds (megatron_taper.data.readers decides from the first bytes and the name): parquet files,
saved `datasets` folders and `hf:NAME` give one document per row, the text in a configurable field
(`--text-key`, default `text`; a comma-separated list is tried in order: `body,text` takes
`body` where a record has it, else `text`); `*.jsonl`, `*.ndjson`, `*.json` (plain, .gz or .zst) are JSON lines
with the document in that field; everything else that is text is split into documents by
`text_mode`: `file` (the whole file is one document), `line` (each non-blank line), or
`paragraph` (runs of non-blank lines separated by blank lines). Blank lines separate documents in
text files and are ignored in jsonl; they are never counted as malformed. Binary files of any
other kind are an error naming the file, and so is a jsonl, parquet or datasets input that yields
no document (e.g. every record lacks the text field): its skips by reason and the last one are in
the message; a text file without a document is a warning naming it. An input with documents that
are not UTF-8 is one warning naming its first bad byte (line, byte of the line) and the iconv
command that converts it; they are skipped like other malformed input (--strict: an error).

Malformed input is skipped and counted by reason with its `file:line` (`file:row` for rows): `invalid_json`,
`missing_field` (absent, or not a string), `invalid_utf8`, `empty_document` (empty or only
whitespace). With `strict`, the first one raises a ValueError that starts with `file:line`.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import shlex
import sys
import sysconfig
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Iterator, Sequence

from megatron_taper.data import readers

SKIP_REASONS = ("invalid_json", "missing_field", "invalid_utf8", "empty_document")
TEXT_MODES = ("file", "line", "paragraph")
EMBEDDED_MAX_BYTES = 4_000_000
_EMBEDDED_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests"})


@dataclass(frozen=True)
class Document:
    text: str
    source: str  # "file:line" of the document's first line


@dataclass
class SkipLog:
    """Counts skipped input by reason; keeps the first `max_examples` locations."""

    strict: bool = False
    max_examples: int = 20
    counts: dict[str, int] = field(default_factory=lambda: {r: 0 for r in SKIP_REASONS})
    examples: list[str] = field(default_factory=list)
    last: str = ""  # the newest skip's message
    first_in_input: dict[str, str] = field(default_factory=dict)  # reason -> its first `where: detail` in this input

    def skip(self, reason: str, where: str, detail: str) -> None:
        assert reason in SKIP_REASONS, reason
        message = f"{where}: {reason}: {detail}"
        if self.strict:
            raise ValueError(message + " (remove --strict to skip and count such lines)")
        self.counts[reason] += 1
        self.last = message
        self.first_in_input.setdefault(reason, f"{where}: {detail}")
        if len(self.examples) < self.max_examples:
            self.examples.append(message)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_dict(self) -> dict:
        return {"total": self.total, "by_reason": dict(self.counts), "examples": list(self.examples)}


def expand_inputs(paths: Sequence[str]) -> list[str]:
    """Files named by paths, folders (recursive, hidden entries skipped; a saved `datasets` folder is
    one input) and globs, sorted; `hf:NAME` as given; unique."""
    files: list[str] = []
    for path in paths:
        if path.startswith(readers.HF_PREFIX) or (os.path.isdir(path) and readers.is_datasets_folder(path)):
            files.append(path)
        elif any(ch in path for ch in "*?["):
            matches = sorted(m for m in glob.glob(path, recursive=True) if not os.path.isdir(m))
            if not matches:
                raise ValueError(f"--input {path}: the pattern matches no file")
            files += matches
        elif os.path.isdir(path):
            found = []
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                saved = [d for d in dirs if readers.is_datasets_folder(os.path.join(root, d))]
                dirs[:] = [d for d in dirs if d not in saved]
                found += [os.path.join(root, n) for n in names + saved if not n.startswith(".")]
            if not found:
                raise ValueError(f"--input {path}: the folder holds no file")
            files += sorted(found)
        elif os.path.exists(path):
            files.append(path)
        else:
            raise ValueError(f"--input {path}: no such file or folder")
    seen: set[str] = set()
    return [f for f in files if not (f in seen or seen.add(f))]


def text_keys(json_key: str | Sequence[str]) -> tuple[str, ...]:
    """The fields tried in order for a record's text: "body,text" or ["body", "text"]."""
    names = [json_key] if isinstance(json_key, str) else list(json_key)
    keys = tuple(k.strip() for name in names for k in name.split(","))
    if not keys or not all(keys):
        raise ValueError(f"--text-key {','.join(names)!r}: field names must not be empty")
    return keys


def read_documents(paths: Sequence[str], skips: SkipLog, *, json_key: str | Sequence[str] = "text",
                   text_mode: str = "file", hf_split: str = "train",
                   hf_config: str | None = None) -> Iterator[Document]:
    """Documents of all inputs in order (see the module docstring for the rules); `json_key` names
    the field(s) of jsonl records and parquet/datasets rows that hold the text (--text-key)."""
    if text_mode not in TEXT_MODES:
        raise ValueError(f"--text-mode {text_mode!r} is not one of: {', '.join(TEXT_MODES)}")
    return _read_files(expand_inputs(paths), skips, text_keys(json_key), text_mode, hf_split, hf_config)


def _read_files(files: list[str], skips: SkipLog, keys: tuple[str, ...], text_mode: str, hf_split: str,
                hf_config: str | None) -> Iterator[Document]:
    for path in files:
        before = dict(skips.counts)
        skips.first_in_input = {}
        found = 0
        for doc in _read_file(path, skips, keys, text_mode, hf_split, hf_config):
            found += 1
            yield doc
        not_utf8 = skips.counts["invalid_utf8"] - before["invalid_utf8"]
        if found and not not_utf8:
            continue
        hint = ""
        if not_utf8:
            hint = (f"; if the input is Latin-1, convert it to UTF-8 and pass that file: iconv -f latin1 -t utf-8 "
                    f"{shlex.quote(path)} > {shlex.quote(path + '.utf8')}")
        records = path.startswith(readers.HF_PREFIX) or os.path.isdir(path) or \
            readers.input_format(path).kind != "text"
        if not_utf8 and (found or not records):
            dropped = f"{not_utf8} document(s) skipped" if found else "the whole input skipped"
            warnings.warn(f"{skips.first_in_input['invalid_utf8']}: {dropped}{hint}", stacklevel=2)
        if not found and not (not_utf8 and not records):
            skipped = {r: n - before[r] for r, n in skips.counts.items() if n > before[r]}
            what = ", ".join(f"{n} {r}" for r, n in skipped.items()) or "nothing"
            if "missing_field" in skipped:
                hint += (f"; is the text under another field? --text-key takes a comma-separated list tried in "
                         f"order (now {','.join(keys)})")
            message = (f"{path}: no document in this input (skipped: {what}; last: {skips.last}){hint}"
                       if skipped else f"{path}: no document in this input (it is empty)")
            if records:
                raise ValueError(message)
            warnings.warn(message, stacklevel=2)  # a text file in a folder of many may be empty


def _read_file(path: str, skips: SkipLog, keys: tuple[str, ...], text_mode: str, hf_split: str,
               hf_config: str | None) -> Iterator[Document]:
    if path.startswith(readers.HF_PREFIX) or os.path.isdir(path):
        key, rows = readers.datasets_rows(path, keys, hf_split, hf_config)
        yield from _row_documents(rows, path, key, skips)
        return
    fmt = readers.input_format(path)
    if fmt.kind == "parquet":
        key, rows = readers.parquet_rows(path, keys)
        yield from _row_documents(rows, path, key, skips)
        return
    try:
        with readers.open_decompressed(path, fmt) as f:
            if fmt.kind == "jsonl":
                yield from _jsonl_documents(f, path, keys, skips)
            elif text_mode == "file":
                yield from _file_document(f.read(), path, skips)
            else:
                yield from _split_documents(f, path, text_mode, skips)
    except (gzip.BadGzipFile, EOFError, zlib.error, *readers.zstd_errors()) as e:
        raise ValueError(f"{path}: not a readable {fmt.container} file ({e})") from None


def _decode(raw: bytes, where_file: str, first_line: int, skips: SkipLog) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + raw.count(b"\n", 0, e.start)
        column = e.start - raw.rfind(b"\n", 0, e.start)  # 1-based byte of the line
        skips.skip("invalid_utf8", f"{where_file}:{line}", f"byte 0x{raw[e.start]:02x} (byte {column} of line "
                                                           f"{line}) is not UTF-8")
        return None


def _file_document(raw: bytes, path: str, skips: SkipLog) -> Iterator[Document]:
    text = _decode(raw, path, 1, skips)
    if text is None:
        return
    if not text.strip():
        skips.skip("empty_document", f"{path}:1", "the file is empty or only whitespace")
        return
    yield Document(text, f"{path}:1")


def _split_documents(f: BinaryIO, path: str, text_mode: str, skips: SkipLog) -> Iterator[Document]:
    block: list[bytes] = []
    start = 0
    for lineno, raw in enumerate(f, 1):
        body = raw.rstrip(b"\r\n")
        blank = not body.strip()
        if text_mode == "line":
            if not blank:
                yield from _block_document([body], path, lineno, skips)
        elif blank:
            if block:
                yield from _block_document(block, path, start, skips)
            block = []
        else:
            if not block:
                start = lineno
            block.append(body)
    if block:
        yield from _block_document(block, path, start, skips)


def _block_document(lines: list[bytes], path: str, start: int, skips: SkipLog) -> Iterator[Document]:
    text = _decode(b"\n".join(lines), path, start, skips)
    if text is not None:
        yield Document(text, f"{path}:{start}")


def _jsonl_documents(f: BinaryIO, path: str, keys: tuple[str, ...], skips: SkipLog) -> Iterator[Document]:
    for lineno, raw in enumerate(f, 1):
        if not raw.strip():
            continue
        where = f"{path}:{lineno}"
        line = _decode(raw, path, lineno, skips)
        if line is None:
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            skips.skip("invalid_json", where, str(e))
            continue
        key = next((k for k in keys if k in record), None) if isinstance(record, dict) else None
        if key is None:
            skips.skip("missing_field", where, f"no field {' or '.join(map(repr, keys))}")
            continue
        yield from _field_document(record[key], key, where, skips)


def _row_documents(rows: Iterator[tuple[int, Any]], path: str, key: str, skips: SkipLog) -> Iterator[Document]:
    for row, value in rows:
        where = f"{path}:row {row}"
        if value is None:
            skips.skip("missing_field", where, f"field {key!r} is null")
            continue
        yield from _field_document(value, key, where, skips)


def _field_document(text: Any, key: str, where: str, skips: SkipLog) -> Iterator[Document]:
    """The document in a record's field, or a skip by reason."""
    if not isinstance(text, str):
        skips.skip("missing_field", where, f"field {key!r} is {type(text).__name__}, not a string")
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        skips.skip("invalid_utf8", where, f"field {key!r} holds a lone surrogate escape")
        return
    if not text.strip():
        skips.skip("empty_document", where, f"field {key!r} is empty or only whitespace")
        return
    yield Document(text, where)


# ---------------------------------------------------------------------------------------------
# Embedded corpus: the Python standard library's own source files


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def embedded_files(max_bytes: int = EMBEDDED_MAX_BYTES) -> list[str]:
    """The stdlib's .py files (no tests, no site-packages) in sorted relative-path order, each
    taken if it still fits in `max_bytes`; the same list on every machine with the same Python."""
    root = stdlib_root()
    rel_paths = []
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _EMBEDDED_EXCLUDED_DIRS and not d.startswith(".")]
        rel_dir = os.path.relpath(dirpath, root)
        rel_paths += [os.path.normpath(os.path.join(rel_dir, n)).replace(os.sep, "/")
                      for n in names if n.endswith(".py")]
    chosen, total = [], 0
    for rel in sorted(rel_paths):
        size = os.path.getsize(os.path.join(root, rel))
        if size == 0 or total + size > max_bytes:
            continue  # too big for what is left of the cap; smaller later files may still fit
        chosen.append(rel)
        total += size
    if not chosen:
        raise ValueError(f"no Python source files found under the standard library folder {root}")
    return [os.path.join(root, rel) for rel in chosen]


def embedded_documents(max_bytes: int = EMBEDDED_MAX_BYTES,
                       skips: SkipLog | None = None) -> Iterator[Document]:
    """One document per stdlib source file (files that are not UTF-8 or empty are skipped)."""
    skips = skips if skips is not None else SkipLog()
    for path in embedded_files(max_bytes):
        with open(path, "rb") as f:
            yield from _file_document(f.read(), path, skips)


def progress_bar(desc: str, enabled: bool):
    """A tqdm bar counting documents on stderr (updated at most once a second), or None."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(unit="doc", desc=desc, file=sys.stderr, mininterval=1.0, dynamic_ncols=True)


# ---------------------------------------------------------------------------------------------
# Command-line inputs


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """The input options shared by tools/train_tokenizer.py and tools/preprocess_data.py."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", metavar="PATH",
                     help="files, folders (recursive), globs, hf:NAME: text, jsonl (*.jsonl/*.ndjson/*.json), "
                          "parquet, .gz/.zst of text or jsonl, saved Hugging Face datasets folders (by content "
                          "and name)")
    src.add_argument("--embedded-corpus", action="store_true",
                     help="use the embedded corpus: the Python standard library's .py files (sorted, capped)")
    parser.add_argument("--embedded-max-mb", type=float, default=EMBEDDED_MAX_BYTES / 1e6,
                        help="size cap of the embedded corpus in MB (default %(default)s)")
    parser.add_argument("--text-key", "--json-key", dest="json_key", default="text",
                        help="field holding the document in jsonl, parquet and datasets rows (default: text); "
                             "a comma-separated list is tried in order per record (e.g. body,text)")
    parser.add_argument("--hf-split", default="train", help="split of a datasets input (default: train)")
    parser.add_argument("--hf-config", default=None, help="configuration of an hf:NAME input")
    parser.add_argument("--text-mode", choices=TEXT_MODES, default="file",
                        help="documents of a text file: the whole file, each line, or blank-line paragraphs")
    parser.add_argument("--strict", action="store_true", help="fail on the first malformed line (file:line)")


def documents_from_arguments(args: argparse.Namespace, skips: SkipLog) -> Iterator[Document]:
    if args.embedded_corpus:
        return embedded_documents(int(args.embedded_max_mb * 1e6), skips)
    return read_documents(args.input, skips, json_key=args.json_key, text_mode=args.text_mode,
                          hf_split=args.hf_split, hf_config=args.hf_config)
