"""The global order of packed samples over a table of document lengths, with memory O(documents /
BLOCK_DOCS) per process and random access to any sample: global sample g -> the
(document, start, stop) token ranges it is made of. numpy only; no files are written.

Packing. The documents are cut, in storage order, into blocks of `block_docs` consecutive
documents (BLOCK_DOCS by default; the last block may be shorter). For epoch e, a permutation of the
blocks drawn from (seed, e) orders the blocks, and a generator seeded by (seed, e, block) permutes
the documents inside each block; the epoch's documents are concatenated in that order. Packed
sample p of the epoch is tokens [p*seq_len, p*seq_len + seq_len + 1) of the concatenation
(consecutive packed samples share one boundary token, so every token after the first is a
prediction target exactly once per epoch; the last < seq_len tokens are dropped). An epoch has
S = (total_tokens - 1) // seq_len samples, the same every epoch.

Sample order. Slot k of epoch e holds packed sample P_e(k), where P_e is a keyed pseudo-random
bijection of [0, S) evaluated on the fly: a 6-round Feistel network keyed by (seed, e) on the
smallest domain of 4**h >= S values, repeated while the value is >= S ("cycle walking", which
keeps it a bijection of [0, S); under 4 steps on average). Global sample g is slot g mod S of epoch
g // S: one endless, deterministic stream. With shuffle=False (evaluation) blocks, documents and
slots all keep their natural order.

What the shuffle guarantees. Any window of W consecutive slots holds W distinct packed samples
whose positions behave like W draws without replacement from the whole epoch, so their blocks are
spread over the whole dataset: a window of a few thousand samples mixes documents from all parts
of it (tests/data/test_data_order.py checks the spread per decile of the dataset). What it does
not do: the documents inside one sample are neighbours in the packing, i.e. from one block of
`block_docs` storage-adjacent documents (two blocks where a sample straddles a block boundary).
Block borders and the documents' neighbours change every epoch.

Cost. Building the order reads the length table once, CHUNK_DOCS lengths at a time (~40 MB
transient; the table is never loaded or mapped whole), and keeps int64 arrays of
ceil(documents / block_docs) entries: the block tokens, and for each of the (at most two) live
epochs the block order and its running token ends, 40 bytes per block in all, ~39 MB at 10^9
documents with BLOCK_DOCS = 1024. The first sample that touches a block reads that block's
`block_docs` lengths (one pread) and permutes them, O(block_docs); the last CACHED_BLOCKS blocks
stay cached. A sample costs a Feistel evaluation, two binary searches and one or two such block
set-ups. BLOCK_DOCS = 1024 balances the set-up (which grows with block_docs) against the memory
(which grows with documents / block_docs).

Why this and not Megatron-style index files (a document index, a sample index and a sample
shuffle written once per dataset/seed/epoch and memory-mapped by every rank): those need a
writable folder beside the data or a cache shared by the ranks, a lock and a build step whose
memory and time grow with documents and samples (at 10^9 documents the document index alone is
4-8 GB per epoch), and an endless stream would stall for a build at every epoch boundary. The
block scheme needs nothing on disk, starts in one sequential pass over the lengths, and changes
epoch in O(documents / block_docs).
"""
from __future__ import annotations

import os
import weakref
from collections import OrderedDict

import numpy as np

BLOCK_DOCS = 1024
CHUNK_DOCS = 1 << 21  # lengths read per step of the pass over the table (rounded down to whole blocks)
CACHED_BLOCKS = 16
FEISTEL_ROUNDS = 6
_M64 = (1 << 64) - 1
# Tags that keep the generators of one (seed, epoch) apart.
_TAG_BLOCKS, _TAG_DOCS, _TAG_SAMPLES = 1, 2, 3


