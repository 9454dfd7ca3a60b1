"""The sample order alone (megatron_taper.data.order) on millions of synthetic document lengths:
a bijection of samples per epoch, pieces equal to a brute-force packing, every target token once
per epoch, the same order in a fresh object and in another process, disjoint ranks, mixing."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_taper.data.order import FeistelPermutation, LengthTable, SampleOrder

SEQ = 2048
DOCS = 2_000_000


def lognormal_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Document lengths around 500 tokens (median ~300), as preprocess writes them (uint32)."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(500) - 0.5, 1.0, n), 1, 1 << 20).astype(np.uint32)


@pytest.fixture(scope="module")
def lengths_file(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("lengths") / "doc_lengths.npy")
    np.save(path, lognormal_lengths(DOCS))
    return path


@pytest.fixture(scope="module")
def order(lengths_file) -> SampleOrder:
    return SampleOrder(LengthTable.from_npy(lengths_file), SEQ, seed=11)


def reference(order: SampleOrder, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(documents in packing order, their start token, their length) of an epoch, built whole."""
    docs = order.epoch(epoch).document_order()
    lengths = order.lengths.read(0, order.num_documents)[docs]
    return docs, np.cumsum(lengths) - lengths, lengths


def packed_pieces(ref, packed: int) -> list[tuple[int, int, int]]:
    docs, starts, lengths = ref
    pos, end = packed * SEQ, packed * SEQ + SEQ + 1
    i = int(np.searchsorted(starts + lengths, pos, side="right"))
    out = []
    while pos < end:
        stop = min(int(starts[i] + lengths[i]), end)
        out.append((int(docs[i]), pos - int(starts[i]), stop - int(starts[i])))
        pos, i = stop, i + 1
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 64, 1000, 4099])
def test_feistel_is_a_bijection_and_scalar_equals_array(n):
    perm = FeistelPermutation(n, [3, 1])
    out = perm.array(np.arange(n))
    assert sorted(out.tolist()) == list(range(n))
    assert [perm(k) for k in range(n)] == out.tolist()
    if n > 64:
        assert not np.array_equal(out, np.arange(n))
        assert not np.array_equal(out, FeistelPermutation(n, [3, 2]).array(np.arange(n)))


def test_an_epoch_is_a_permutation_of_documents_and_samples(order):
    assert order.num_documents == DOCS
    total = int(order.lengths.read(0, DOCS).sum())
    assert order.num_tokens == total and order.samples_per_epoch == (total - 1) // SEQ
    for epoch in (0, 1):
        plan = order.epoch(epoch)
        assert np.array_equal(np.sort(plan.document_order()), np.arange(DOCS))
        slots = plan.positions(np.arange(order.samples_per_epoch))
        assert np.array_equal(np.sort(slots), np.arange(order.samples_per_epoch))
    # the same sample slot is another packed sample, and the packing another, in the next epoch
    assert not np.array_equal(order.epoch(0).positions(np.arange(1000)), order.epoch(1).positions(np.arange(1000)))
    assert not np.array_equal(order.epoch(0).document_order()[:1000], order.epoch(1).document_order()[:1000])


def test_pieces_at_random_positions_equal_the_brute_force_packing(order):
    """Exactly once per epoch: slots are a bijection onto packed samples (above), and packed sample
    p is tokens [p*SEQ, p*SEQ + SEQ + 1) of the concatenation, so its targets are disjoint from
    every other sample's and together they cover all targets but the dropped tail."""
    s = order.samples_per_epoch
    rng = np.random.default_rng(5)
    for epoch in (0, 3):
        ref = reference(order, epoch)
        plan = order.epoch(epoch)
        picks = rng.integers(0, s, 300).tolist() + [0, 1, s - 2, s - 1]
        for slot in picks:
            packed = plan.position(slot)
            got = order.pieces(epoch * s + slot)
            assert got == packed_pieces(ref, packed)
            assert sum(stop - start for _, start, stop in got) == SEQ + 1
        assert int(ref[2].sum()) - (s * SEQ + 1) < SEQ  # only the tail of < SEQ tokens is dropped


