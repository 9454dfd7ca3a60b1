"""The built-in dataset: built once even when several processes ask at once, then reused."""
import json
import multiprocessing
import os

from megatron_taper.data.builtin import builtin_data_dir, prepare_builtin_data
from megatron_taper.data.streaming import StreamingSource
from megatron_taper.data.tokenizer import Tokenizer
from megatron_taper.data.torchvision_compat import import_streaming

MAX_BYTES = 150_000


def _prepare(cache, queue):
    queue.put(prepare_builtin_data(cache, 400, max_bytes=MAX_BYTES))


def test_concurrent_callers_build_once_and_reuse(tmp_path, capfd):
    cache = str(tmp_path / "cache")
    import_streaming()  # before forking: the children inherit the (slow) import
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_prepare, args=(cache, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    paths = {queue.get(timeout=5) for _ in procs}
    assert len(paths) == 1
    path = paths.pop()
    err = capfd.readouterr().err
    assert err.count("[data] building the built-in dataset") == 1 and " done in " in err
    assert sorted(os.listdir(path)) == ["stats.json", "tokenizer.json", "tokenizer.model", "train", "val"]
    assert [n for n in os.listdir(cache) if not n.endswith(".lock")] == [os.path.basename(path)]

    assert prepare_builtin_data(cache, 400, max_bytes=MAX_BYTES) == path
    assert "[data]" not in capfd.readouterr().err
    stats = json.load(open(os.path.join(path, "stats.json")))
    assert stats["complete"] and stats["splits"]["val"]["documents"] > 0
    tok = Tokenizer(os.path.join(path, "tokenizer.model"))
    assert tok.vocab_size == 400
    batch = StreamingSource(path, "train", 64, 2, 0, 1, 0).next_batch()
    assert batch.shape == (2, 65) and int(batch.max()) < 400
    assert builtin_data_dir(cache, 400, MAX_BYTES) == path
    assert builtin_data_dir(cache, 512, MAX_BYTES) != path  # another vocabulary, another folder