class LengthTable:
    """Tokens per document: a 1-D integer .npy file read in slices with pread on a descriptor kept
    open (never loaded or mapped whole, so reading it adds no resident pages), or an in-memory array."""

    def __init__(self, lengths: np.ndarray | None = None, path: str | None = None) -> None:
        assert (lengths is None) != (path is None)
        self.path = path
        self._array = None if lengths is None else np.asarray(lengths)
        if path is None:
            if self._array.ndim != 1 or not np.issubdtype(self._array.dtype, np.integer):
                raise ValueError(f"document lengths must be a 1-D integer array, got {self._array.dtype} "
                                 f"{self._array.shape}")
            self._len = len(self._array)
            return
        with open(path, "rb") as f:
            try:
                version = np.lib.format.read_magic(f)
                if version == (1, 0):
                    shape, _, dtype = np.lib.format.read_array_header_1_0(f)
                elif version == (2, 0):
                    shape, _, dtype = np.lib.format.read_array_header_2_0(f)
                else:
                    raise ValueError(f".npy format version {version} is not supported")
            except ValueError as e:
                raise ValueError(f"{path}: not a readable .npy array of document lengths ({e})") from None
            self._offset = f.tell()
            size = os.fstat(f.fileno()).st_size
        if len(shape) != 1 or not np.issubdtype(dtype, np.integer):
            raise ValueError(f"{path}: document lengths must be a 1-D integer array, got {dtype} {shape}")
        self._dtype, self._len = dtype, int(shape[0])
        if size < self._offset + self._len * dtype.itemsize:
            raise ValueError(f"{path}: truncated ({size} bytes for {self._len} lengths); rewrite the dataset")
        self._fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self._fd)

    @classmethod
    def from_npy(cls, path: str) -> LengthTable:
        return cls(path=path)

    def __len__(self) -> int:
        return self._len

    def read(self, start: int, stop: int) -> np.ndarray:
        """Lengths of documents [start, stop) as int64."""
        start, stop = max(0, start), min(stop, self._len)
        if stop <= start:
            return np.zeros(0, np.int64)
        if self._array is not None:
            return self._array[start:stop].astype(np.int64)
        raw = os.pread(self._fd, (stop - start) * self._dtype.itemsize, self._offset + start * self._dtype.itemsize)
        if len(raw) != (stop - start) * self._dtype.itemsize:
            raise ValueError(f"{self.path}: truncated while reading lengths {start}..{stop}; rewrite the dataset")
        return np.frombuffer(raw, self._dtype).astype(np.int64)

    def block_tokens(self, block_docs: int) -> np.ndarray:
        """Tokens of each block of `block_docs` consecutive documents (int64), in one chunked pass."""
        assert block_docs >= 1
        chunk = max(block_docs, CHUNK_DOCS // block_docs * block_docs)
        out = np.zeros(-(-self._len // block_docs), np.int64)
        for start in range(0, self._len, chunk):
            lengths = self.read(start, start + chunk)
            if len(lengths) and lengths.min() < 0:
                raise ValueError(f"{self.path or 'document lengths'}: negative document length near document {start}")
            starts = np.arange(0, len(lengths), block_docs)
            out[start // block_docs:start // block_docs + len(starts)] = np.add.reduceat(lengths, starts)
        return out


def _mix(z):
    """splitmix64's finalizer on Python ints or uint64 arrays (a bijection of 64-bit words)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


class FeistelPermutation:
    """A keyed pseudo-random bijection of [0, n): a balanced Feistel network on 2*h bits (the
    smallest with 4**h >= n), applied again while the value is >= n (cycle walking)."""

    def __init__(self, n: int, seed: list[int], rounds: int = FEISTEL_ROUNDS) -> None:
        assert n >= 1
        self.n = n
        self._half = max(1, ((n - 1).bit_length() + 1) // 2)
        self._mask = (1 << self._half) - 1
        self._keys = [int(k) for k in np.random.SeedSequence(seed).generate_state(rounds, np.uint64)]

    def _rounds(self, x):
        half, mask = self._half, self._mask
        left, right = x >> half, x & mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & mask)
        return (left << half) | right

    def __call__(self, k: int) -> int:
        assert 0 <= k < self.n
        k = self._rounds(k)
        while k >= self.n:
            k = self._rounds(k)
        return k

    def array(self, k: np.ndarray) -> np.ndarray:
        """The permutation of every element of an integer array (int64 result)."""
        x = np.atleast_1d(np.asarray(k)).astype(np.uint64)
        assert not len(x) or int(x.max()) < self.n
        x = self._rounds(x)
        out_of_range = np.flatnonzero(x >= self.n)
        while len(out_of_range):
            x[out_of_range] = self._rounds(x[out_of_range])
            out_of_range = out_of_range[x[out_of_range] >= self.n]
        return x.astype(np.int64)


class EpochOrder:
    """The packing and sample order of one epoch (see the module docstring)."""

    def __init__(self, lengths: LengthTable, block_tokens: np.ndarray, block_docs: int, seq_len: int, seed: int,
                 epoch: int, shuffle: bool) -> None:
        self.lengths, self.block_docs, self.seq_len = lengths, block_docs, seq_len
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        self.block_tokens = block_tokens
        blocks = len(block_tokens)
        if shuffle:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, _TAG_BLOCKS])))
            self.block_order = rng.permutation(blocks)
        else:
            self.block_order = np.arange(blocks)
        self.block_ends = np.cumsum(block_tokens[self.block_order])
        total = int(self.block_ends[-1]) if blocks else 0
        self.num_samples = max(0, (total - 1) // seq_len)
        self._permutation = (FeistelPermutation(self.num_samples, [seed, epoch, _TAG_SAMPLES])
                             if shuffle and self.num_samples else None)
        self._document_keys = [int(k) for k in np.random.SeedSequence([seed, epoch, _TAG_DOCS]).generate_state(
            3, np.uint64)]
        self._bits = np.random.PCG64(0)
        self._rng = np.random.Generator(self._bits)
        self._blocks: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def position(self, slot: int) -> int:
        """The packed sample at slot `slot` of the epoch."""
        return self._permutation(slot) if self._permutation is not None else slot

    def positions(self, slots: np.ndarray) -> np.ndarray:
        """`position` of every slot of an integer array (int64)."""
        slots = np.atleast_1d(np.asarray(slots, np.int64))
        return self._permutation.array(slots) if self._permutation is not None else slots.copy()

    def block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(documents of `block` in this epoch's order, their running token ends within the block)."""
        if block in self._blocks:
            self._blocks.move_to_end(block)
            return self._blocks[block]
        first = block * self.block_docs
        lengths = self.lengths.read(first, first + self.block_docs)
        order = self._document_permutation(block, len(lengths))
        entry = (first + order, np.cumsum(lengths[order]))
        self._blocks[block] = entry
        if len(self._blocks) > CACHED_BLOCKS:
            self._blocks.popitem(last=False)
        return entry

    def pieces(self, packed: int) -> list[tuple[int, int, int]]:
        """(document, start, stop) token ranges that, concatenated, are packed sample `packed`."""
        assert 0 <= packed < self.num_samples
        return self.token_pieces(packed * self.seq_len, packed * self.seq_len + self.seq_len + 1)

    def token_pieces(self, pos: int, end: int) -> list[tuple[int, int, int]]:
        """(document, start, stop) token ranges that, concatenated, are tokens [pos, end) of the
        epoch's concatenation of documents."""
        slot = int(np.searchsorted(self.block_ends, pos, side="right"))
        out = []
        while pos < end:
            docs, ends = self.block(int(self.block_order[slot]))
            base = int(self.block_ends[slot]) - int(ends[-1])
            i = int(np.searchsorted(ends, pos - base, side="right"))
            while i < len(ends) and pos < end:
                doc_start = base + (int(ends[i - 1]) if i else 0)
                stop = min(base + int(ends[i]), end)
                if stop > pos:
                    out.append((int(docs[i]), pos - doc_start, stop - doc_start))
                    pos = stop
                i += 1
            slot += 1
        return out

    def document_order(self) -> np.ndarray:
        """Every document in this epoch's packing order: O(documents) memory, for tests and tools."""
        parts = []
        for block in self.block_order:
            first = int(block) * self.block_docs
            count = min(self.block_docs, len(self.lengths) - first)
            parts.append(first + self._document_permutation(int(block), count))
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def _document_permutation(self, block: int, count: int) -> np.ndarray:
        """The order of the `count` documents of `block` in this epoch: a PCG64 stream whose state
        is a hash of (seed, epoch, block) permutes them (setting the state of one kept generator
        costs ~1/10 of building a seeded one, which would dominate the cost of a small block)."""
        if not self.shuffle:
            return np.arange(count)
        k0, k1, k2 = self._document_keys
        self._bits.state = {"bit_generator": "PCG64", "has_uint32": 0, "uinteger": 0,
                            "state": {"state": (_mix(k0 ^ block) << 64) | _mix(k1 ^ block),
                                      "inc": ((k2 << 64) | k0) | 1}}
        return self._rng.permutation(count)


class SampleOrder:
    """The endless global sample stream over documents of the given lengths: `pieces(g)` says
    which document token ranges make global sample g (module docstring)."""

    def __init__(self, lengths: LengthTable, seq_len: int, seed: int, shuffle: bool = True,
                 block_docs: int = BLOCK_DOCS) -> None:
        if block_docs < 1:
            raise ValueError(f"block_docs={block_docs} must be >= 1")
        self.lengths, self.seq_len, self.seed, self.shuffle, self.block_docs = (
            lengths, seq_len, seed, shuffle, block_docs)
        self.block_tokens = lengths.block_tokens(block_docs)
        self.num_documents = len(lengths)
        self.num_tokens = int(self.block_tokens.sum())
        self.samples_per_epoch = max(0, (self.num_tokens - 1) // seq_len)
        self._epochs: OrderedDict[int, EpochOrder] = OrderedDict()

    def epoch(self, epoch: int) -> EpochOrder:
        """The order of one epoch (the two most recently used are kept)."""
        if epoch in self._epochs:
            self._epochs.move_to_end(epoch)
        else:
            self._epochs[epoch] = EpochOrder(self.lengths, self.block_tokens, self.block_docs, self.seq_len,
                                             self.seed, epoch, self.shuffle)
            if len(self._epochs) > 2:
                self._epochs.popitem(last=False)
        return self._epochs[epoch]

    def pieces(self, g: int) -> list[tuple[int, int, int]]:
        """(document, start, stop) token ranges that, concatenated, are global sample g."""
        assert g >= 0 and self.samples_per_epoch
        plan = self.epoch(g // self.samples_per_epoch)
        return plan.pieces(plan.position(g % self.samples_per_epoch))


class RowStreams:
    """Windows served in sequence to the rows of a global batch (data.row_streams): row r of `rows`
    reads, window after window, its own contiguous share of an epoch's concatenation of documents
    (the packing of SampleOrder: shuffled blocks, shuffled documents, each document's tokens + EOS):
    tokens [r*L, (r+1)*L) with L = (tokens - 1) // rows (the last < rows tokens are dropped). Window k
    of a row is its tokens [k*seq_len, k*seq_len + seq_len + 1) (consecutive windows share one
    boundary token, as packed samples do), k < K = (L - 1) // seq_len; step t serves every row
    window t mod K of epoch t // K. So a document's windows reach one row in order, at consecutive
    steps (a document cut by the border between two rows' shares continues in the next row,
    unconnected). A window `continues` when its first token is not its document's first token and
    it is not the first window of an epoch: a state carried from the row's previous window then
    belongs to the same document. A document that starts inside a window follows the end of the
    previous one in that window (packing), and a state carried into the next window has read both.
    A pure function of (seed, step, row)."""

    def __init__(self, order: SampleOrder, rows: int) -> None:
        if rows < 1:
            raise ValueError(f"rows={rows} must be >= 1")
        self.order, self.rows, self.seq_len = order, rows, order.seq_len
        self.row_tokens = (order.num_tokens - 1) // rows
        self.windows_per_epoch = max(0, (self.row_tokens - 1) // self.seq_len)

    def window(self, step: int, row: int) -> tuple[list[tuple[int, int, int]], bool]:
        """(the (document, start, stop) ranges of row `row`'s window at step `step`, whether it continues)."""
        assert self.windows_per_epoch and 0 <= row < self.rows and step >= 0
        epoch, k = divmod(step, self.windows_per_epoch)
        pos = row * self.row_tokens + k * self.seq_len
        pieces = self.order.epoch(epoch).token_pieces(pos, pos + self.seq_len + 1)
        return pieces, k > 0 and pieces[0][1] > 0
