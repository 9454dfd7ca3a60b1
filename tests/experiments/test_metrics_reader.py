"""One reader for metrics.jsonl (megatron_taper.training.metrics.read_metrics), used by the sweep's
collection, the quickstart, benchmarks and tests: a torn last line (a run killed mid-write) is
skipped with a warning naming the file and line (the sweep's collection crashed on it); a line over
the cap is skipped with a warning naming the cap, without holding the line in memory (a 100 MB line
took 4.75 GB); any other bad line is one error naming the file and line."""
import json
import tracemalloc

import pytest

from megatron_taper.sweep import SweepRun, final_record
from megatron_taper.training.metrics import MAX_LINE_BYTES, read_metrics
from tests.helpers.runner import REPO


def _write(path, records, tail=b""):
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records) + tail)
    return path


def test_torn_last_line_is_skipped_with_a_warning_and_the_sweep_collects(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    records = [{"step": s, "loss": 5.0 - s} for s in (1, 2)] + [{"step": 2, "eval_loss": 3.25}]
    path = _write(run_dir / "metrics.jsonl", records, tail=b'{"step": 3, "lo')
    with pytest.warns(UserWarning) as seen:
        assert read_metrics(path) == records
    assert [str(w.message) for w in seen] == [f"{path}:4: a torn last line (a run killed while writing it?): skipped"]
    run = SweepRun("r", (), 0, str(REPO / "configs" / "tiny_taper.yaml"), ("train.steps=2",), str(run_dir))
    with pytest.warns(UserWarning, match="torn last line"):
        assert final_record(run, "eval_loss") == {"step": 2, "eval_loss": 3.25}


def test_a_line_over_the_cap_is_skipped_in_bounded_memory(tmp_path):
    path = tmp_path / "metrics.jsonl"
    big = 8 * MAX_LINE_BYTES
    with open(path, "wb") as f:
        f.write(b'{"step": 1, "loss": 2.5}\n{"junk": "' + b"x" * big + b'"}\n{"step": 2, "loss": 2.0}\n')
    tracemalloc.start()
    with pytest.warns(UserWarning) as seen:
        records = read_metrics(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert records == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.0}]
    assert [str(w.message) for w in seen] == [
        f"{path}:2: a line of {big + 13} bytes, over the {MAX_LINE_BYTES}-byte cap of a metrics record: skipped"]
    assert peak < 4 * MAX_LINE_BYTES, peak  # pieces of at most the cap, never the whole line


def test_a_bad_line_in_the_middle_is_an_error_naming_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n[1, 2]\n{"step": 2}\n')
    with pytest.raises(ValueError, match=rf"^{path}:2: not a JSON object: b'\[1, 2\]\\n'$"):
        read_metrics(path)