def test_fresh_objects_resume_anywhere_and_ranks_are_disjoint(order, lengths_file):
    s = order.samples_per_epoch
    fresh = SampleOrder(LengthTable(np.load(lengths_file)), SEQ, seed=11)  # in memory: same order
    rng = np.random.default_rng(9)
    for g in rng.integers(0, 3 * s, 50).tolist() + [s - 1, s, 2 * s + 1]:
        assert fresh.pieces(g) == order.pieces(g)
    assert SampleOrder(LengthTable(np.load(lengths_file)), SEQ, seed=12).pieces(0) != order.pieces(0)
    # dp=4, micro_batch=3: call c of rank r takes global samples c*12 + r*3 + [0, 3)
    dp, mb = 4, 3
    for call in rng.integers(0, 3 * s // (dp * mb), 5).tolist():
        slots = [call * dp * mb + r * mb + i for r in range(dp) for i in range(mb)]
        firsts = [order.pieces(g)[0] for g in slots if g // s == slots[0] // s]
        assert len(set(firsts)) == len(firsts)  # distinct packed samples of one epoch: disjoint tokens


def test_the_order_is_the_same_in_another_process(order, lengths_file):
    picks = [0, 7, order.samples_per_epoch + 3, 10 * order.samples_per_epoch // 3]
    code = ("import json, sys; from megatron_taper.data.order import LengthTable, SampleOrder; "
            f"o = SampleOrder(LengthTable.from_npy(sys.argv[1]), {SEQ}, seed=11); "
            f"print(json.dumps([o.pieces(g) for g in {picks}]))")
    out = subprocess.run([sys.executable, "-c", code, lengths_file], check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONHASHSEED": "123"})
    assert json.loads(out.stdout) == [[list(p) for p in order.pieces(g)] for g in picks]


def test_any_window_of_samples_mixes_the_whole_dataset(order):
    plan = order.epoch(2)
    window = 2048
    for start in (0, order.samples_per_epoch // 2, order.samples_per_epoch - window):
        first_docs = np.array([plan.pieces(int(p))[0][0] for p in plan.positions(np.arange(start, start + window))])
        per_decile = np.bincount(first_docs * 10 // DOCS, minlength=10) / window
        assert per_decile.min() > 0.06 and per_decile.max() < 0.14, per_decile
        blocks = len(order.block_tokens)
        expected = blocks * (1 - (1 - 1 / blocks) ** window)  # distinct blocks of uniform random draws
        assert len(np.unique(first_docs // order.block_docs)) > 0.9 * expected


def test_unshuffled_order_is_the_natural_one():
    lengths = np.array([5, 0, 3, 9, 1, 0, 0, 4, 7], np.uint32)
    order = SampleOrder(LengthTable(lengths), 4, seed=0, shuffle=False, block_docs=2)
    tokens = np.concatenate([[(d, t) for t in range(n)] for d, n in enumerate(lengths) if n])
    assert order.samples_per_epoch == (len(tokens) - 1) // 4
    for g in range(2 * order.samples_per_epoch):
        k = g % order.samples_per_epoch
        want = tokens[k * 4:k * 4 + 5]
        got = [(d, t) for d, a, b in order.pieces(g) for t in range(a, b)]
        assert got == [tuple(x) for x in want.tolist()]


@pytest.mark.parametrize("block_docs", [1, 2, 3, 8, 1024])
def test_empty_documents_and_blocks_and_odd_block_sizes(block_docs):
    lengths = np.array([0, 0, 0, 7, 0, 2, 11, 0, 0, 0, 0, 1, 30, 4, 0], np.int32)
    order = SampleOrder(LengthTable(lengths), 3, seed=4, block_docs=block_docs)
    s = order.samples_per_epoch
    assert s == (int(lengths.sum()) - 1) // 3
    for epoch in range(3):
        docs = order.epoch(epoch).document_order()
        concat = [(int(d), t) for d in docs for t in range(lengths[d])]
        targets = []
        for slot in range(s):
            got = [(d, t) for d, a, b in order.pieces(epoch * s + slot) for t in range(a, b)]
            packed = order.epoch(epoch).position(slot)
            assert got == concat[packed * 3:packed * 3 + 4]
            targets += got[1:]
        assert sorted(targets) == sorted(concat[1:s * 3 + 1])  # every target token once


def test_length_table_errors(tmp_path):
    bad = tmp_path / "bad.npy"
    np.save(bad, np.ones((2, 3), np.uint32))
    with pytest.raises(ValueError, match="1-D integer"):
        LengthTable.from_npy(str(bad))
    np.save(bad, np.ones(4, np.float32))
    with pytest.raises(ValueError, match="1-D integer"):
        LengthTable.from_npy(str(bad))
    np.save(bad, np.arange(1000, dtype=np.uint32))
    with open(bad, "r+b") as f:
        f.truncate(os.path.getsize(bad) - 8)
    with pytest.raises(ValueError, match="truncated"):
        LengthTable.from_npy(str(bad))
    bad.write_bytes(b"not numpy")
    with pytest.raises(ValueError, match="not a readable .npy"):
        LengthTable.from_npy(str(bad))
    with pytest.raises(ValueError, match="negative document length"):
        SampleOrder(LengthTable(np.array([3, -1, 4])), 2, seed=0)
    table = LengthTable(np.arange(10))
    assert table.read(3, 6).tolist() == [3, 4, 5] and table.read(8, 20).tolist() == [8, 9]
    assert LengthTable(np.arange(10)).block_tokens(4).tolist() == [6, 22, 17]
