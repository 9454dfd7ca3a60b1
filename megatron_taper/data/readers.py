"""What an input is, and the readers of formats that are not lines of text: parquet, zstd, gzip,
Hugging Face `datasets`.

`input_format(path)` decides from the file's first bytes (magic numbers: `PAR1` parquet, 28 B5 2F FD
zstd, 1F 8B gzip) and, for what is inside a compressed file or for a plain one, from the name
(`.jsonl`/`.ndjson`/`.json` are JSON lines, anything else text). A name that promises a format the
bytes do not have (`x.parquet` that is not parquet, `x.jsonl` that is parquet, `x.zst` that is not
zstd) and a file whose
first bytes hold a NUL or another known binary signature (zip, bzip2, xz, 7z, Arrow, ...) are one
error naming the file: binary input is never read as text.

Hugging Face inputs: a local folder written by `datasets`' `save_to_disk` (it holds
dataset_info.json + state.json, or dataset_dict.json) is read with `load_from_disk`; `hf:NAME`
is `load_dataset(NAME, config, split=split, streaming=True)` (a hub name, or a local folder of
data files that `datasets` knows how to load). Both need the optional `datasets` library.
Rows (parquet, datasets) are yielded as (row number from 1, value of the text field).
"""
from __future__ import annotations

import gzip
import io
import os
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterator

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
GZIP_SUFFIXES = (".gz",)
ZSTD_SUFFIXES = (".zst", ".zstd")
HF_PREFIX = "hf:"
_MAGIC = ((b"PAR1", "parquet"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"\x1f\x8b", "gzip"))
_OTHER_BINARY = ((b"PK\x03\x04", "a zip archive"), (b"BZh", "bzip2-compressed"), (b"\xfd7zXZ\x00", "xz-compressed"),
                 (b"7z\xbc\xaf\x27\x1c", "a 7z archive"), (b"ARROW1", "an Arrow file"),
                 (b"\xff\xff\xff\xff", "an Arrow stream (a datasets folder? pass the folder)"),
                 (b"\x93NUMPY", "a numpy array"), (b"\x89HDF", "an HDF5 file"))
_HEAD = 8192
_ROWS_PER_BATCH = 1024


@dataclass(frozen=True)
class InputFormat:
    container: str  # "" (plain), "gzip" or "zstd"
    kind: str  # "jsonl", "text" or "parquet"


def is_datasets_folder(path: str) -> bool:
    """A folder written by `datasets`' save_to_disk (a Dataset or a DatasetDict)."""
    return os.path.isfile(os.path.join(path, "dataset_dict.json")) or (
        os.path.isfile(os.path.join(path, "state.json")) and os.path.isfile(os.path.join(path, "dataset_info.json")))


def _strip(name: str, suffixes: tuple[str, ...]) -> tuple[str, bool]:
    for suffix in suffixes:
        if name.lower().endswith(suffix):
            return name[: -len(suffix)], True
    return name, False


def input_format(path: str) -> InputFormat:
    """The format of a file by its first bytes and its name (module docstring); ValueError for
    binary content that no reader here understands. A named pipe (e.g. bash's `<(zcat x.gz)`) is
    not sniffed: its bytes can be read only once, so its name alone decides."""
    name, gz = _strip(path, GZIP_SUFFIXES)
    if not os.path.isfile(path) and os.path.exists(path):  # a FIFO or a character device
        if _strip(name, PARQUET_SUFFIXES)[1]:
            raise ValueError(f"{path}: parquet is read from a regular file only (not a pipe)")
        zst = not gz and _strip(name, ZSTD_SUFFIXES)[1]
        bare = _strip(name, ZSTD_SUFFIXES)[0] if zst else name
        return InputFormat("gzip" if gz else "zstd" if zst else "", "jsonl" if bare.lower().endswith(JSONL_SUFFIXES)
                           else "text")
    with open(path, "rb") as f:
        head = f.read(_HEAD)
    magic = next((kind for sig, kind in _MAGIC if head.startswith(sig)), "")
    if not gz:
        name, zst = _strip(path, ZSTD_SUFFIXES)
        promised = "zstd" if zst else ""
    else:
        promised = "gzip"
    if _strip(name, PARQUET_SUFFIXES)[1] and not promised:
        promised = "parquet"
    if promised and magic != promised:
        raise ValueError(f"{path}: the name says {promised} but the content is not ({_describe(head)})")
    kind = "jsonl" if name.lower().endswith(JSONL_SUFFIXES) else "text"
    if magic == "parquet":
        if kind == "jsonl":  # the same rule as a .parquet name on other bytes
            raise ValueError(f"{path}: the name says JSON lines but the content is parquet (it starts with PAR1); "
                             f"rename it to .parquet")
        return InputFormat("", "parquet")
    if magic:
        return InputFormat(magic, kind)
    check_text_head(head, path)
    return InputFormat("", kind)


