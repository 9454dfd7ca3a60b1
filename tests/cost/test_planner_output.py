"""What the layout planner prints (megatron_taper/cost/plan.py, tools/plan_layout.py, train.sbatch --dry-run):
a row's micro-batch and its overrides agree (at pp > 1 parallel.microbatches sets the split, and the
row's train.micro_batch is that split's); dropped layouts are counted by kind and printed with the
real values of one refusal; the device is a flag (--device, --gpus-per-node, --nodes) and the output
names it, so a login node plans a GPU job's auto layout for the job's GPUs."""
import importlib.util
import json
import os
import re
import subprocess
import sys

from megatron_taper.config import load_config
from megatron_taper.cost.devices import profiles
from megatron_taper.cost.plan import search, with_values
from megatron_taper.cost.preflight import preflight, step_split
from tests.helpers.runner import REPO

SPACE = (("parallel.pp", (1, 2)), ("parallel.zero", ("none",)), ("train.micro_batch", (1, 2, 4, 8)),
         ("train.activation_checkpointing", ("full",)))


def _plan_layout():
    spec = importlib.util.spec_from_file_location("plan_layout", REPO / "tools" / "plan_layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rows_and_their_overrides_agree_when_microbatches_set_the_split():
    cfg = load_config(str(REPO / "configs" / "gated_attention_1.3b_taper.yaml"))  # parallel.microbatches: 16
    result = search(cfg, 8, 80.0, profiles()["h100"], space=SPACE)
    rows = result.layouts
    assert {x.layout.pp for x in rows} == {1, 2}
    for x in rows:
        mb = x.values["train.micro_batch"]
        assert f"micro_batch={mb} x {x.layout.microbatches} " in x.describe(), x.describe()
        again = with_values(cfg, x.values)  # the row's overrides give the row's split
        assert step_split(again.parallel, again.train, preflight(again, 8).dp) == (mb, x.layout.microbatches)
    assert len({tuple(x.values.items()) for x in rows}) == len(rows)  # each layout once
    pipelined = [x for x in rows if x.layout.pp == 2]
    assert len(pipelined) == 1 and "pipeline micro-batches" in pipelined[0].describe()
    same = [k for k, (example, _) in result.examples.items() if "whatever train.micro_batch is" in example]
    assert len(same) == 1 and result.dropped[same[0]] == 3


def test_dropped_kinds_print_real_values(capsys):
    cfg = load_config(str(REPO / "configs" / "gated_attention_1.3b_taper.yaml"))
    space = (("parallel.tp", (1, 3)), ("parallel.pp", (1, 2, 64)), ("train.micro_batch", (8,)))
    result = search(cfg, 8, 80.0, profiles()["h100"], space=space)
    text = _plan_layout().to_text(result, 1, 0.0)
    dropped = text.split("dropped (layouts, the first refusal of each kind):\n")[1].splitlines()
    assert dropped and not [line for line in dropped if re.search(r"=N\b|\bN\b", line)], dropped
    assert any("parallel.pp=64 = 64 does not divide the world size 8" in line for line in dropped), dropped
    assert set(result.dropped) == set(result.examples)  # the JSON keeps the kinds (numbers as N)


def test_device_flags_and_a_mistyped_one(capsys):
    tool = _plan_layout()
    recipe = ["--config", str(REPO / "configs" / "tiny_taper.yaml"), "--top", "1"]
    try:
        tool.main([*recipe, "--gpu", "2"])
    except SystemExit as e:
        assert e.code == 2
    assert capsys.readouterr().err.strip().endswith("error: unknown option --gpu; did you mean --gpus?")
    assert tool.main([*recipe, "--nodes", "2", "--device", "h200", "--gpus-per-node", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpus"] == 8 and out["device"]["name"] == "H200" and out["device"]["gpus_per_node"] == 4
    assert tool.main([*recipe, "--nodes", "2", "--device", "h200"]) == 0
    assert capsys.readouterr().out.startswith("planned for 16 x H200 (2 node(s)), ")
    spec = importlib.util.spec_from_file_location("plan_pipeline", REPO / "tools" / "plan_pipeline.py")
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    try:  # megatron-taper-plan hands the device flags (and the typo) to the layout search
        plan.main([*recipe, "--gpu", "2"])
    except SystemExit as e:
        assert e.code == 2
    assert capsys.readouterr().err.strip().endswith("error: unknown option --gpu; did you mean --gpus?")


def test_sbatch_dry_run_plans_auto_layout_for_the_jobs_device(tmp_path):
    env = {**os.environ, "VENV": sys.prefix, "OMP_NUM_THREADS": "1", "NNODES": "2",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("NPROC_PER_NODE", None)
    proc = subprocess.run(["bash", "launch/train.sbatch", "--dry-run", "--device", "h100", "--config",
                           "configs/tiny_taper.yaml", "parallel.layout=auto", f"run.dir={tmp_path / 'run'}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "[train.sbatch] dry run: 2 node(s) x 8 process(es) of --device h100"
    assert lines[1].startswith("layout auto: ")
    assert "(planned for --device h100: H100, 74.5 GiB, 8 per node (cost/devices.json; " in lines[1]
    assert lines[2].startswith("processes: 2 node(s) x 8 per node = 16: ")
    bad = subprocess.run(["bash", "launch/train.sbatch", "--device", "h100", "--config", "configs/tiny_taper.yaml"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr == "train.sbatch: --device is for --dry-run (a job plans for the GPUs " \
                                                 "it gets)\n"
