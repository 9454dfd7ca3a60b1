"""StreamingSource: exactly once per epoch over dp ranks, exact resume (also at another dp size),
epochs, eval sources, remote + cache, state round trip through torch.save(weights_only), the same
stream in another process. Small shuffle blocks (block_docs) make the few hundred documents of the
fixture span many blocks, as a large dataset does."""
import io
import json
import os
import shutil
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch

from megatron_taper.data.streaming import LENGTHS_FILE, ShardReader, StreamingSource, cache_folder
from tests.helpers.datahelpers import corpus, dataset, tokenizer_model  # noqa: F401

SEQ = 32
BLOCKS = [None, 16]  # the default block size (one block here) and many small blocks


def src(path, dp_rank=0, dp_size=1, mb=2, seed=7, split="train", cache=None, seq=SEQ, block_docs=None):
    extra = {} if block_docs is None else {"block_docs": block_docs}
    return StreamingSource(path, split, seq, mb, dp_rank, dp_size, seed, cache, **extra)


def epoch_stream(source, epoch):
    """The epoch's concatenated token stream, rebuilt from the documents in the plan's order."""
    docs = source.order.epoch(epoch).document_order()
    assert sorted(docs.tolist()) == list(range(source.num_documents))
    return np.concatenate([source.reader[int(d)] for d in docs]).astype(np.int64)


@pytest.mark.parametrize("block_docs", BLOCKS)
@pytest.mark.parametrize("epoch", [0, 1])
def test_two_ranks_see_disjoint_samples_covering_the_epoch_once(dataset, block_docs, epoch):
    ranks = [src(dataset, r, 2, mb=3, block_docs=block_docs) for r in range(2)]
    s = ranks[0].samples_per_epoch
    stream = epoch_stream(ranks[0], epoch)
    assert s == (len(stream) - 1) // SEQ and len(stream) - (s * SEQ + 1) < SEQ
    windows = [tuple(stream[k * SEQ:k * SEQ + SEQ + 1]) for k in range(s)]
    begin = epoch * s // 6 * 6  # a multiple of the group size (6) at or before the epoch's start
    for source in ranks:
        source.samples_consumed = begin
    seen: list[list[tuple[int, tuple]]] = [[], []]  # (global sample, row) per rank
    while ranks[0].samples_consumed < (epoch + 1) * s:
        for r, source in enumerate(ranks):
            first = source.samples_consumed + r * 3
            batch = source.next_batch()
            assert batch.shape == (3, SEQ + 1) and batch.dtype == torch.int64
            seen[r] += [(first + i, tuple(row.tolist())) for i, row in enumerate(batch)
                        if epoch * s <= first + i < (epoch + 1) * s]
    ga, gb = [g for g, _ in seen[0]], [g for g, _ in seen[1]]
    assert not set(ga) & set(gb) and sorted(ga + gb) == list(range(epoch * s, (epoch + 1) * s))
    # every window of the epoch's packing exactly once (as a multiset: a few windows repeat text)
    assert Counter(row for rank in seen for _, row in rank) == Counter(windows)
    packed = [ranks[0].order.epoch(epoch).position(g - epoch * s) for g, _ in sorted(seen[0] + seen[1])]
    assert [windows[k] for k in packed] == [row for _, row in sorted(seen[0] + seen[1])]
    assert packed != sorted(packed)  # shuffled


def test_seed_and_epoch_change_the_order(dataset):
    a, b = src(dataset, seed=1), src(dataset, seed=2)
    slots = np.arange(a.samples_per_epoch)
    assert not np.array_equal(a.order.epoch(0).positions(slots), b.order.epoch(0).positions(slots))
    assert not np.array_equal(a.order.epoch(0).document_order(), a.order.epoch(1).document_order())
    s = a.samples_per_epoch
    assert a.sample(s).tolist() == src(dataset, seed=1).sample(s).tolist()
    assert not np.array_equal(epoch_stream(a, 0), epoch_stream(a, 1))


def test_tensor_parallel_ranks_of_one_dp_group_get_the_same_batches(dataset):
    x, y = src(dataset, 1, 2), src(dataset, 1, 2)
    assert all(torch.equal(x.next_batch(), y.next_batch()) for _ in range(5))


