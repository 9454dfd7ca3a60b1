"""tools/plan_pipeline.py plans what the trainer runs: the micro-batch split of the trainer's
layout line (pp=1: train.micro_batch x accumulation, parallel.microbatches unused; pp>1: the
pipeline's micro-batches), and the memory in the target's precision (train.precision=auto on
cuda: bf16, whatever machine plans), saying which."""
import json

from megatron_taper_tools.plan_pipeline import main as plan_main

from megatron_taper.config import load_config
from megatron_taper.cost.preflight import preflight, step_split
from megatron_taper.train import main as train_main
from tests.helpers.runner import REPO, TINY

RECIPE = str(REPO / "configs" / "transformer_1.3b_taper.yaml")


def _plan(capsys, *argv):
    assert plan_main(["--config", *argv]) == 0
    return capsys.readouterr().out


def test_recipe_plan_matches_the_trainers_split_and_target_precision(capsys):
    for pp, dp, split in ((1, 64, (4, 2)), (4, 8, (4, 16))):
        cfg = load_config(RECIPE, [f"parallel.pp={pp}"])
        layout = preflight(cfg, pp * dp)
        # what the trainer's layout line prints (console.summary_lines): micro_batch x accumulation,
        # and at pp > 1 the pipeline's micro-batches
        assert (cfg.train.micro_batch, layout.accumulation) == ((4, 2) if pp == 1 else (4, 16))
        assert step_split(cfg.parallel, cfg.train, dp) == split
        info = json.loads(_plan(capsys, RECIPE, "--json", "--dp", str(dp), f"parallel.pp={pp}"))
        memory = info["memory"]
        assert (memory["micro_batch"], memory["microbatches"]) == split
        assert memory["bf16"] and info["device"] == "cuda" and info["precision"] == "auto"
        text = _plan(capsys, RECIPE, "--dp", str(dp), f"parallel.pp={pp}").splitlines()[1]
        what = "accumulation" if pp == 1 else "pipeline micro-batches"
        assert "bf16 (train.precision=auto on cuda)" in text and text.endswith(f"micro_batch 4 x {split[1]} {what}")
    fp32 = json.loads(_plan(capsys, RECIPE, "--json", "--dp", "64", "parallel.pp=1", "--device", "cpu"))
    bf16 = json.loads(_plan(capsys, RECIPE, "--json", "--dp", "64", "parallel.pp=1"))
    assert not fp32["memory"]["bf16"] and fp32["stage_peak_bytes"][0] > bf16["stage_peak_bytes"][0]


def test_tiny_run_prints_the_split_the_planner_plans(byte_tokens, tmp_path, capsys):
    overrides = [*TINY, f"data.path={byte_tokens}", "parallel.microbatches=8", "train.device=cpu"]
    assert train_main(["--config", "configs/tiny_taper.yaml", *overrides, "train.steps=1",
                       f"run.dir={tmp_path / 'run'}"]) == 0
    layout = next(line for line in capsys.readouterr().out.splitlines() if "layout:" in line)
    assert layout.endswith("global_batch 8 = dp 1 x micro_batch 4 x 2 accumulation")
    text = _plan(capsys, "configs/tiny_taper.yaml", *overrides, "--dp", "1").splitlines()[1]
    assert "fp32 (train.precision=auto on cpu)" in text and text.endswith("micro_batch 4 x 2 accumulation")
