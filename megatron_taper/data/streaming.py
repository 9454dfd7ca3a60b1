"""Packed token samples from MDS shards, with a global sample order and an exact, dp-size-free state.

On-disk format (written by megatron_taper.data.preprocess): `DIR/<split>/` is an MDS dataset
(mosaicml-streaming) with one sample per document and one column `tokens` (`ndarray:uint16`, or
uint32 for vocabularies over 65536) holding the document's tokens followed by EOS, plus
`doc_lengths.npy` (tokens per document, in sample order; recomputed by a scan when absent).
`DIR/stats.json` (written last) and `DIR/tokenizer.model` sit beside the splits. Every shard's
size and (in folders written since hashes were added) its xxh64 hash are listed in index.json and
checked when the shard is first opened (once per process), so a truncated or overwritten shard is
one error naming the file instead of wrong tokens.

Sample stream: megatron_taper.data.order. Documents are packed per epoch in a block-wise shuffled
order (blocks of BLOCK_DOCS consecutive documents in a permuted order, documents permuted inside
each block) and sample k of epoch e is packed sample P_e(k), P_e a keyed pseudo-random bijection
evaluated on the fly; every token after the first is a prediction target exactly once per epoch,
the epoch has S = (total_tokens - 1) // seq_len samples, and global sample g is sample g mod S of
epoch g // S: one endless, deterministic stream. Nothing is built per epoch beyond
O(documents / BLOCK_DOCS) integers, so a rank holds ~40 MB of order for 10^9 documents and finds
any sample in O(BLOCK_DOCS); the document lengths are read from `doc_lengths.npy` in slices.

Ranks. Micro-batch call c of data-parallel rank r (of dp_size) returns global samples
[c*G + r*mb, c*G + (r+1)*mb) with G = dp_size * micro_batch. The state is the number of global
samples consumed (c*G after c calls). Ranks are disjoint, together they cover the stream in
order, and a step of A micro-batches per rank consumes exactly the global samples
[s*A*G, (s+1)*A*G) whatever the split into dp_size and micro_batch. So a checkpoint taken at a
step boundary resumes at another dp size (or micro-batch) with no sample repeated or skipped,
provided the new G divides the position (it does when it divides the global batch); otherwise
`load_state_dict` raises. Tensor-parallel ranks pass the same dp_rank and get the same samples.

Row streams (data.row_streams, `RowStreamSource`): the same calls and position, but call c of rank
r serves the global batch rows that the layout above gives it (rows a*G + r*mb .. of step c // A)
their next window of megatron_taper.data.order.RowStreams, with a per-row `continues` flag; the
order is dp-size-free, as above.

Remote. With `cache_dir`, `path` is a remote location (a shared-filesystem folder, or any URL
mosaicml-streaming can download from): index and shards are copied on first use into
`cache_dir/<name>-<hash>/<split>/`, guarded by file locks so that ranks sharing a cache copy each
file once. Without `cache_dir`, `path` is read in place (compressed shards are decompressed beside
themselves, as mosaicml-streaming does). A shard download gives up after DOWNLOAD_ATTEMPTS tries
of `download_timeout_s` each (data.download_timeout_s, default 60 s), and whatever the downloader
does (mosaicml-streaming's hf:// and plain-path downloaders apply no timeout), the reading thread
waits at most DOWNLOAD_ATTEMPTS x `download_timeout_s` for a shard (180 s by default, well under
the 600 s collective timeout), then fails this rank with the shard named, so a stuck filesystem or
object store (or a peer stuck while holding the shard's file lock) stops one rank with a reason
instead of every rank in a collective.
Shards are fetched ahead of need: each `next_batch` looks at this rank's next SAMPLES_AHEAD
samples and hands the shards they read that are not yet open to SHARDS_IN_FLIGHT background
download threads, so a shard is usually in the cache before the sample that needs it is drawn
(by the trainer's batch-prefetch thread, data/prefetch.py, itself steps ahead of the training
thread); a sample whose shard is still downloading waits for that download, not a new one.

Why not `streaming.StreamingDataset` itself: its constructor runs `dist.barrier()` collectives and
registers a per-folder shared-memory slot, so every rank of the job must build each dataset at the
same time and two live datasets cannot share a folder; eval sources are built fresh and pipeline
stages that take no tokens build none. This module uses the library's shard readers
(`reader_from_json`), download and decompression (`Stream.prepare_shard`) and writer instead.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np
import torch
from filelock import FileLock

from megatron_taper.data import is_remote
from megatron_taper.data.order import BLOCK_DOCS, LengthTable, RowStreams, SampleOrder
from megatron_taper.data.torchvision_compat import import_streaming
from megatron_taper.validation import inside_folder

TOKENS_COLUMN = "tokens"
LENGTHS_FILE = "doc_lengths.npy"
INDEX_FILE = "index.json"
TOKENIZER_FILE = "tokenizer.model"
# 1: a full permutation of documents and samples per epoch; 2: the block-wise order of data.order.
STATE_VERSION = 2
DOWNLOAD_TIMEOUT_S = 60.0  # one attempt at one shard (data.download_timeout_s's default)
DOWNLOAD_ATTEMPTS = 3
SAMPLES_AHEAD = 64  # remote data: this rank's next samples whose shards are fetched in the background
SHARDS_IN_FLIGHT = 4  # remote data: parallel shard downloads per reader
SHARD_HASH = "xxh64"  # written by preprocess, checked on open: ~10 ms per 64 MB shard


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def cache_folder(cache_dir: str, path: str) -> str:
    """Where a remote `path` is cached: one folder per remote location."""
    where = path.rstrip("/") if is_remote(path) else os.path.abspath(path)
    name = os.path.basename(where) or "data"
    return os.path.join(cache_dir, f"{name}-{hashlib.sha256(where.encode()).hexdigest()[:12]}")


def has_split(path: str, split: str) -> bool:
    """Whether a local (or shared-filesystem) dataset folder has `split`; URLs are assumed to."""
    return is_remote(path) or os.path.isfile(os.path.join(path, split, INDEX_FILE))


class ShardReader:
    """Random access to the documents of one split: `len(reader)` documents, `reader[i]` tokens."""

    def __init__(self, path: str, split: str, cache_dir: str | None = None,
                 download_timeout_s: float = DOWNLOAD_TIMEOUT_S, vocab_size: int | None = None) -> None:
        import_streaming()
        from streaming.base.format import reader_from_json
        from streaming.base.stream import Stream

        if is_remote(path) and not cache_dir:
            raise ValueError(f"data.path={path} is remote and needs a local cache folder (data.cache_dir)")
        self.where = f"{path.rstrip('/')}/{split}"
        self.download_timeout_s = download_timeout_s
        self.vocab_size = vocab_size  # every document's ids are checked against it when read (None: not)
        remote = path if cache_dir else None
        local = cache_folder(cache_dir, path) if cache_dir else path
        self._split_dir = os.path.join(local, split)
        if remote is not None:
            self._fetch_index(os.path.join(remote, split))
        index_path = os.path.join(self._split_dir, INDEX_FILE)
        if not os.path.isfile(index_path):
            raise ValueError(f"{self.where}: no {INDEX_FILE} (data.path must be a folder written by "
                             f"tools/preprocess_data.py, with a '{split}' split)")
        with open(index_path) as f:
            index = json.load(f)
        if index.get("version") != 2:
            raise ValueError(f"{index_path}: unsupported MDS index version {index.get('version')!r}")
        check_shard_names(index, index_path)
        self._shards = [reader_from_json(local, split, info) for info in index["shards"]]
        for shard in self._shards:
            shard.validate(False)
            if TOKENS_COLUMN not in getattr(shard, "column_names", ()):
                raise ValueError(f"{self.where}: shards have no '{TOKENS_COLUMN}' column")
        self._stream = Stream(remote=remote, local=local, split=split, download_retry=DOWNLOAD_ATTEMPTS - 1,
                              download_timeout=download_timeout_s, keep_zip=False)
        counts = np.array([shard.samples for shard in self._shards], np.int64)
        self._shard_ends = np.cumsum(counts)
        self._maps: dict[int, tuple[mmap.mmap, np.ndarray]] = {}
        self.remote = remote is not None
        self._fetching: dict[int, Future] = {}  # shard id -> its background download (remote only)
        self._pool = (ThreadPoolExecutor(SHARDS_IN_FLIGHT, thread_name_prefix="shard-fetch")
                      if remote is not None else None)
        self.lengths = self._doc_lengths()

    def __len__(self) -> int:
        return int(self._shard_ends[-1]) if len(self._shard_ends) else 0

    def shard_of(self, doc: int) -> int:
        return int(np.searchsorted(self._shard_ends, doc, side="right"))

    def fetch_ahead(self, doc: int) -> None:
        """Start downloading the shard of document `doc` in the background, unless it is open,
        already downloading, or the data is local."""
        shard_id = self.shard_of(doc)
        if self._pool is not None and shard_id not in self._maps and shard_id not in self._fetching:
            self._fetching[shard_id] = self._pool.submit(self._download, shard_id)

    def __getitem__(self, doc: int) -> np.ndarray:
        shard_id = self.shard_of(doc)
        idx = doc - (int(self._shard_ends[shard_id - 1]) if shard_id else 0)
        if shard_id not in self._maps:
            self._prepare(shard_id)
        data, offsets = self._maps[shard_id]
        # MDS raw shard: [num_samples: u32][offsets: u32 x (num_samples + 1)][samples]; the
        # library's reader reopens the file per sample, a kept mapping is ~2x faster per document.
        sample = data[int(offsets[idx]):int(offsets[idx + 1])]
        tokens = self._shards[shard_id].decode_sample(sample)[TOKENS_COLUMN]
        if self.vocab_size is not None and len(tokens) and int(tokens.max()) >= self.vocab_size:
            shard = self._shards[shard_id].raw_data.basename
            raise ValueError(f"{self.where}/{shard}: document {idx} holds token id {int(tokens.max())}, outside "
                             f"model.vocab_size={self.vocab_size} (shards written with another tokenizer?)")
        return tokens

    def _fetch_index(self, remote_split: str) -> None:
        from streaming.base.storage.download import CloudDownloader

        os.makedirs(self._split_dir, exist_ok=True)
        with FileLock(os.path.join(self._split_dir, ".index.lock")):
            for name, required in ((INDEX_FILE, True), (LENGTHS_FILE, False)):
                local = os.path.join(self._split_dir, name)
                if os.path.exists(local):
                    continue
                try:
                    CloudDownloader.direct_download(os.path.join(remote_split, name), local,
                                                    self.download_timeout_s)
                except FileNotFoundError:
                    if required:
                        raise ValueError(f"{remote_split}: no {name} to copy into the cache") from None

    def _prepare(self, shard_id: int) -> None:
        shard = self._shards[shard_id]
        fetching = self._fetching.pop(shard_id, None)
        if fetching is None and self._pool is not None:
            fetching = self._pool.submit(self._download, shard_id)
        raw = self._download(shard_id) if fetching is None else self._wait(fetching, shard_id)
        check_shard(raw, shard.raw_data.bytes, shard.raw_data.hashes, self.where)
        with open(raw, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        held = int(np.frombuffer(data, np.uint32, count=1)[0]) if len(data) >= 4 else 0
        if held != shard.samples or len(data) < 4 * (held + 2):
            data.close()
            raise ValueError(f"damaged MDS shard {raw}: it holds {held} samples where {self.where}/{INDEX_FILE} "
                             f"records {shard.samples} (an edited or mismatched index.json); rewrite {self.where} "
                             f"with tools/preprocess_data.py")
        offsets = np.frombuffer(data, np.uint32, count=shard.samples + 1, offset=4)
        self._maps[shard_id] = (data, offsets)

    def _wait(self, fetching: Future, shard_id: int) -> str:
        """The downloaded shard's path, waiting at most DOWNLOAD_ATTEMPTS x download_timeout_s."""
        limit = DOWNLOAD_ATTEMPTS * self.download_timeout_s
        try:
            return fetching.result(timeout=limit)
        except FutureTimeout:
            raise RuntimeError(f"{self.where}: shard {self._shards[shard_id].raw_data.basename} is not in the cache "
                               f"after {limit:.0f} s (DOWNLOAD_ATTEMPTS x data.download_timeout_s): a stuck "
                               f"filesystem or object store, or another process holding its download lock; this "
                               f"rank stops here instead of stalling every rank in a collective") from None

    def _download(self, shard_id: int) -> str:
        """The raw shard's local path, downloaded and/or decompressed into it first if needed."""
        shard = self._shards[shard_id]
        raw = os.path.join(self._split_dir, shard.raw_data.basename)
        if not os.path.isfile(raw):
            # Download and/or decompress once per machine; other ranks wait on the lock.
            with FileLock(raw + ".lock"):
                try:
                    self._stream.prepare_shard(shard)
                except Exception as e:  # noqa: BLE001 - the library's download and decompression errors
                    raise RuntimeError(f"{self.where}: shard {shard.raw_data.basename} could not be fetched into "
                                       f"the cache ({DOWNLOAD_ATTEMPTS} attempts of {self.download_timeout_s:.0f} s): "
                                       f"{e}"
                                       ) from e
        return raw

    def _doc_lengths(self) -> LengthTable:
        path = os.path.join(self._split_dir, LENGTHS_FILE)
        if os.path.isfile(path):
            lengths = LengthTable.from_npy(path)
            if len(lengths) != len(self):
                raise ValueError(f"{path} lists {len(lengths)} documents but {self.where}/{INDEX_FILE} "
                                 f"has {len(self)}: the folder is damaged, rewrite it")
            return lengths
        return LengthTable(np.array([len(self[i]) for i in range(len(self))], np.int64))


