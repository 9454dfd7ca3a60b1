"""benchmarks/gpu_check.sh runs end to end (`--smoke`: toy sizes on the CPU), so the prepared GPU
check is known to work before a GPU is at hand; its numbers are only meaningful on a GPU."""
import json
import os
import subprocess

from tests.helpers.runner import REPO


def test_gpu_check_smoke(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--smoke"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["parity"]["ok"] and report["parity"]["max_abs_diff"] == 0.0  # the CPU against itself
    runs = report["throughput"]
    assert [(r["activation_checkpointing"], r["compile"]) for r in runs] == [("none", False), ("full", False)]
    assert all(r["tokens_per_s"] > 0 and r["step_s"] > 0 for r in runs)
