"""tools/sweep.py: a 2 x 2-seed grid trained for real (a few steps each), collected into a table;
restarting skips finished runs; bad sweep files fail before any run with the run and key named."""
import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from megatron_taper_tools import sweep as sweep_tool

from tests.helpers.runner import REPO

TINY = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.mlp_width=64", "model.vocab_size=256",
        "model.seq_len=16", "model.taper.multiple=8", "train.steps=4", "train.global_batch=2", "train.micro_batch=2",
        "train.warmup_steps=1", "train.log_interval=1", "train.eval_batches=1", "train.device=cpu",
        "run.tensorboard=false", "checkpoint.keep=1"]


def _sweep_file(tmp_path, data, axes: str) -> Path:
    overrides = "\n".join(f"  - {o}" for o in [*TINY, f"data.path={data}"])
    path = tmp_path / "sweep.yaml"
    path.write_text(f"recipe: {REPO}/configs/tiny_taper.yaml\noverrides:\n{overrides}\naxes:\n{axes}\nseeds: [0, 1]\n")
    return path


def _tool(*args):
    return subprocess.run([sys.executable, "tools/sweep.py", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _tool_here(*args) -> subprocess.CompletedProcess:
    """The tool's main in this process (dry runs and refusals: no interpreter start-up)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = sweep_tool.main([str(a) for a in args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


@pytest.mark.slow  # over ~20 s alone
def test_sweep_runs_collects_and_resumes(tmp_path, byte_tokens):
    axes = ("  taper:\n    cosine-1.5: {model.taper.schedule: cosine, model.taper.start: 1.5}\n"
            "    uniform: {model.taper.schedule: uniform}\n")
    spec, out = _sweep_file(tmp_path, byte_tokens, axes), tmp_path / "out"
    proc = _tool(spec, "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in result["runs"]] == ["taper=cosine-1.5,seed=0", "taper=cosine-1.5,seed=1",
                                                   "taper=uniform,seed=0", "taper=uniform,seed=1"]
    assert all(r["eval_loss"] > 0 for r in result["runs"])
    rows = {r["taper"]: r for r in result["table"]}
    assert set(rows) == {"cosine-1.5", "uniform"} and all(r["seeds_done"] == 2 for r in rows.values())
    losses = [r["eval_loss"] for r in result["runs"] if r["name"].startswith("taper=uniform")]
    assert rows["uniform"]["mean"] == pytest.approx(sum(losses) / 2)
    assert losses[0] != losses[1]  # seeds differ
    assert "| taper | eval_loss mean |" in (out / "results.md").read_text()
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the runs really differ in their taper
    cosine_cfg = (out / "runs" / "taper=cosine-1.5,seed=0" / "config.yaml").read_text()
    assert "schedule: cosine" in cosine_cfg and "seed: 0" in cosine_cfg
    # restart (the tool's main in this process: it starts no run): nothing left to train, same table
    stamp = (out / "runs" / "taper=uniform,seed=1" / "metrics.jsonl").stat().st_mtime_ns
    start = time.monotonic()
    again = _tool_here(spec, "--out", out)
    assert again.returncode == 0 and "1/" not in again.stdout
    assert (out / "runs" / "taper=uniform,seed=1" / "metrics.jsonl").stat().st_mtime_ns == stamp
    assert json.loads((out / "results.json").read_text())["table"] == result["table"]
    print(f"restart with every run finished: {time.monotonic() - start:.1f} s")


def test_sweep_bad_inputs(tmp_path, byte_tokens):
    bad_key = _sweep_file(tmp_path, byte_tokens, "  model.taper.strat: [1.5]\n")
    proc = _tool_here(bad_key, "--out", tmp_path / "o1", "--dry-run")
    assert proc.returncode == 2 and "run model.taper.strat=1.5,seed=0" in proc.stderr
    assert "did you mean 'model.taper.start'" in proc.stderr
    bad_label = _sweep_file(tmp_path, byte_tokens, "  taper:\n    a/b: {model.taper.start: 1.5}\n")
    proc = _tool_here(bad_label, "--out", tmp_path / "o2", "--dry-run")
    assert proc.returncode == 2 and "label 'a/b'" in proc.stderr
    proc = _tool_here(tmp_path / "missing.yaml", "--out", tmp_path / "o3")
    assert proc.returncode == 2 and "missing.yaml" in proc.stderr
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


@pytest.mark.slow  # over ~20 s alone
def test_sweep_tokenizes_its_corpus_runs_grids_and_pairs_with_baseline(tmp_path):
    """`data` turns raw text into OUT/data once; two grids with the same axes run together
    (--jobs 2); the baseline column is each run minus the baseline's run of the same seed."""
    corpus = tmp_path / "corpus.txt"
    sources = sorted(Path(os.__file__).parent.glob("[a-c]*.py"))
    corpus.write_text("\n\n".join(p.read_text(encoding="utf-8") for p in sources)[:300_000], encoding="utf-8")
    overrides = "\n".join(f"  - {o}" for o in TINY if not o.startswith("model.vocab_size"))
    spec = tmp_path / "sweep.yaml"
    spec.write_text(
        f"recipe: {REPO}/configs/tiny_taper.yaml\noverrides:\n{overrides}\n  - model.vocab_size=512\n"
        "data: {text_mode: paragraph, val_fraction: 0.1}\n"
        "axes:\n  - taper:\n      cosine: {model.taper.schedule: cosine}\n"
        "      uniform: {model.taper.schedule: uniform}\n"
        "  - taper:\n      linear: {model.taper.schedule: linear}\n      uniform: {model.taper.schedule: uniform}\n"
        "seeds: [0]\nbaseline: {taper: uniform}\n")
    out = tmp_path / "out"
    proc = _tool(spec, "--out", out, "--corpus", corpus, "--jobs", "2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    stamp = json.loads((out / "data" / "sweep_data.json").read_text())
    assert stamp["corpus"] == [str(corpus)] and stamp["vocab_size"] == 512
    assert json.loads((out / "data" / "stats.json").read_text())["splits"]["val"]["documents"] > 0
    result = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in result["runs"]] == ["taper=cosine,seed=0", "taper=uniform,seed=0", "taper=linear,seed=0"]
    loss = {r["taper"]: r["eval_loss"] for r in result["runs"]}
    rows = {r["taper"]: r for r in result["table"]}
    assert rows["cosine"]["delta"]["mean"] == pytest.approx(loss["cosine"] - loss["uniform"])
    assert rows["linear"]["delta"]["mean"] == pytest.approx(loss["linear"] - loss["uniform"])
    assert "delta" not in rows["uniform"]
    assert "vs taper=uniform (paired by seed" in (out / "results.md").read_text()
    listed = _tool_here(spec, "--out", out, "--corpus", corpus, "--dry-run").stdout.splitlines()
    assert all(f"data.path={out / 'data'}" in json.loads(line)["args"] for line in listed)
    # other raw text for the same OUT: refused, nothing overwritten
    other = tmp_path / "other.txt"
    other.write_text(corpus.read_text()[:100_000])
    proc = _tool_here(spec, "--out", out, "--corpus", other)
    assert proc.returncode == 2 and "holds data made from" in proc.stderr
    assert json.loads((out / "data" / "sweep_data.json").read_text()) == stamp
    # bad data settings name the key
    spec.write_text(spec.read_text().replace("val_fraction: 0.1", "val_fraction: 0.9"))
    proc = _tool_here(spec, "--out", tmp_path / "o4", "--corpus", corpus, "--dry-run")
    assert proc.returncode == 2 and "data.val_fraction 0.9" in proc.stderr


def test_sweep_only_selects_runs(tmp_path, byte_tokens):
    axes = ("  taper:\n    cosine: {model.taper.schedule: cosine}\n    uniform: {model.taper.schedule: uniform}\n"
            "    linear: {model.taper.schedule: linear}\n")
    spec = _sweep_file(tmp_path, byte_tokens, axes)
    proc = _tool_here(spec, "--out", tmp_path / "o", "--dry-run", "--only", "taper=uniform,linear")
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["name"] for line in proc.stdout.splitlines()] == [
        "taper=uniform,seed=0", "taper=uniform,seed=1", "taper=linear,seed=0", "taper=linear,seed=1"]
    proc = _tool_here(spec, "--out", tmp_path / "o", "--dry-run", "--only", "taper=unifrom")
    assert proc.returncode == 2 and "'unifrom' is not a label of axis taper" in proc.stderr


def test_sweep_data_never_replaces_a_folder_it_did_not_write(tmp_path):
    """issue 41: with a `data:` section, an existing OUT/data that no sweep wrote (no sweep_data.json,
    no partial marker) was replaced; now the sweep refuses, naming it, and leaves it as it was."""
    from megatron_taper.sweep import SweepData, prepare_data
    from megatron_taper.validation import ConfigError

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text\n\nmore text\n", encoding="utf-8")
    mine = tmp_path / "out" / "data"
    mine.mkdir(parents=True)
    (mine / "precious.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="exists and was not written by a sweep"):
        prepare_data(SweepData((str(corpus),), "paragraph", 0.0, 64, str(mine)), log=lambda *_: None)
    assert (mine / "precious.txt").read_text() == "keep me"