def check_shard_names(index: dict, index_path: str) -> None:
    """Every shard file an index names is a plain file name inside its split's folder: the
    downloader writes to the cache under these names, so `../` or an absolute path in a remote
    index.json would write outside data.cache_dir (and read outside a local folder)."""
    shards = index.get("shards")
    if not isinstance(shards, list):
        raise ValueError(f"{index_path}: 'shards' is not a list")
    for i, info in enumerate(shards):
        for field in ("raw_data", "zip_data"):
            entry = info.get(field) if isinstance(info, dict) else None
            if entry is None and field == "zip_data":
                continue
            name = entry.get("basename") if isinstance(entry, dict) else None
            if not inside_folder(name, plain=True):
                raise ValueError(f"{index_path}: shards[{i}].{field}.basename={name!r} is not a plain file name "
                                 f"(a shard must be a file of its split's folder)")


def check_shard(path: str, size: int, hashes: dict, where: str) -> None:
    """ValueError naming `path` when its size or hash differs from what index.json recorded."""
    from streaming.base.hashing import get_hash

    problem = ""
    actual = os.path.getsize(path)
    if actual != size:
        problem = f"{actual} bytes where index.json records {size} (truncated or overwritten)"
    else:
        for algo in sorted(hashes):
            with open(path, "rb") as f:
                digest = get_hash(algo, f.read())
            if digest != hashes[algo]:
                problem = f"its {algo} hash {digest} is not the {hashes[algo]} recorded in index.json (damaged bytes)"
                break
    if problem:
        raise ValueError(f"damaged MDS shard {path}: {problem}; rewrite {where} with tools/preprocess_data.py "
                         f"(or restore the file from a good copy)")


