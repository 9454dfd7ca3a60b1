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

Launches: the one-process reference and the dp=1 resume run in this process; the dp=2 run, the
offloaded run, both resumes at dp=2, the non-finite step and the two refused resumes share one
2-process launch (tests/helpers/sessions.py: each rank imports DeepSpeed once), in that order (the
refusals last); the 3D layout is one 4-process launch; the converter's command line runs once in a
fresh process, its refusal through the same main() in this process.

C++ ops DeepSpeed JIT-builds (none on these layouts) are cached in TORCH_EXTENSIONS_DIR
(test_zero.py's EXT_DIR).
"""
import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
from unittest import mock

import pytest
import torch

from tests.helpers.runner import REPO
from tests.helpers.sessions import run_cases
from tests.parallel.test_zero import (
    ENV,
    EXT_DIR,
    LAYOUTS,
    TOL,
    _args,
    _fit,
    _losses,
    _max_diff,
    _run,
    check_3d_matches_one_process,
    check_dp2_matches_one_process,
    convert_tool,
    export_logical,
    one_process_reference,
)

pytestmark = pytest.mark.multiprocess

DEEPSPEED = "parallel.zero=deepspeed"


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


def _fit_error(overrides):
    """The error this rank's run ends with ("" if none)."""
    try:
        _fit(overrides)
    except Exception as e:  # noqa: BLE001 - returned to the test
        return str(e)
    return ""


def _on_rank0(fn, *args):
    """fn(*args) on rank 0 alone (preparing files for the next case); every rank returns its result."""
    import torch.distributed as dist

    out = [fn(*args) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(out, src=0)
    return out[0]


def _copy_without_deepspeed(step_dir, target):
    shutil.copytree(step_dir, target, ignore=shutil.ignore_patterns("deepspeed"))


def _corrupted_copy(step_dir, target):
    """A copy of `step_dir` whose rank-1 optimizer-state file has one byte flipped; that file's name."""
    shutil.copytree(step_dir, target)
    victim = next((target / "deepspeed" / "state").glob("*zero_pp_rank_1_*optim_states.pt"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    return victim.name


class _Payload:
    """Unpickled, this runs a shell command: what a malicious checkpoint file carries."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _poisoned_copy(step_dir, target, marker):
    """A copy of `step_dir` whose rank-1 optimizer-state file is a pickle that runs code, with
    meta.json's size and sha256 rewritten to match (an attacker who can write the folder can write
    meta.json too); that file's name."""
    import hashlib

    shutil.copytree(step_dir, target)
    victim = next((target / "deepspeed" / "state").glob("*zero_pp_rank_1_*optim_states.pt"))
    torch.save({"optimizer_state_dict": _Payload(marker)}, victim)
    meta = json.loads((target / "meta.json").read_text())
    name = victim.relative_to(target).as_posix()
    meta["files"][name] = {"size": victim.stat().st_size, "sha256": hashlib.sha256(victim.read_bytes()).hexdigest()}
    (target / "meta.json").write_text(json.dumps(meta))
    return victim.name


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


@pytest.fixture(scope="module")
def runs(tmp_path_factory, byte_tokens):
    """The one-process reference (in this process), then every 2-process DeepSpeed case in one launch."""
    root, data = tmp_path_factory.mktemp("zero"), byte_tokens
    ref = one_process_reference(root, data)
    step5 = root / "ds_dp2" / "checkpoints" / "step-5"
    logical, corrupted, poisoned = root / "logical-step-5", root / "corrupted" / "step-5", root / "poisoned" / "step-5"
    marker = root / "pwned"
    os.makedirs(EXT_DIR, exist_ok=True)
    out = run_cases(2, [
        (_fit, (_args(root / "ds_dp2", data, DEEPSPEED),)),
        (_fit, (_args(root / "offload", data, DEEPSPEED, "parallel.deepspeed.offload_optimizer=cpu",
                      "parallel.deepspeed.offload_param=cpu"),)),
        (_fit_recording_opens, (_args(root / "same", data, DEEPSPEED, f"run.resume={step5}"), str(step5))),
        (_on_rank0, (_copy_without_deepspeed, step5, logical)),
        (_fit_recording_opens, (_args(root / "from_logical", data, DEEPSPEED, f"run.resume={logical}"), str(logical))),
        (_nonfinite_loss_on_rank1, (_args(root / "nan", data, DEEPSPEED, "train.steps=3"),)),
        (_on_rank0, (_corrupted_copy, step5, corrupted)),
        (_fit_error, (_args(root / "corrupted_run", data, DEEPSPEED, f"run.resume={corrupted}"),)),
        (_on_rank0, (_poisoned_copy, step5, poisoned, marker)),
        (_fit_error, (_args(root / "poisoned_run", data, DEEPSPEED, f"run.resume={poisoned}"),))],
        timeout=400, env=ENV)
    names = ("ds_dp2", "offload", "opened_same", None, "opened_logical", "nonfinite", "corrupted_file",
             "corrupted_errors", "poisoned_file", "poisoned_errors")
    found = {name: result for name, result in zip(names, out) if name}
    assert found["ds_dp2"] == found["offload"] == [0, 0]
    return {**found, "root": root, "data": data, "ref": ref, "logical": logical, "poisoned": poisoned,
            "marker": marker, "corrupted_file": found["corrupted_file"][0], "poisoned_file": found["poisoned_file"][0]}


@pytest.mark.parametrize("engine", ["deepspeed"])
def test_dp2_matches_one_process(runs, engine):
    check_dp2_matches_one_process(runs, "ds_dp2", engine)


@pytest.mark.parametrize("layout,engine", [("tp", "deepspeed")])
def test_3d_matches_one_process(runs, tmp_path, layout, engine):
    _run(4, tmp_path / "run", runs["data"], DEEPSPEED, *LAYOUTS[layout])
    check_3d_matches_one_process(runs, tmp_path / "run", layout, engine)


def test_deepspeed_cpu_offload_matches_one_process(runs):
    diff = _max_diff(_losses(runs["root"] / "offload"), runs["ref"])
    print(f"dp=2 deepspeed, optimizer + parameters offloaded to CPU: max |loss - one process| = {diff:.1e}")
    assert len(_losses(runs["root"] / "offload")) == 10 and diff < TOL


def test_deepspeed_checkpoint_same_size_and_another_size(runs, tmp_path):
    """Resume at the same dp size from DeepSpeed's files and from the logical files alone (bitwise
    both), each rank opening only its own files; at dp=1 without DeepSpeed within TOL."""
    saved = runs["root"] / "ds_dp2"
    step5 = saved / "checkpoints" / "step-5"
    assert (step5 / "deepspeed" / "state").is_dir() and (step5 / "shards").is_dir()
    straight = _losses(saved)
    # same dp size: DeepSpeed's own files, bitwise; rank r opens (and verifies) only its own
    assert _losses(runs["root"] / "same") == {s: straight[s] for s in range(6, 11)}
    for rank, files in enumerate(runs["opened_same"]):
        native = [f for f in files if f.startswith("deepspeed/")]
        assert native and all(f"zero_pp_rank_{rank}_" in f for f in native), (rank, files)
        assert not any(f.startswith("shards/") for f in files), (rank, files)
    # same dp size from the logical files alone (DeepSpeed's removed): each rank reads its own partitions
    assert not (runs["logical"] / "deepspeed").exists()
    assert _losses(runs["root"] / "from_logical") == {s: straight[s] for s in range(6, 11)}
    for rank, files in enumerate(runs["opened_logical"]):
        assert [f for f in files if f.startswith("shards/")] == [f"shards/rank-{rank:05d}.safetensors"], (rank, files)
    # another dp size (and no DeepSpeed; in this process): the logical files written beside them
    assert _fit(_args(tmp_path / "dp1", runs["data"], f"run.resume={step5}")) == 0
    diff = _max_diff(_losses(tmp_path / "dp1"), straight)
    print(f"deepspeed dp=2 -> dp=1 (zero=none): max |loss - uninterrupted| over steps 6-10 = {diff:.1e}")
    assert sorted(_losses(tmp_path / "dp1")) == list(range(6, 11)) and diff < TOL


def test_deepspeed_native_file_failing_on_one_rank_stops_every_rank(runs):
    """Only rank 1 reads (and verifies) its own optimizer-state file; when it is corrupted, rank 0
    must not go on into DeepSpeed's collective load: both ranks end with the error naming it."""
    victim = runs["corrupted_file"]
    assert all(victim in e and "checksum" in e for e in runs["corrupted_errors"]), runs["corrupted_errors"]


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


def test_a_deepspeed_file_that_would_run_code_is_refused_on_resume_and_by_the_converter(runs, tmp_path):
    """issue 41: DeepSpeed's loaders unpickle with weights_only=False. Resuming (both ranks) and
    tools/convert_checkpoint.py --source deepspeed (its main(), in this process: the command line
    ran in a fresh process above) refuse the file, naming it and the global, and the payload's
    marker file is never written."""
    marker, victim = runs["marker"], runs["poisoned_file"]
    errors = runs["poisoned_errors"]
    assert all(victim in e and "allow-list" in e for e in errors), errors  # both ranks stop
    assert not marker.exists()
    stderr = io.StringIO()
    with mock.patch.dict(os.environ), contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = convert_tool().main([str(runs["poisoned"]), "--output", str(tmp_path / "out"), "--source", "deepspeed"])
    assert code != 0 and "allow-list" in stderr.getvalue() and "posix.system" in stderr.getvalue(), stderr.getvalue()
    assert not marker.exists()


def test_deepspeed_skips_a_step_whose_loss_is_non_finite(runs):
    for r in runs["nonfinite"]:
        assert r["skipped"] == 1 and r["engine_skipped"] == 1, r
        assert r["stepped_losses"][1] == float("inf") and all(map(math.isfinite, r["stepped_losses"][::2]))
        assert not r["shm_comm_op_built"]  # parallel/dp/zero_deepspeed.py skip_shm_comm_build