def run(source, calls):
    return [source.next_batch() for _ in range(calls)]


@pytest.mark.parametrize("block_docs", BLOCKS)
def test_mid_epoch_resume_gives_the_uninterrupted_batches(dataset, block_docs):
    s = src(dataset).samples_per_epoch
    calls = s // 4 + 3  # past the end of the first epoch (4 samples per call over 2 ranks)
    straight = [run(src(dataset, r, 2, block_docs=block_docs), calls) for r in range(2)]
    for stop in (1, 7, s // 4 - 1, s // 4 + 1):
        state = None
        for r in range(2):
            first = src(dataset, r, 2, block_docs=block_docs)
            assert all(torch.equal(p, q) for p, q in zip(run(first, stop), straight[r]))
            saved = io.BytesIO()
            torch.save(first.state_dict(), saved)
            state = torch.load(io.BytesIO(saved.getvalue()), weights_only=True)
            resumed = src(dataset, r, 2, block_docs=block_docs)
            resumed.load_state_dict(state)
            assert all(torch.equal(p, q) for p, q in zip(run(resumed, calls - stop), straight[r][stop:]))
        assert state["samples_consumed"] == stop * 4


def _steps(dp, mb, global_batch, steps, start_state=None, dataset=None, block_docs=None):
    """Rows of each optimizer step, in global-sample order, with dp ranks each asked for
    global_batch / (dp * mb) micro-batches per step, like the Trainer."""
    sources = [src(dataset, r, dp, mb=mb, block_docs=block_docs) for r in range(dp)]
    if start_state is not None:
        for s in sources:
            s.load_state_dict(start_state)
    out = []
    for _ in range(steps):
        per_rank = [torch.cat(run(s, global_batch // (dp * mb))) for s in sources]
        rows = []
        for call in range(global_batch // (dp * mb)):  # global order: call-major, then rank, then row
            for r in range(dp):
                rows += per_rank[r][call * mb:(call + 1) * mb]
        out.append(torch.stack(rows))
    return out, sources[0].state_dict()


@pytest.mark.parametrize("dp, mb, block_docs", [(1, 8, None), (4, 1, None), (1, 2, 16), (2, 4, 16), (4, 2, 16)])
def test_resume_at_another_dp_size_neither_repeats_nor_skips(dataset, dp, mb, block_docs):
    straight, _ = _steps(2, 2, 8, 10, dataset=dataset, block_docs=block_docs)
    head, state = _steps(2, 2, 8, 4, dataset=dataset, block_docs=block_docs)
    tail, _ = _steps(dp, mb, 8, 6, start_state=state, dataset=dataset, block_docs=block_docs)
    for a, b in zip(head + tail, straight):
        assert torch.equal(a, b)


def test_the_stream_is_the_same_in_another_process(dataset):
    source = src(dataset, 1, 2, mb=3, block_docs=16)
    source.samples_consumed = 6 * 40
    here = [source.next_batch().tolist() for _ in range(3)]
    code = ("import json, sys; from megatron_taper.data.streaming import StreamingSource; "
            f"s = StreamingSource(sys.argv[1], 'train', {SEQ}, 3, 1, 2, 7, block_docs=16); "
            "s.samples_consumed = 240; print(json.dumps([s.next_batch().tolist() for _ in range(3)]))")
    out = subprocess.run([sys.executable, "-c", code, dataset], check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONHASHSEED": "99"})
    assert json.loads(out.stdout) == here


def test_a_state_of_the_previous_order_is_refused_with_one_clear_error(dataset):
    state = src(dataset).state_dict()
    with pytest.raises(ValueError, match="data state version 1 is not 2: .*cannot resume exactly"):
        src(dataset).load_state_dict({**state, "version": 1})
    with pytest.raises(ValueError, match="block_docs changed"):
        src(dataset, block_docs=16).load_state_dict(state)


def test_resume_position_must_be_a_multiple_of_the_new_group(dataset):
    first = src(dataset, 0, 2, mb=3)
    first.next_batch()  # 6 global samples consumed
    with pytest.raises(ValueError, match="does not divide"):
        src(dataset, 0, 4, mb=1).load_state_dict(first.state_dict())
    with pytest.raises(ValueError, match="model.seq_len changed"):
        src(dataset, seq=16).load_state_dict(first.state_dict())
    with pytest.raises(ValueError, match="train.seed changed"):
        src(dataset, seed=8).load_state_dict(first.state_dict())


def test_fresh_eval_sources_read_the_same_beginning(dataset):
    a, b = src(dataset, split="val"), src(dataset, split="val")
    assert all(torch.equal(p, q) for p, q in zip(run(a, 3), run(b, 3)))
    assert a.num_documents < src(dataset).num_documents


def test_remote_with_cache_matches_local_and_copies_once(dataset, tmp_path):
    remote = tmp_path / "remote"
    shutil.copytree(dataset, remote)
    cache = tmp_path / "cache"
    local_batches = run(src(dataset, 1, 2), 12)
    a, b = src(str(remote), 1, 2, cache=str(cache)), src(str(remote), 1, 2, cache=str(cache))
    assert all(torch.equal(p, q) for p, q in zip(local_batches, run(a, 12)))
    assert all(torch.equal(p, q) for p, q in zip(local_batches, run(b, 12)))
    copied = os.path.join(cache_folder(str(cache), str(remote)), "train")
    assert any(f.endswith(".mds") for f in os.listdir(copied))
    assert os.path.isfile(os.path.join(copied, LENGTHS_FILE))
    with pytest.raises(ValueError, match="needs a local cache"):
        src("s3://bucket/data")


def test_a_token_id_outside_the_vocabulary_names_the_shard_where_it_is_read(dataset):
    """issue 41: an id >= model.vocab_size crashed ~120 steps in with a bare IndexError (a device
    assert on CUDA); the reader checks each document it reads and names the shard and document."""
    reader = ShardReader(dataset, "train", vocab_size=8)
    with pytest.raises(ValueError, match=r"/train/shard\.\d+\.mds: document \d+ holds token id \d+, outside "
                                         r"model\.vocab_size=8"):
        reader[0]
    assert len(ShardReader(dataset, "train", vocab_size=1 << 20)[0])  # in range: read as before


@pytest.mark.parametrize("name", ["../../../escaped.mds", "/tmp/escaped_abs.mds", "sub/../../escaped.mds", ".."])
def test_an_index_naming_a_shard_outside_its_folder_is_refused_before_any_copy(dataset, tmp_path, name):
    """A remote index.json whose shard basename climbs out of the split (or is absolute) would have
    the downloader write outside data.cache_dir (issue 41): refused naming the file and the field,
    nothing written."""
    remote = tmp_path / "remote"
    shutil.copytree(dataset, remote)
    index_file = remote / "train" / "index.json"
    index = json.loads(index_file.read_text())
    index["shards"][0]["raw_data"]["basename"] = name
    index_file.write_text(json.dumps(index))
    cache = tmp_path / "deep" / "er" / "cache"
    with pytest.raises(ValueError, match=r"index\.json: shards\[0\]\.raw_data\.basename=.* is not a plain file name"):
        ShardReader(str(remote), "train", str(cache))
    assert not any(p.name.startswith("escaped") for p in tmp_path.rglob("*"))
    assert not os.path.exists("/tmp/escaped_abs.mds")


def test_remote_shards_are_fetched_ahead_of_the_samples_that_need_them(dataset, tmp_path):
    """After one micro-batch, the shards of this rank's next SAMPLES_AHEAD samples are downloaded
    (in background threads) before any of those samples is drawn; the batches are unchanged."""
    from megatron_taper.data.streaming import SAMPLES_AHEAD

    remote = tmp_path / "remote"
    shutil.copytree(dataset, remote)
    source = src(str(remote), 1, 2, cache=str(tmp_path / "cache"))
    first = source.next_batch()
    for fetching in list(source.reader._fetching.values()):
        fetching.result()
    copied = os.path.join(cache_folder(str(tmp_path / "cache"), str(remote)), "train")
    cached = {f for f in os.listdir(copied) if f.endswith(".mds")}
    mb, group = source.micro_batch, source.group_size
    ahead = [(p // mb) * group + source.dp_rank * mb + p % mb for p in range(mb, SAMPLES_AHEAD)]
    needed = {source.reader._shards[source.reader.shard_of(doc)].raw_data.basename
              for g in ahead for doc, _, _ in source.order.pieces(g)}
    assert len(needed) > 1 and needed <= cached, sorted(needed - cached)
    local = src(dataset, 1, 2)
    assert torch.equal(first, local.next_batch())
    assert all(torch.equal(p, q) for p, q in zip(run(source, 6), run(local, 6)))


def test_a_shard_that_cannot_be_fetched_is_one_error_naming_it(dataset, tmp_path):
    """The remote loses its shards after the index was copied: the first read names the shard and the
    bounded download (attempts x timeout, under the collective timeout) instead of a bare library error."""
    remote = tmp_path / "remote"
    shutil.copytree(dataset, remote)
    source = src(str(remote), cache=str(tmp_path / "cache"))
    for name in os.listdir(remote / "train"):
        if name.endswith(".mds"):
            os.remove(remote / "train" / name)
    with pytest.raises(RuntimeError, match=r"shard shard\.\d+\.mds could not be fetched into the cache "
                                           r"\(3 attempts of 60 s\)"):
        source.next_batch()


def test_a_shard_stuck_behind_its_download_lock_stops_the_rank_naming_it(dataset, tmp_path):
    """Another process on the machine holds every shard's download lock and never lets go (a peer
    stuck mid-copy on a hung filesystem): the reading thread waits 3 attempts x
    data.download_timeout_s, then one error names the shard, whatever the download itself does
    (the hf:// and plain-path downloaders apply no timeout of their own)."""
    import time

    remote = tmp_path / "remote"
    shutil.copytree(dataset, remote)
    cache = str(tmp_path / "cache")
    source = StreamingSource(str(remote), "train", SEQ, 2, 0, 1, 7, cache, download_timeout_s=1.0)
    split_dir = os.path.join(cache_folder(cache, str(remote)), "train")
    locks = [os.path.join(split_dir, shard.raw_data.basename + ".lock") for shard in source.reader._shards]
    hold = ("import sys, time\nfrom filelock import FileLock\nheld = [FileLock(p) for p in sys.argv[1:]]\n"
            "for lock in held: lock.acquire()\n"
            "print('held', flush=True)\ntime.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", hold, *locks], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"train: shard shard\.\d+\.mds is not in the cache after 3 s"):
            source.next_batch()
        assert time.monotonic() - start < 60
    finally:
        holder.kill()
        holder.wait()


def test_compressed_shards_and_missing_lengths_file(corpus, tokenizer_model, dataset, tmp_path):
    from megatron_taper.data.corpus import SkipLog, read_documents
    from megatron_taper.data.preprocess import preprocess

    out = tmp_path / "zstd"
    preprocess(read_documents([corpus["jsonl"]], SkipLog()), tokenizer_model, str(out), skips=SkipLog(),
               val_fraction=0.2, shard_size="16kb", compression="zstd", progress=False)
    remote_batches = run(src(str(out), cache=str(tmp_path / "cache")), 6)
    os.remove(out / "train" / LENGTHS_FILE)
    rescanned, written = ShardReader(str(out), "train"), ShardReader(dataset, "train")
    assert rescanned.lengths.read(0, len(rescanned)).tolist() == written.lengths.read(0, len(written)).tolist()
    plain = run(src(dataset), 6)
    assert all(torch.equal(p, q) for p, q in zip(plain, remote_batches))
    assert all(torch.equal(p, q) for p, q in zip(plain, run(src(str(out)), 6)))


def test_user_errors(dataset, tmp_path):
    with pytest.raises(ValueError, match="no index.json"):
        src(str(tmp_path), split="val")
    with pytest.raises(ValueError, match="too few for one sample"):
        src(dataset, split="val", seq=10**7)
    with pytest.raises(ValueError, match="dp_rank=2 must be < dp_size=2"):
        src(dataset, 2, 2)
    with pytest.raises(ValueError, match="train.micro_batch=0"):
        src(dataset, mb=0)
    with pytest.raises(ValueError, match="block_docs=0"):
        src(dataset, block_docs=0)
