"""tools/plan_pipeline.py: the keys of --json (its docstring), the text table, and its errors."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.helpers.runner import REPO

TOOL = os.path.join(REPO, "tools", "plan_pipeline.py")
RECIPE = os.path.join(REPO, "configs", "transformer_1.3b_taper.yaml")


def _tool():
    spec = importlib.util.spec_from_file_location("plan_pipeline_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_json_contract_cli():
    out = subprocess.run([sys.executable, TOOL, "--config", RECIPE, "parallel.pp=4", "--json"],
                         capture_output=True, text=True, check=True, cwd=REPO).stdout
    plan = json.loads(out)
    for key in ("stages", "stage_flops", "bottleneck_over_ideal", "uniform_bottleneck_over_ideal"):
        assert key in plan
    assert len(plan["stages"]) == 4 and sum(plan["stages"], []) == list(range(32))
    assert plan["bottleneck_over_ideal"] < 1.05 < 1.15 < plan["uniform_bottleneck_over_ideal"]


@pytest.mark.parametrize("pp", [4, 8])
def test_flops_beats_params_beats_uniform_on_recipe(pp, capsys):
    tool = _tool()
    ratios = {}
    for balance in ("flops", "params", "uniform"):
        assert tool.main(["--config", RECIPE, f"parallel.pp={pp}", f"parallel.pp_balance={balance}", "--json"]) == 0
        ratios[balance] = json.loads(capsys.readouterr().out)["bottleneck_over_ideal"]
    assert ratios["flops"] <= ratios["params"] <= ratios["uniform"]


def test_text_table(capsys):
    assert _tool().main(["--config", RECIPE, "parallel.pp=2"]) == 0
    text = capsys.readouterr().out
    assert "GFLOP/tok" in text and "bottleneck / ideal" in text and "layer-count split" in text
    assert len([line for line in text.splitlines() if line.strip().startswith(("0 ", "1 "))]) == 2


def test_errors(capsys):
    tool = _tool()
    assert tool.main(["--config", RECIPE, "parallel.pp=40"]) == 2
    assert "model.n_layers=32" in capsys.readouterr().err
    assert tool.main(["--config", RECIPE, "parallel.pp=4", "--memory-gb", "1"]) == 2
    assert "--memory-gb" in capsys.readouterr().err
    assert tool.main(["--config", RECIPE, "parallel.pp=4", "parallel.pp_memory_gb=1"]) == 2
    assert "parallel.pp_memory_gb" in capsys.readouterr().err
    assert tool.main(["--config", RECIPE, "parallel.pp=4", "parallel.pp_memory_gb=40", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert max(plan["stage_peak_bytes"]) <= 40 * 2**30
    assert plan["stage_peak_bytes"] == [a + b for a, b in zip(plan["stage_static_bytes"], plan["stage_act_bytes"])]
    assert plan["rank_peak_bytes"] == plan["stage_peak_bytes"]  # one chunk per rank
    # interleaved: a rank's chunks together, their activations in flight on top of the largest
    assert tool.main(["--config", RECIPE, "parallel.pp=4", "parallel.pp_schedule=interleaved_1f1b", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    for rank in range(4):
        chunks = [c for c, r in enumerate(plan["stage_ranks"]) if r == rank]
        assert plan["rank_static_bytes"][rank] == pytest.approx(sum(plan["stage_static_bytes"][c] for c in chunks))
        assert plan["rank_peak_bytes"][rank] > max(plan["stage_peak_bytes"][c] for c in chunks)
    assert tool.main(["--config", RECIPE, "parallel.pp_balance=bogus"]) == 2
    assert "parallel.pp_balance" in capsys.readouterr().err


def test_70b_recipe_plans_from_the_cost_model_alone(capsys):
    """The 70B-class recipe is shown and planned from the cost model: no weights are built."""
    recipe = os.path.join(REPO, "configs", "transformer_70b_taper.yaml")
    assert _tool().main(["--config", recipe, "--dp", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert len(plan["stages"]) == 8 and sum(plan["stages"], []) == list(range(80))
    assert plan["bottleneck_over_ideal"] < plan["uniform_bottleneck_over_ideal"]
    spec = importlib.util.spec_from_file_location("show_model_tool", os.path.join(REPO, "tools", "show_model.py"))
    show = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(show)
    assert show.main(["--config", recipe, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert 68e9 < info["total_params"] == info["uniform_total_params"] < 70e9
    assert info["widths"][0] == 43008 and info["widths"][-1] == 14336


def test_memory_columns_follow_layout_precision_and_checkpointing(capsys):
    """The memory columns are the per-rank peak of megatron_taper/cost/memory.py for the config."""
    tool = _tool()

    def plan(*overrides, options=("--device", "cpu")):  # cpu: precision auto is fp32
        assert tool.main(["--config", RECIPE, "--json", *options, "parallel.pp=4", *overrides]) == 0
        return json.loads(capsys.readouterr().out)

    base = plan()
    assert base["memory"]["dp"] == 8 and base["memory"]["micro_batch"] == 4 and base["memory"]["microbatches"] == 16
    peak = max(base["stage_peak_bytes"])
    for override in ("train.precision=bf16", "train.activation_checkpointing=full", "parallel.tp=2"):
        assert max(plan(override)["stage_peak_bytes"]) < 0.8 * peak, override
    fsdp = plan("parallel.zero=fsdp2")  # pipelined: shards of 16/dp, plus the stage's weights gathered
    assert max(fsdp["stage_static_bytes"]) < max(base["stage_static_bytes"])
    custom = plan(options=("--device", "cpu", "--bytes-per-param", "20"))
    assert custom["stage_static_bytes"][1] == pytest.approx(base["stage_static_bytes"][1] * 20 / 16)
    # 1F1B: the first stage holds 4 micro-batches in flight, the last one
    assert base["stage_act_bytes"][0] > 2 * base["stage_act_bytes"][-1]
    # a limit the plain run cannot meet fits once blocks are recomputed
    assert tool.main(["--config", RECIPE, "--device", "cpu", "parallel.pp=4", "parallel.pp_memory_gb=20"]) == 2
    err = capsys.readouterr().err
    assert "parallel.pp_memory_gb" in err and "x the limit on its fullest stage" in err
    recomputed = plan("parallel.pp_memory_gb=20", "train.activation_checkpointing=full")
    assert max(recomputed["stage_peak_bytes"]) <= 20 * 2**30
