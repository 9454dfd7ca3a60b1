"""tools/sweep.py: a 2 x 2-seed grid trained for real (a few steps each), collected into a table;
restarting skips finished runs; bad sweep files fail before any run with the run and key named."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
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
    # restart: nothing left to train, same table
    stamp = (out / "runs" / "taper=uniform,seed=1" / "metrics.jsonl").stat().st_mtime_ns
    start = time.monotonic()
    again = _tool(spec, "--out", out)
    assert again.returncode == 0 and "1/" not in again.stdout
    assert (out / "runs" / "taper=uniform,seed=1" / "metrics.jsonl").stat().st_mtime_ns == stamp
    assert json.loads((out / "results.json").read_text())["table"] == result["table"]
    print(f"restart with every run finished: {time.monotonic() - start:.1f} s")


def test_sweep_bad_inputs(tmp_path, byte_tokens):
    bad_key = _sweep_file(tmp_path, byte_tokens, "  model.taper.strat: [1.5]\n")
    proc = _tool(bad_key, "--out", tmp_path / "o1", "--dry-run")
    assert proc.returncode == 2 and "run model.taper.strat=1.5,seed=0" in proc.stderr
    assert "did you mean 'model.taper.start'" in proc.stderr
    bad_label = _sweep_file(tmp_path, byte_tokens, "  taper:\n    a/b: {model.taper.start: 1.5}\n")
    proc = _tool(bad_label, "--out", tmp_path / "o2", "--dry-run")
    assert proc.returncode == 2 and "label 'a/b'" in proc.stderr
    proc = _tool(tmp_path / "missing.yaml", "--out", tmp_path / "o3")
    assert proc.returncode == 2 and "missing.yaml" in proc.stderr
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