def check_text_head(head: bytes, where: str) -> None:
    """ValueError when the first bytes of an input (after decompression) are not text."""
    for sig, what in _OTHER_BINARY:
        if head.startswith(sig):
            raise ValueError(f"{where}: unsupported binary input ({what}); inputs are text, jsonl, parquet, "
                             f".gz/.zst of text or jsonl, or a Hugging Face datasets folder")
    if b"\x00" in head:
        raise ValueError(f"{where}: unsupported binary input (NUL bytes in the first {len(head)} bytes, "
                         f"{_describe(head)}); inputs are text, jsonl, parquet, .gz/.zst of text or jsonl, or a "
                         f"Hugging Face datasets folder")


def _describe(head: bytes) -> str:
    return f"it starts with {head[:8].hex(' ')}" if head else "it is empty"


def open_decompressed(path: str, fmt: InputFormat) -> BinaryIO:
    """A binary stream of the file's content, decompressed; for a compressed file, the start of the
    content is checked to be text (a .tar.gz is refused like any binary file)."""
    if fmt.container == "gzip":
        stream: BinaryIO = gzip.open(path, "rb")
    elif fmt.container == "zstd":
        zstandard = _require("zstandard", "zstd-compressed input", "data")
        raw = open(path, "rb")
        stream = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    else:
        return open(path, "rb")
    try:
        check_text_head(stream.peek(_HEAD)[:_HEAD], f"{path} (decompressed)")
    except BaseException:
        stream.close()
        raise
    return stream


def zstd_errors() -> tuple[type[Exception], ...]:
    """The exception types of a damaged zstd stream (none when zstandard is not installed)."""
    try:
        import zstandard
    except ImportError:
        return ()
    return (zstandard.ZstdError,)


def parquet_rows(path: str, keys: tuple[str, ...]) -> tuple[str, Iterator[tuple[int, Any]]]:
    """(the first of `keys` that is a column, (row number from 1, value of that column) of every row,
    a batch at a time)."""
    pq = _require("pyarrow.parquet", "parquet input", "data")
    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...
        raise ValueError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
    names = table.schema_arrow.names
    key = _pick_key(keys, names, path, "column")

    def rows() -> Iterator[tuple[int, Any]]:
        row = 0
        for batch in table.iter_batches(batch_size=_ROWS_PER_BATCH, columns=[key]):
            for value in batch.column(0).to_pylist():
                row += 1
                yield row, value

    return key, rows()


def _pick_key(keys: tuple[str, ...], names: list[str], where: str, what: str) -> str:
    key = next((k for k in keys if k in names), None)
    if key is None:
        raise ValueError(f"{where}: no {what} {' or '.join(map(repr, keys))} ({what}s: {', '.join(names)}); "
                         f"choose one with --text-key (a comma-separated list is tried in order)")
    return key


def datasets_rows(source: str, keys: tuple[str, ...], split: str,
                  config: str | None) -> tuple[str, Iterator[tuple[int, Any]]]:
    """(the field used: the first of `keys` present, (row number from 1, value of that field) of
    every row) of a saved datasets folder or of `hf:NAME`."""
    datasets = _require("datasets", "Hugging Face datasets input", "hf")
    if source.startswith(HF_PREFIX):
        name = source[len(HF_PREFIX):]
        try:
            rows = datasets.load_dataset(name, config, split=split, streaming=True)
        except Exception as e:  # noqa: BLE001 - hub, network and builder errors have many types
            raise ValueError(f"--input {source}: datasets.load_dataset({name!r}, {config!r}, split={split!r}) "
                             f"failed: {type(e).__name__}: {e}") from None
        columns = rows.column_names
    else:
        rows = datasets.load_from_disk(source)
        if isinstance(rows, datasets.DatasetDict):
            if split not in rows:
                raise ValueError(f"--input {source}: no split {split!r} (splits: {', '.join(rows)}); choose one "
                                 f"with --hf-split")
            rows = rows[split]
        columns = rows.column_names
    if columns is not None:
        key = _pick_key(keys, list(columns), f"--input {source}", "field")
        values = (value for batch in rows.iter(batch_size=_ROWS_PER_BATCH) for value in batch[key])
    else:  # a streamed dataset whose fields are known only row by row: the first key present per row
        key = keys[0]
        values = (next((record[k] for k in keys if k in record), None) for record in rows)
    return key, enumerate(values, 1)


def _require(module: str, what: str, extra: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        top = module.split(".")[0]
        raise ValueError(f"{what} needs the {top} library, which is not installed: pip install "
                         f"'megatron_taper[{extra}]' (or pip install {top})") from None
