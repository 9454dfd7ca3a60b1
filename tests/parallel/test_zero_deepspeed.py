"""ZeRO-3 over dp with parallel.zero = deepspeed: parity, 3D composition, CPU offload,
checkpoints, the non-finite policy; the model, runs and tolerances of test_zero.py (the fsdp2
half, in a file of its own so that the two halves run on different pytest-xdist workers).

Parity: dp=2 and tp=2 x dp=2, and dp=2 with optimizer and parameters offloaded to the CPU, each
within TOL = 5e-5 of one process (zero=none) over 10 steps. A DeepSpeed checkpoint resumes
bitwise at its own dp size from DeepSpeed's files and from the logical files alone (each rank
opening only its own files), and within TOL at dp=1 without DeepSpeed (the logical files); a
corrupted file of one rank stops every rank with the error naming it; tools/convert_checkpoint.py
exports the same tensors from either source; a non-finite loss on one rank skips that step on
every rank; DeepSpeed's shared-memory all-reduce op is not built on the CPU.

C++ ops DeepSpeed JIT-builds (none on these layouts) are cached in TORCH_EXTENSIONS_DIR
(test_zero.py's EXT_DIR).
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.harness import run_distributed
from tests.helpers.runner import REPO
from tests.parallel.test_zero import (
    ENV,
    EXT_DIR,
    TOL,
    _args,
    _fit,
    _losses,
    _max_diff,
    _run,
    check_3d_matches_one_process,
    check_dp2_matches_one_process,
    export_logical,
    zero_runs,
)

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def runs(tmp_path_factory, byte_tokens):
    return zero_runs(tmp_path_factory, byte_tokens, "deepspeed", "ds_dp2")


@pytest.mark.parametrize("engine", ["deepspeed"])
def test_dp2_matches_one_process(runs, engine):
    check_dp2_matches_one_process(runs, "ds_dp2", engine)


@pytest.mark.parametrize("layout,engine", [("tp", "deepspeed")])
def test_3d_matches_one_process(runs, tmp_path, layout, engine):
    check_3d_matches_one_process(runs, tmp_path, layout, engine)


def test_deepspeed_cpu_offload_matches_one_process(runs, tmp_path):
    _run(2, tmp_path / "run", runs["data"], "parallel.zero=deepspeed", "parallel.deepspeed.offload_optimizer=cpu",
         "parallel.deepspeed.offload_param=cpu")
    diff = _max_diff(_losses(tmp_path / "run"), runs["ref"])
    print(f"dp=2 deepspeed, optimizer + parameters offloaded to CPU: max |loss - one process| = {diff:.1e}")
    assert len(_losses(tmp_path / "run")) == 10 and diff < TOL


def _fit_recording_opens(overrides, folder):
    """_fit, returning the files under `folder` this rank opened (relative names)."""
    import builtins

    opened, real_open = set(), builtins.open

    def spy(file, *args, **kwargs):
        path = os.path.abspath(os.fspath(file)) if isinstance(file, (str, os.PathLike)) else ""
        if path.startswith(folder + os.sep):
            opened.add(os.path.relpath(path, folder))
        return real_open(file, *args, **kwargs)

    builtins.open = spy
    try:
        assert _fit(overrides) == 0
    finally:
        builtins.open = real_open
    return sorted(opened)


def _resume_recording_opens(run_dir, data, step_dir, *extra):
    os.makedirs(EXT_DIR, exist_ok=True)
    return run_distributed(_fit_recording_opens, 2, _args(run_dir, data, "parallel.zero=deepspeed",
                                                          f"run.resume={step_dir}", *extra),
                           str(step_dir), timeout=300, env=ENV)


def test_deepspeed_checkpoint_same_size_and_another_size(runs, tmp_path):
    """Resume at the same dp size from DeepSpeed's files and from the logical files alone (bitwise
    both), each rank opening only its own files; at dp=1 without DeepSpeed within TOL."""
    import shutil

    saved = runs["root"] / "ds_dp2"
    step5 = saved / "checkpoints" / "step-5"
    assert (step5 / "deepspeed" / "state").is_dir() and (step5 / "shards").is_dir()
    straight = _losses(saved)
    # same dp size: DeepSpeed's own files, bitwise; rank r opens (and verifies) only its own
    opened = _resume_recording_opens(tmp_path / "same", runs["data"], step5)
    assert _losses(tmp_path / "same") == {s: straight[s] for s in range(6, 11)}
    for rank, files in enumerate(opened):
        native = [f for f in files if f.startswith("deepspeed/")]
        assert native and all(f"zero_pp_rank_{rank}_" in f for f in native), (rank, files)
        assert not any(f.startswith("shards/") for f in files), (rank, files)
    # same dp size from the logical files alone (DeepSpeed's removed): each rank reads its own partitions
    logical = tmp_path / "logical-step-5"
    shutil.copytree(step5, logical, ignore=shutil.ignore_patterns("deepspeed"))
    opened = _resume_recording_opens(tmp_path / "from_logical", runs["data"], logical)
    assert _losses(tmp_path / "from_logical") == {s: straight[s] for s in range(6, 11)}
    for rank, files in enumerate(opened):
        assert [f for f in files if f.startswith("shards/")] == [f"shards/rank-{rank:05d}.safetensors"], (rank, files)
    # another dp size (and no DeepSpeed): the logical files written beside them
    _run(1, tmp_path / "dp1", runs["data"], f"run.resume={step5}")
    diff = _max_diff(_losses(tmp_path / "dp1"), straight)
    print(f"deepspeed dp=2 -> dp=1 (zero=none): max |loss - uninterrupted| over steps 6-10 = {diff:.1e}")
    assert sorted(_losses(tmp_path / "dp1")) == list(range(6, 11)) and diff < TOL


def _fit_error(overrides):
    """The error this rank's run ends with ("" if none)."""
    try:
        _fit(overrides)
    except Exception as e:  # noqa: BLE001 - returned to the test
        return str(e)
    return ""


