"""benchmarks/gpu_check.sh runs end to end (`--smoke`: toy sizes on the CPU), so the prepared GPU
check is known to work before a GPU is at hand; its numbers are only meaningful on a GPU.

The package index is made unreachable (PIP_INDEX_URL to a closed port, PIP_NO_INDEX): the script
must not try to install anything when its Python (PYTHON=this interpreter) already imports the
package. Every part is in the JSON, including the variant that fails on purpose (`failed`)."""
import json
import os
import subprocess
import sys

from tests.helpers.runner import REPO


def test_gpu_check_smoke(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHON": sys.executable, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_INDEX": "1"}
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--smoke"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "install" not in proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["parity"]["ok"] and report["parity"]["max_abs_diff"] == 0.0  # the CPU against itself
    assert report["bf16_parity"]["ok"] and report["bf16_parity"]["precision"] == "bf16"
    assert report["bf16_parity"]["cpu_losses"] != report["parity"]["cpu_losses"]  # bf16 autocast really ran
    assert report["collectives"]["ok"] and report["collectives"]["world_size"] == 1
    runs = report["throughput"]
    assert [(r["activation_checkpointing"], r.get("float8", False)) for r in runs] == [
        ("none", False), ("op", True), ("op", False), ("bogus", False)]
    assert all(r["tokens_per_s"] > 0 and r["step_s"] > 0 and "mfu_causal" in r and "mfu_full_attention" in r
               for r in runs[:3])
    # the planner's prediction beside each measurement; the cpu profile has no fp8 peak, said so
    assert all(r["predicted_step_s"] > 0 and r["predicted_peak_gib"] > 0 for r in (runs[0], runs[2]))
    assert "fp8_tflops" in runs[1]["prediction_failed"]
    assert runs[2]["overrides"][0] == "model.seq_len=64"
    assert runs[2]["predicted_peak_gib"] != runs[0]["predicted_peak_gib"]
    assert runs[3]["expected_failure"] and "activation_checkpointing" in runs[3]["failed"]


def test_gpu_families_smoke(tmp_path):
    """benchmarks/gpu_families.py --smoke: the tiny Transformer and bridge's CPU-against-CPU parity, one
    sized run and one resume on the CPU, so the script is known to work before a GPU is at hand."""
    out = tmp_path / "families.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "benchmarks/gpu_families.py", "--smoke", "--out", str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [(r["config"], r["precision"]) for r in report["parity"]] == [
        ("configs/tiny_taper.yaml", "fp32"), ("configs/tiny_bridge.yaml", "fp32")]
    assert all(r["ok"] and r["max_abs_diff"] == 0.0 for r in report["parity"])
    assert [r["recipe"] for r in report["sized"]] == ["tiny_bridge"] and report["sized"][0]["predicted_step_s"] > 0
    resumed = report["resume"]
    assert len(resumed) == 1 and resumed[0]["bitwise"] and len(resumed[0]["straight"]) == 6
