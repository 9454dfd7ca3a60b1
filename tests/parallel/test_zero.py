"""ZeRO-3 over dp with parallel.zero = fsdp2: parity, 3D composition, checkpoints; and the
model, runs and helpers the other ZeRO test files share (test_zero_deepspeed.py holds DeepSpeed's
tests, in a file of its own so that the two halves run on different pytest-xdist workers).

Every run is the Trainer (Trainer(cfg).fit(), the code path of `python -m megatron_taper.train`)
on gloo processes from the harness (the one-process reference in this process), 10 steps of a
3-layer d=64 tapered model whose MLP widths (75-multiples of 5) split unevenly over tp=2 and
whose tensors split unevenly over dp=2.
Gradient clipping (1.0) is active in every step, so the global norm over ZeRO shards matters.

Parity: each layout's 10 losses within TOL = 5e-5 of one process (zero=none); fp32 reduction
orders alone differ by ~1e-6 per step. Resume on another layout: the fsdp2 dp=2 run's step-5
checkpoint continues at dp=1 and at tp=2 with that run's losses (TOL); a dp=2 run SIGKILLed
after step 5 and resumed at dp=2 repeats them bitwise; tools/convert_checkpoint.py exports the
one-process run's and the fsdp2 run's logical files to the same tensors (within 1e-4).

Launches: the one-process reference runs in this process; the fsdp2 dp=2 run, its resume at tp=2
and the bf16 step share one 2-process launch (tests/helpers/sessions.py), the three 4-process
layouts one 4-process launch; the SIGKILLed run is a real torchrun, its resume a 2-process launch.

C++ ops DeepSpeed JIT-builds (none on these layouts: parallel/dp/zero_deepspeed.py keeps its
shared-memory all-reduce op from being built) are cached in TORCH_EXTENSIONS_DIR, which
tests/run.sh sets to .cache/torch_extensions in the repository, and this module too when run
directly.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.harness import run_distributed
from tests.helpers.runner import REPO, kill_tree
from tests.helpers.sessions import run_cases

pytestmark = pytest.mark.multiprocess

EXT_DIR = os.environ.get("TORCH_EXTENSIONS_DIR") or str(REPO / ".cache" / "torch_extensions")
ENV = {"TORCH_EXTENSIONS_DIR": EXT_DIR}

MODEL = ["model.n_layers=3", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
         "model.mlp_width=75", "model.taper.multiple=5", "model.vocab_size=256", "model.seq_len=16"]
TRAIN = ["train.steps=10", "train.global_batch=4", "train.micro_batch=1", "train.lr=3e-3",
         "train.warmup_steps=2", "train.log_interval=1", "train.eval_batches=1", "train.device=cpu",
         "train.precision=fp32", "run.tensorboard=false", "checkpoint.interval=5", "checkpoint.keep=0"]
TOL = 5e-5


def _fit(overrides):
    from megatron_taper.config import load_config
    from megatron_taper.training.trainer import Trainer

    return Trainer(load_config(None, overrides)).fit()


def _args(run_dir, data, *extra):
    return MODEL + TRAIN + [f"run.dir={run_dir}", f"data.path={data}", *extra]


def _run(nproc, run_dir, data, *extra):
    os.makedirs(EXT_DIR, exist_ok=True)
    assert run_distributed(_fit, nproc, _args(run_dir, data, *extra), timeout=300, env=ENV) == [0] * nproc


def _losses(run_dir):
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def _max_diff(got, ref):
    assert sorted(got) == sorted(s for s in ref if s in got) and got, (got, ref)
    return max(abs(got[s] - ref[s]) for s in got)


def one_process_reference(root: Path, data: str) -> dict:
    """The one-process run (zero=none) in this process, into root/ref: its losses by step."""
    assert _fit(_args(root / "ref", data)) == 0
    ref = _losses(root / "ref")
    assert sorted(ref) == list(range(1, 11))
    return ref


@pytest.fixture(scope="module")
def runs(tmp_path_factory, byte_tokens):
    """The one-process reference; then in one 2-process launch the fsdp2 dp=2 run, its step-5
    checkpoint resumed at tp=2, and one bf16 step."""
    root = tmp_path_factory.mktemp("zero")
    ref = one_process_reference(root, byte_tokens)
    step5 = root / "fsdp2_dp2" / "checkpoints" / "step-5"
    os.makedirs(EXT_DIR, exist_ok=True)
    fitted, resumed, bf16 = run_cases(2, [
        (_fit, (_args(root / "fsdp2_dp2", byte_tokens, "parallel.zero=fsdp2"),)),
        (_fit, (_args(root / "resumed_tp2", byte_tokens, "parallel.zero=fsdp2", "parallel.tp=2",
                      f"run.resume={step5}"),)),
        (_bf16_step, (_args(root / "bf16", byte_tokens, "parallel.zero=fsdp2", "train.precision=bf16"),))],
        timeout=300, env=ENV)
    assert fitted == resumed == [0, 0]
    return {"root": root, "data": byte_tokens, "ref": ref, "bf16": bf16}


def check_dp2_matches_one_process(runs, name: str, engine: str) -> None:
    got = _losses(runs["root"] / name)
    diff = _max_diff(got, runs["ref"])
    print(f"dp=2 {engine}: max |loss - one process| over 10 steps = {diff:.1e}")
    assert len(got) == 10 and diff < TOL


@pytest.mark.parametrize("engine", ["fsdp2"])
def test_dp2_matches_one_process(runs, engine):
    check_dp2_matches_one_process(runs, "fsdp2_dp2", engine)


LAYOUTS = {"tp": ["parallel.tp=2"], "pp": ["parallel.pp=2", "parallel.microbatches=2"],
           "tp_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"]}


def check_3d_matches_one_process(runs, run_dir: Path, layout: str, engine: str) -> None:
    """`run_dir`: the 4-process run of LAYOUTS[layout] x dp=2 under `engine`."""
    diff = _max_diff(_losses(run_dir), runs["ref"])
    print(f"{layout}=2 x dp=2 {engine}: max |loss - one process| over 10 steps = {diff:.1e}")
    assert len(_losses(run_dir)) == 10 and diff < TOL


@pytest.fixture(scope="module")
def layouts_3d(runs):
    """The fsdp2 runs of every LAYOUTS entry x dp=2, in one 4-process launch."""
    os.makedirs(EXT_DIR, exist_ok=True)
    folders = {layout: runs["root"] / f"fsdp2_{layout}" for layout in LAYOUTS}
    fitted = run_cases(4, [(_fit, (_args(folders[layout], runs["data"], "parallel.zero=fsdp2", *extra),))
                           for layout, extra in LAYOUTS.items()], timeout=300, env=ENV)
    assert fitted == [[0] * 4] * len(LAYOUTS)
    return folders


@pytest.mark.parametrize("layout,engine", [("tp", "fsdp2"), ("pp", "fsdp2"), ("tp_sp", "fsdp2")])
def test_3d_matches_one_process(runs, layouts_3d, layout, engine):
    check_3d_matches_one_process(runs, layouts_3d[layout], layout, engine)


@pytest.mark.parametrize("nproc,extra", [(1, []), (2, ["parallel.tp=2"])], ids=["dp1", "tp2"])
def test_fsdp2_checkpoint_resumes_on_another_layout(runs, tmp_path, nproc, extra):
    """(the tp=2 resume ran in the module's 2-process launch)"""
    saved = runs["root"] / "fsdp2_dp2"
    run_dir = runs["root"] / "resumed_tp2" if nproc == 2 else tmp_path / "run"
    if nproc == 1:
        _run(1, run_dir, runs["data"], "parallel.zero=fsdp2", f"run.resume={saved / 'checkpoints' / 'step-5'}")
    got = _losses(run_dir)
    assert sorted(got) == list(range(6, 11))
    diff = _max_diff(got, _losses(saved))
    print(f"fsdp2 dp=2 -> {extra or 'dp=1'}: max |loss - uninterrupted| over steps 6-10 = {diff:.1e}")
    assert diff < TOL


@pytest.mark.slow  # over ~20 s alone
def test_fsdp2_sigkill_and_resume_is_bitwise(runs, tmp_path):
    run_dir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "megatron_taper.torchrun", "--nproc-per-node", "2", "--standalone",
           "-m", "megatron_taper.train", *_args(run_dir, runs["data"], "parallel.zero=fsdp2")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **ENV}
    # both ranks park for 60 s before step 8 (fault injection), so the kill lands after step 7 and
    # before step 10's checkpoint however loaded the machine is; the resumed run has no fault
    parked = {**env, "MEGATRON_TAPER_FAULT": "sleep:0:8:60,sleep:1:8:60"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=parked, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.time() + 240
    killed = False
    while time.time() < deadline and proc.poll() is None:
        if (run_dir / "checkpoints" / "step-5").is_dir() and (run_dir / "metrics.jsonl").exists() \
                and 7 in _losses(run_dir):
            tree = kill_tree(proc.pid)  # torchrun and both ranks (each in its own session), mid-step
            killed = True
            break
        time.sleep(0.05)
    proc.wait(30)
    assert killed, f"the run ended before it could be killed:\n{proc.stderr.read()[-3000:]}"
    assert len(tree) >= 3, tree  # torchrun and its two workers at least
    assert not (run_dir / "checkpoints" / "step-10").exists()
    _run(2, run_dir, runs["data"], "parallel.zero=fsdp2")  # the same overrides: auto-resumes from step-5
    got, straight = _losses(run_dir), _losses(runs["root"] / "fsdp2_dp2")
    assert got == straight  # bitwise: every float equal


def _bf16_step(overrides):
    from torch.distributed.tensor import DTensor

    from megatron_taper.config import load_config
    from megatron_taper.training.trainer import Trainer

    trainer = Trainer(load_config(None, overrides))
    block = trainer.pm.module.layers["0"]
    seen = []
    block.mlp.register_forward_pre_hook(lambda m, args: seen.append((m.w1.weight.dtype, args[0].dtype)))
    record = trainer.train_step()
    params = list(trainer.pm.module.parameters())
    return {"compute": seen[0], "masters": {p.dtype for p in params},
            "sharded": all(isinstance(p, DTensor) for p in params),
            "state": {v.dtype for s in trainer.optimizer.state.values() for v in s.values() if v.dim()},
            "loss": float(record["loss"])}


def test_fsdp2_bf16_computes_in_bf16_from_fp32_shards(runs):
    """(the step ran in the module's 2-process launch)"""
    for r in runs["bf16"]:
        # matmul weights gathered in bf16; the norm's output (the MLP's input) stays fp32 (docs/precision.md)
        assert r["compute"] == (torch.bfloat16, torch.float32)
        assert r["masters"] == {torch.float32} and r["sharded"] and r["state"] == {torch.float32}
        assert abs(r["loss"] - runs["ref"][1]) < 2e-2  # the first loss, before any update


def convert_tool():
    """tools/convert_checkpoint.py as a module (its convert() runs in this process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_checkpoint", REPO / "tools" / "convert_checkpoint.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def export_logical(runs, run: str, out: Path) -> dict:
    """The tensors tools/convert_checkpoint.py exports from `run`'s step-10 logical files."""
    from safetensors.torch import load_file

    info = convert_tool().convert(str(runs["root"] / run / "checkpoints" / "step-10"), str(out), source="auto")
    assert info["step"] == 10 and info["source"] == "logical" and (out / "config.yaml").is_file()
    return load_file(str(out / "model.safetensors"))


def test_convert_checkpoint_from_the_logical_files(runs, tmp_path):
    """The one-process run's and the fsdp2 run's logical files export the same tensors (DeepSpeed's
    own files and its logical ones: test_zero_deepspeed.py)."""
    ref, fsdp = (export_logical(runs, run, tmp_path / f"{run}-logical") for run in ("ref", "fsdp2_dp2"))
    assert sorted(ref) == sorted(fsdp) and all(torch.allclose(ref[k], fsdp[k], atol=1e-4) for k in ref)