def test_deepspeed_native_file_failing_on_one_rank_stops_every_rank(runs, tmp_path):
    """Only rank 1 reads (and verifies) its own optimizer-state file; when it is corrupted, rank 0
    must not go on into DeepSpeed's collective load: both ranks end with the error naming it."""
    import shutil

    step5 = tmp_path / "step-5"
    shutil.copytree(runs["root"] / "ds_dp2" / "checkpoints" / "step-5", step5)
    victim = next((step5 / "deepspeed" / "state").glob("*zero_pp_rank_1_*optim_states.pt"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    errors = run_distributed(_fit_error, 2, _args(tmp_path / "run", runs["data"], "parallel.zero=deepspeed",
                                                  f"run.resume={step5}"), timeout=180, env=ENV)
    assert all(victim.name in e and "checksum" in e for e in errors), errors


def test_convert_checkpoint_from_every_kind(runs, tmp_path):
    """The command line once (DeepSpeed's own files, in a fresh process), its logical files through
    the same function in-process: the same tensors, bitwise (fsdp2's: test_zero.py)."""
    from safetensors.torch import load_file

    out = tmp_path / "ds_dp2-deepspeed"
    proc = subprocess.run([sys.executable, "tools/convert_checkpoint.py",
                           str(runs["root"] / "ds_dp2" / "checkpoints" / "step-10"), "--output", str(out),
                           "--source", "deepspeed"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["step"] == 10 and info["source"] == "deepspeed" and (out / "config.yaml").is_file()
    ds_native = load_file(str(out / "model.safetensors"))
    ds_logical = export_logical(runs, "ds_dp2", tmp_path / "ds_dp2-logical")
    assert sorted(ds_logical) == sorted(ds_native)
    assert all(torch.equal(ds_logical[k], ds_native[k]) for k in ds_logical)


class _Payload:
    """Unpickled, this runs a shell command: what a malicious checkpoint file carries."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _poisoned_copy(runs, tmp_path, step: int, marker):
    """A copy of ds_dp2's step-`step` checkpoint whose rank-1 optimizer-state file is a pickle that
    runs code, with meta.json's size and sha256 rewritten to match (an attacker who can write the
    folder can write meta.json too)."""
    import hashlib
    import shutil

    folder = tmp_path / f"step-{step}"
    shutil.copytree(runs["root"] / "ds_dp2" / "checkpoints" / f"step-{step}", folder)
    victim = next((folder / "deepspeed" / "state").glob("*zero_pp_rank_1_*optim_states.pt"))
    torch.save({"optimizer_state_dict": _Payload(marker)}, victim)
    meta = json.loads((folder / "meta.json").read_text())
    name = victim.relative_to(folder).as_posix()
    meta["files"][name] = {"size": victim.stat().st_size, "sha256": hashlib.sha256(victim.read_bytes()).hexdigest()}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder, victim


def test_a_deepspeed_file_that_would_run_code_is_refused_on_resume_and_by_the_converter(runs, tmp_path):
    """issue 41: DeepSpeed's loaders unpickle with weights_only=False. Resuming (both ranks) and
    tools/convert_checkpoint.py --source deepspeed refuse the file, naming it and the global, and
    the payload's marker file is never written."""
    marker = tmp_path / "pwned"
    folder, victim = _poisoned_copy(runs, tmp_path, 5, marker)
    errors = run_distributed(_fit_error, 2, _args(tmp_path / "run", runs["data"], "parallel.zero=deepspeed",
                                                  f"run.resume={folder}"), timeout=180, env=ENV)
    assert all(victim.name in e and "allow-list" in e for e in errors), errors  # both ranks stop
    assert not marker.exists()
    proc = subprocess.run([sys.executable, "tools/convert_checkpoint.py", str(folder), "--output",
                           str(tmp_path / "out"), "--source", "deepspeed"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert proc.returncode != 0 and "allow-list" in proc.stderr and "posix.system" in proc.stderr, proc.stderr[-2000:]
    assert not marker.exists()


def _nonfinite_loss_on_rank1(overrides):
    """3 DeepSpeed steps; in step 2 rank 1's loss is made infinite while its gradients stay finite
    (an infinite constant added): the non-finite policy must skip that step on every rank. Also
    whether DeepSpeed's communication backend came up without its shared-memory op (not built)."""
    import deepspeed.comm.comm
    import torch.distributed as dist

    from megatron_taper.config import load_config
    from megatron_taper.training.trainer import Trainer

    trainer = Trainer(load_config(None, overrides))
    pm, calls = trainer.pm, [0]
    loss_fn = pm.loss_fn

    def poisoned(logits, target):
        calls[0] += 1
        loss = loss_fn(logits, target)
        return loss + float("inf") if dist.get_rank() == 1 and calls[0] == 3 else loss  # step 2, micro-batch 1

    pm.loss_fn = poisoned
    records = [trainer.train_step() for _ in range(3)]
    return {"skipped": trainer.skipped, "engine_skipped": pm.engine.skipped_steps,
            "stepped_losses": [float(r["loss"]) for r in records],
            "shm_comm_op_built": deepspeed.comm.comm.cdb.shm_comm_op is not None}


def test_deepspeed_skips_a_step_whose_loss_is_non_finite(runs, tmp_path):
    out = run_distributed(_nonfinite_loss_on_rank1, 2,
                          _args(tmp_path / "nan", runs["data"], "parallel.zero=deepspeed", "train.steps=3"),
                          timeout=180, env=ENV)
    for r in out:
        assert r["skipped"] == 1 and r["engine_skipped"] == 1, r
        assert r["stepped_losses"][1] == float("inf") and all(map(math.isfinite, r["stepped_losses"][::2]))
        assert not r["shm_comm_op_built"]  # parallel/dp/zero_deepspeed.py skip_shm_comm_build
