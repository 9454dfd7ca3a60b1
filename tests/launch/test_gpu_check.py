"""benchmarks/gpu_check.sh and benchmarks/gpu_families.py run end to end (`--smoke`: toy sizes on the
CPU), so the prepared GPU checks are known to work before a GPU is at hand; their numbers are only
meaningful on a GPU.

The package index is made unreachable (PIP_INDEX_URL to a closed port, PIP_NO_INDEX): the script
must not try to install anything when its Python (PYTHON=this interpreter) already imports the
package. Every part is in the JSON, including the variant that fails on purpose (`failed`)."""
import json
import os
import subprocess
import sys

import pytest

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
    assert report["moe_bf16_parity"]["ok"] and report["moe_bf16_parity"]["config"].endswith("tiny_moe_taper.yaml")
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


def families(tmp_path, *args):
    out = tmp_path / "families.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "benchmarks/gpu_families.py", "--smoke", "--out", str(out), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report == json.loads(proc.stdout.strip().splitlines()[-1])
    return report


@pytest.mark.slow  # over ~20 s alone (a CPU compile of the Transformer's row)
def test_gpu_families_smoke(tmp_path):
    """benchmarks/gpu_families.py --smoke: the speed matrix's rows for the tiny Transformer and linear
    memory caching (eager for both, compiled for the Transformer: the reference of the ratios), the
    tiny Transformer and bridge's CPU-against-CPU parity and one resume on the CPU, so the script is
    known to work before a GPU is at hand."""
    report = families(tmp_path)
    rows = report["speed"]
    assert [(r["family"], r["variant"]) for r in rows] == [
        (f, v) for f in ("transformer", "linear_memory")
        for v in ("eager", "compiled", "compiled_kernels", "compiled_graphs")]
    measured = [r for r in rows if "skipped" not in r]
    assert [(r["family"], r["variant"]) for r in measured] == [
        ("transformer", "eager"), ("transformer", "compiled"), ("linear_memory", "eager")]
    assert all(r["micro_batch"] == 2 and r["tokens_per_s"] > 0 and r["step_s"] > 0 and r["first_step_s"] > 0
               and "mfu_causal" in r and len(r["losses"]) >= 3 and not r["truncated"] for r in measured)
    eager, compiled, memory = measured
    # one step's ATen operators on the CPU, labelled; the memory family reaches its kernel choice
    assert eager["kernels_per_step"] > 0 and "ATen" in eager["kernel_count"] and eager["kernel_calls"] == 0
    assert memory["kernels_per_step"] > eager["kernels_per_step"] and memory["kernel_calls"] > 0
    assert compiled["compile_s"] > 0 and compiled["graphs"] >= 1 and compiled["kernels_per_step"] is None
    assert compiled["loss_diff_first_step"] < 1e-4 and compiled["loss_max_abs_diff"] < 1e-4  # fp32 on the CPU
    assert compiled["first_loss"] == compiled["losses"][0]
    # ratios to the compiled Transformer of the same size and micro-batch
    assert compiled["tokens_per_s_vs_reference"] == 1.0 and compiled["step_vs_reference"] == 1.0
    assert memory["reference"]["recipe"] == "tiny_taper" and memory["tokens_per_s_vs_reference"] > 0
    assert eager["predicted_step_s"] > 0 and memory["predicted_step_s"] > 0
    skipped = {(r["family"], r["variant"]): r["skipped"] for r in rows if "skipped" in r}
    assert "need CUDA" in skipped[("linear_memory", "compiled_kernels")]
    assert "CUDA graphs need CUDA" in skipped[("transformer", "compiled_graphs")]
    assert "--smoke" in skipped[("linear_memory", "compiled")]
    goal = next(g for g in report["goals"] if g["family"] == "linear_memory")
    assert goal["met"] is None and "--smoke" in goal["missing"]
    assert [(r["config"], r["precision"]) for r in report["parity"]] == [
        ("configs/tiny_taper.yaml", "fp32"), ("configs/tiny_bridge.yaml", "fp32")]
    assert all(r["ok"] and r["max_abs_diff"] == 0.0 for r in report["parity"])
    resumed = report["resume"]
    assert len(resumed) == 1 and resumed[0]["bitwise"] and len(resumed[0]["straight"]) == 6


def test_gpu_families_budget_spent(tmp_path, monkeypatch, capsys):
    """A spent budget: every row and part is reported as skipped with the reason, none estimated
    (the script's main in this process: with nothing to run, no interpreter start-up is needed)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_families

    out = tmp_path / "families.json"
    monkeypatch.setattr(sys, "argv", ["gpu_families.py", "--smoke", "--out", str(out), "--budget-s", "0"])
    assert gpu_families.main() == 0
    report = json.loads(out.read_text())
    assert report == json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(report["speed"]) == 8 and all("skipped" in r and "tokens_per_s" not in r for r in report["speed"])
    assert any("time budget" in r["skipped"] for r in report["speed"])
    assert all("time budget" in r["skipped"] for r in report["parity"] + report["resume"])
    assert all(g["met"] is None for g in report["goals"])


def test_gpu_families_goals():
    """The goals are judged on measured rows only: met, unmet, or null with what was missing."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_families import GOALS, goals

    def row(family, variant, **measures):
        return {"family": family, "role": "family", "variant": variant, "micro_batch": 4, **measures}

    rows = [row("linear_memory", "compiled", tokens_per_s_vs_reference=0.5),
            row("linear_memory", "compiled_kernels", tokens_per_s_vs_reference=0.8),
            row("titans", "compiled", tokens_per_s_vs_reference=0.3),
            row("titans", "compiled_kernels", skipped="the Triton kernels need CUDA"),
            row("hope_attention", "compiled", tokens_per_s_vs_reference=0.4, peak_allocated_vs_reference=1.7),
            row("bridge", "compiled", step_vs_reference=1.2)]
    judged = {g["goal"]: g for g in goals(rows, [4])}
    assert len(judged) == len(GOALS)
    assert judged["linear MC >= 0.7x tokens/s"]["met"] is True
    assert judged["linear MC >= 0.7x tokens/s"]["variant"] == "compiled_kernels"
    assert judged["Titans >= 0.35x tokens/s, torch form compiled"]["met"] is False
    assert judged["Titans >= 0.7x tokens/s with the kernels"]["met"] is None
    assert "need CUDA" in judged["Titans >= 0.7x tokens/s with the kernels"]["missing"]
    assert judged["Hope >= 0.3x tokens/s, peak <= 1.5x"]["met"] is False  # fast enough, too much memory
    assert judged["bridge step <= 1.5x"]["met"] is True
    assert judged["deep MC >= 0.35x tokens/s, torch form compiled"]["met"] is None