class StreamingSource:
    """Endless micro-batches [micro_batch, seq_len + 1] (int64, CPU) of one data-parallel rank."""

    rows: int | None = None  # RowStreamSource: the global batch rows it serves

    def __init__(self, path: str, split: str, seq_len: int, micro_batch: int, dp_rank: int, dp_size: int,
                 seed: int, cache_dir: str | None = None, shuffle: bool = True, block_docs: int = BLOCK_DOCS,
                 download_timeout_s: float = DOWNLOAD_TIMEOUT_S, vocab_size: int | None = None) -> None:
        for key, value, low in (("model.seq_len", seq_len, 1), ("train.micro_batch", micro_batch, 1),
                                ("dp_size", dp_size, 1), ("dp_rank", dp_rank, 0), ("train.seed", seed, 0),
                                ("block_docs", block_docs, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{key}={value!r} must be an integer >= {low}")
        if dp_rank >= dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be < dp_size={dp_size}")
        self.split, self.seq_len, self.micro_batch = split, seq_len, micro_batch
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.reader = ShardReader(path, split, cache_dir, download_timeout_s, vocab_size)
        self.order = SampleOrder(self.reader.lengths, seq_len, seed, shuffle, block_docs)
        self.num_documents = len(self.reader)
        self.num_tokens = self.order.num_tokens
        self.samples_per_epoch = self.order.samples_per_epoch
        if self.samples_per_epoch < 1:
            raise ValueError(f"{self.reader.where}: {self.num_tokens} tokens are too few for one sample "
                             f"of model.seq_len + 1 = {seq_len + 1} tokens")
        self.samples_consumed = 0
        self._ahead = 0  # this rank's samples (counted from the stream's start) looked ahead at

    @property
    def group_size(self) -> int:
        """Global samples consumed by one micro-batch call on every rank (dp_size * micro_batch)."""
        return self.dp_size * self.micro_batch

    @property
    def epoch(self) -> int:
        return self.samples_consumed // self.samples_per_epoch

    def next_batch(self) -> torch.Tensor:
        first = self.samples_consumed + self.dp_rank * self.micro_batch
        self._look_ahead()
        batch = np.stack([self.sample(first + i) for i in range(self.micro_batch)])
        self.samples_consumed += self.group_size
        return torch.from_numpy(batch)

    def _look_ahead(self) -> None:
        """Hand the shards of this rank's next SAMPLES_AHEAD samples to the reader's background
        downloads (remote data; each sample is looked at once)."""
        mb = self.micro_batch
        own = self.samples_consumed // self.group_size * mb  # this rank's samples drawn so far
        self._ahead = max(self._ahead, own)
        while self._ahead < own + SAMPLES_AHEAD and self.reader.remote:
            g = self._ahead // mb * self.group_size + self.dp_rank * mb + self._ahead % mb
            for doc, _, _ in self.order.pieces(g):
                self.reader.fetch_ahead(doc)
            self._ahead += 1

    def sample(self, g: int) -> np.ndarray:
        """Global sample g of the stream: int64 [seq_len + 1]."""
        return self.read(self.order.pieces(g))

    def read(self, pieces: list[tuple[int, int, int]]) -> np.ndarray:
        """The tokens of (document, start, stop) ranges that make one sample: int64 [seq_len + 1]."""
        out = np.empty(self.seq_len + 1, np.int64)
        filled = 0
        for doc, start, stop in pieces:
            out[filled:filled + stop - start] = self.reader[doc][start:stop]
            filled += stop - start
        assert filled == len(out)
        return out

    def identity(self) -> dict[str, Any]:
        """What the sample stream depends on besides the position (checked on resume)."""
        rows = {} if self.rows is None else {"rows": self.rows}
        return {"seed": self.seed, "seq_len": self.seq_len, "split": self.split, "shuffle": self.shuffle,
                "block_docs": self.order.block_docs, "documents": self.num_documents, "tokens": self.num_tokens,
                **rows}

    def check_identity(self, state: dict, where: str = "data.path") -> None:
        """Raises when `state` (a state_dict or identity) was written for another stream."""
        for key, name, now in (("seq_len", "model.seq_len", self.seq_len), ("seed", "train.seed", self.seed),
                               ("shuffle", "shuffle", self.shuffle),
                               ("block_docs", "block_docs", self.order.block_docs),
                               ("documents", where, self.num_documents),
                               ("tokens", where, self.num_tokens),
                               ("rows", "data.row_streams with train.global_batch", self.rows)):
            if state.get(key) != now:
                raise ValueError(f"cannot resume the data stream: {name} changed "
                                 f"({key} was {state.get(key)!r}, now {now!r})")

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "samples_consumed": self.samples_consumed, **self.identity()}

    def load_state_dict(self, state: dict) -> None:
        if "mix_version" in state:
            raise ValueError("cannot resume the data stream: the checkpoint was written by a data.mix run and this "
                             "run reads one data.path; resume with the same data.mix")
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"data state version {state.get('version')!r} is not {STATE_VERSION}: it counts samples of "
                f"another sample order (version 1: a full shuffle per epoch, replaced by the block-wise order "
                f"of megatron_taper.data.order), so the data stream cannot resume exactly from it; resume "
                f"this checkpoint with the version that wrote it")
        self.check_identity(state)
        self.samples_consumed = check_position(int(state["samples_consumed"]), self.group_size)


