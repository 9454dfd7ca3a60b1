"""Adding a model family = one spec file. tests/models/toy_family.py, registered through
MEGATRON_TAPER_FAMILIES and nothing else, trains, plans a pipeline, shards at tp=2 and runs at
pp=2, matching its one-process run; its options section and cost model come from its spec."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from runner import REPO, TINY, losses, run_train

HERE = Path(__file__).resolve().parent
ENV = {"MEGATRON_TAPER_FAMILIES": "toy_family",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")]))}
TOY = ["--config", "configs/tiny_taper.yaml", *TINY, "model.arch=toy", "model.n_layers=4",
       "model.n_kv_heads=2", "train.steps=4", "train.eval_batches=1", "checkpoint.interval=0"]
# tp and pp change only the order of float32 reductions: the same losses to ~1e-6 (tp/pp tests
# elsewhere measure 1e-7..1e-6 on models of this size); 1e-4 leaves room and still catches a wrong shard
LOSS_ATOL = 1e-4


def _python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, **ENV}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_toy_family_trains_plans_and_shards(byte_tokens, tmp_path):
    data = f"data.path={byte_tokens}"
    run_train([*TOY, data, f"run.dir={tmp_path / 'one'}"], env=ENV)
    run_train([*TOY, data, f"run.dir={tmp_path / 'tp'}", "parallel.tp=2"], nproc=2, env=ENV)
    run_train([*TOY, data, f"run.dir={tmp_path / 'pp'}", "parallel.pp=2"], nproc=2, env=ENV)
    one = losses(tmp_path / "one")
    assert len(one) == 4 and all(0 < x < 10 for x in one)
    for layout in ("tp", "pp"):
        got = losses(tmp_path / layout)
        assert max(abs(a - b) for a, b in zip(got, one)) < LOSS_ATOL, (layout, got, one)

    plan = subprocess.run([sys.executable, "tools/plan_pipeline.py", "--json", *TOY[2:], "parallel.pp=2"],
                          cwd=REPO, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    stages = json.loads(plan.stdout)["stages"]
    assert sorted(i for s in stages for i in s) == [0, 1, 2, 3] and len(stages) == 2


def test_toy_family_options_and_costs():
    out = _python(
        "from megatron_taper.config import load_config\n"
        "from megatron_taper.cost.flops import model_costs\n"
        "from megatron_taper.models import build_model\n"
        "cfg = load_config('configs/tiny_taper.yaml', ['model.arch=toy', 'model.toy.squared=false'])\n"
        "model = build_model(cfg.model)\n"
        "params = sum(p.numel() for p in model.parameters())\n"
        "print(cfg.model.toy.squared, model_costs(cfg.model).total_params == params)\n"
        "try:\n"
        "    load_config(None, ['model.toy.squaredd=false'])\n"
        "except ValueError as e:\n"
        "    print(e)\n"
        "try:\n"
        "    from megatron_taper.preflight import preflight\n"
        "    preflight(load_config(None, ['model.arch=toy', 'parallel.tp=4', 'model.n_heads=4']), 4)\n"
        "except ValueError as e:\n"
        "    print(e)\n")
    lines = out.splitlines()
    assert lines[0] == "False True"
    assert "did you mean 'model.toy.squared'" in lines[1]
    assert "the toy family is tested up to parallel.tp=2" in lines[2]


@pytest.mark.parametrize("value, message", [
    ("no_such_module", "cannot import model family module 'no_such_module'"),
    ("json", "module 'json' defines no SPECS"),
])
def test_bad_family_module_is_one_clear_error(value, message):
    proc = subprocess.run([sys.executable, "-c", "import megatron_taper.config"], cwd=REPO,
                          env={**os.environ, "MEGATRON_TAPER_FAMILIES": value}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and message in proc.stderr
