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
    assert report["collectives"]["ok"] and report["collectives"]["world_size"] == 1
    runs = report["throughput"]
    assert [(r["activation_checkpointing"], r.get("float8", False)) for r in runs] == [
        ("none", False), ("op", True), ("bogus", False)]
    assert all(r["tokens_per_s"] > 0 and r["step_s"] > 0 and "mfu_causal" in r and "mfu_full_attention" in r
               for r in runs[:2])
    assert runs[2]["expected_failure"] and "activation_checkpointing" in runs[2]["failed"]