def check_position(consumed: int, group_size: int) -> int:
    """`consumed` global samples, if a micro-batch call of every rank (group_size samples) divides it."""
    if consumed % group_size:
        raise ValueError(f"cannot resume at global sample {consumed}: dp_size * train.micro_batch = "
                         f"{group_size} does not divide it (resume at a step boundary with a "
                         f"global batch that dp_size * micro_batch divides)")
    return consumed


class RowStreamSource(StreamingSource):
    """data.row_streams: each of `rows` (the global batch) rows gets consecutive windows
    (megatron_taper.data.order.RowStreams). Micro-batch call c of dp rank r serves step
    t = c // A (A = rows / G calls per step, G = dp_size * micro_batch) to global rows
    a*G + r*micro_batch .. + micro_batch with a = c mod A, the rows that StreamingSource's layout
    gives the same rank and call: (tokens [micro_batch, seq_len + 1] int64, continues
    [micro_batch] bool), CPU. The position counts global samples as StreamingSource's does."""

    def __init__(self, *args: Any, rows: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if rows < 1 or rows % self.group_size:
            raise ValueError(f"data.row_streams: train.global_batch={rows} must be a multiple of dp_size * "
                             f"train.micro_batch = {self.group_size}")
        self.rows = rows
        self.streams = RowStreams(self.order, rows)
        if not self.streams.windows_per_epoch:
            raise ValueError(f"{self.reader.where}: {self.num_tokens} tokens are too few for data.row_streams: "
                             f"each of train.global_batch={rows} rows needs model.seq_len + 2 = {self.seq_len + 2}")

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        step, offset = divmod(self.samples_consumed, self.rows)
        first = offset + self.dp_rank * self.micro_batch
        windows = [self.streams.window(step, row) for row in range(first, first + self.micro_batch)]
        self.samples_consumed += self.group_size
        return (torch.from_numpy(np.stack([self.read(pieces) for pieces, _ in windows])),
                torch.tensor([continues for _, continues in windows]))
