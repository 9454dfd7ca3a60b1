"""Adding a model family = one module. tests/helpers/toy_family.py, registered through
MEGATRON_TAPER_FAMILIES and nothing else, gets the standard family tests (tests/models/
test_arch_families.py and test_arch_tensor_parallel.py iterate over the registry: causality, cost
model, tapered twin, resume, tp=2 and pp=2 parity) without a test file naming it; it plans a
pipeline; its options section and cost model come from its card and spec."""
import json
import os
import subprocess
import sys

import pytest

from tests.helpers.runner import REPO, TINY

pytestmark = pytest.mark.multiprocess

ENV = {"MEGATRON_TAPER_FAMILIES": "tests.helpers.toy_family",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
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


def test_toy_family_gets_the_standard_tests():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "toy", "-rA",
                           "tests/models/test_arch_families.py", "tests/models/test_arch_tensor_parallel.py"],
                          cwd=REPO, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed = {line.split(" ", 1)[1].split("::")[-1] for line in proc.stdout.splitlines() if line.startswith("PASSED")}
    for case in ("toy_squared", "toy_relu"):
        for test in ("test_causal", "test_cost_model_matches_module_and_flop_counter",
                     "test_tapered_and_uniform_twins_have_equal_parameters", "test_tp2_matches_one_process",
                     "test_pp2_matches_one_process"):
            assert f"{test}[{case}]" in passed, (test, case, sorted(passed))
    assert "test_trains_and_resumes_exactly[toy_squared]" in passed, sorted(passed)


@pytest.fixture(scope="module")
def toy() -> dict:
    """One interpreter with the toy family registered (an interpreter start and a torch import
    each, before) runs what the toy tests below check, and prints it as JSON: tools/plan_pipeline.py's
    main (its exit code and JSON), the toy's options and cost model, and the refusals it meets."""
    out = _python(
        "import contextlib, importlib.util, io, json\n"
        "from megatron_taper.config import load_config\n"
        "from megatron_taper.cost.flops import model_costs\n"
        "from megatron_taper.cost.preflight import preflight\n"
        "from megatron_taper.models import build_model\n"
        "from megatron_taper.validation import ConfigError\n"
        "out = {}\n"
        "spec = importlib.util.spec_from_file_location('plan_pipeline', 'tools/plan_pipeline.py')\n"
        "tool = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(tool)\n"
        "printed = io.StringIO()\n"
        "with contextlib.redirect_stdout(printed):\n"
        f"    code = tool.main(['--json', *{TOY[2:]!r}, 'parallel.pp=2'])\n"
        "out['plan'] = [code, json.loads(printed.getvalue()) if code == 0 else printed.getvalue()]\n"
        "cfg = load_config('configs/tiny_taper.yaml', ['model.arch=toy', 'model.toy.squared=false'])\n"
        "model = build_model(cfg.model)\n"
        "params = sum(p.numel() for p in model.parameters())\n"
        "out['options'] = [cfg.model.toy.squared, model_costs(cfg.model).total_params == params]\n"
        "try:\n"
        "    load_config(None, ['model.toy.squaredd=false'])\n"
        "except ValueError as e:\n"
        "    out['misspelt'] = str(e)\n"
        "try:\n"
        "    preflight(load_config(None, ['model.arch=toy', 'parallel.tp=4', 'model.n_heads=4']), 4)\n"
        "except ValueError as e:\n"
        "    out['tp4'] = str(e)\n"
        "try:\n"
        "    preflight(load_config('configs/tiny_taper.yaml', ['model.arch=toy', 'parallel.cp=2']), 2)\n"
        "except ConfigError as e:\n"
        "    out['cp2'] = str(e)\n"
        "print(json.dumps(out))\n")
    return json.loads(out.splitlines()[-1])


def test_toy_family_plans_a_pipeline(toy):
    code, plan = toy["plan"]
    assert code == 0, plan
    stages = plan["stages"]
    assert sorted(i for s in stages for i in s) == [0, 1, 2, 3] and len(stages) == 2


def test_toy_family_options_and_costs(toy):
    assert toy["options"] == [False, True]
    assert "did you mean 'model.toy.squared'" in toy["misspelt"]
    assert "the toy family is tested up to parallel.tp=2" in toy["tp4"]


@pytest.mark.parametrize("value, message", [
    ("no_such_module", "cannot import model family module 'no_such_module'"),
    ("json", "module 'json' defines no SPECS"),
])
def test_bad_family_module_is_one_clear_error(value, message):
    proc = subprocess.run([sys.executable, "-c", "import megatron_taper.config"], cwd=REPO,
                          env={**os.environ, "MEGATRON_TAPER_FAMILIES": value}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and message in proc.stderr


def test_family_without_context_parallelism_is_refused_at_cp2(toy):
    """A family whose spec does not say context_parallel (every built-in one does) gets one error."""
    out = toy["cp2"]
    assert "parallel.cp=2: model.arch='toy' does not support context parallelism yet" in out, out
    assert "transformer" in out and "use parallel.cp=1" in out, out


def test_built_in_families_plan_without_torch():
    """A built-in family's SPECS name its model code through models.spec.lazy: every family's cost
    model, TP plan and layout checks (preflight) run without importing torch, and the model is
    imported when it is first built."""
    code = ("import sys\n"
            "from megatron_taper.config import load_config\n"
            "from megatron_taper.cost.flops import model_costs\n"
            "from megatron_taper.cost.preflight import preflight\n"
            "from megatron_taper.models import build_model, family\n"
            "from tests.helpers.families import family_cases\n"
            "for case, overrides in family_cases().items():\n"
            "    cfg = load_config('configs/tiny_taper.yaml', overrides)\n"
            "    preflight(cfg, 1)\n"
            "    assert model_costs(cfg.model).total_params > 0 and family(cfg.model.arch).tp_block_plan, case\n"
            "print(len(family_cases()), sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])\n"
            "print(type(build_model(cfg.model)).__name__, 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ENV["PYTHONPATH"], "MEGATRON_TAPER_FAMILIES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases, built = proc.stdout.splitlines()
    assert cases.endswith(" []") and int(cases.split()[0]) >= 8, cases
    assert built == "DeepMemoryLM True", built
