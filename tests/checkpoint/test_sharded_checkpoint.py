"""Sharded checkpoints: every rank writes and reads only its own pieces, and a checkpoint moves
between layouts and engines.

- A tp=2 x pp=2 checkpoint (4 processes) resumes at fsdp2 dp=2 and at one process with the
  losses of the uninterrupted one-process run within TOL = 5e-5 (layouts differ only in fp32
  reduction order, ~1e-6 per step; model, AdamW state, schedule and data position carry over).
- On resume at the layout it was written in, a rank reads exactly the bytes of its own
  parameters and AdamW state (every record it reads is its own); one process reading a 2-rank
  checkpoint reads all of it.
- A run SIGKILLed while a background save (checkpoint.async_save) is pending leaves the
  previous checkpoint as the newest; resuming from it ends bitwise equal to the uninterrupted run.

Launches: the tp=2 x pp=2 run is one 4-process launch; every 2-process run and probe one 2-process
launch (tests/helpers/sessions.py), once per module; one-process runs and probes run in this
process; the SIGKILLed run is a real process of its own.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.harness import run_distributed
from tests.helpers.runner import REPO, train_in_process
from tests.helpers.sessions import run_cases

pytestmark = pytest.mark.multiprocess

MODEL = ["model.n_layers=3", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
         "model.mlp_width=75", "model.taper.multiple=5", "model.vocab_size=256", "model.seq_len=16"]
TRAIN = ["train.steps=6", "train.global_batch=4", "train.micro_batch=2", "train.lr=3e-3",
         "train.warmup_steps=2", "train.log_interval=1", "train.eval_batches=1", "train.device=cpu",
         "train.precision=fp32", "run.tensorboard=false", "checkpoint.keep=0"]
TOL = 5e-5


def _fit(overrides):
    from megatron_taper.config import load_config
    from megatron_taper.training.trainer import Trainer

    return Trainer(load_config(None, overrides)).fit()


def _args(run_dir, data, *extra):
    return MODEL + TRAIN + [f"run.dir={run_dir}", f"data.path={data}", *extra]


def _run(nproc, run_dir, data, *extra):
    assert run_distributed(_fit, nproc, _args(run_dir, data, *extra), timeout=240) == [0] * nproc


def _losses(run_dir):
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def _bytes_read(overrides):
    from megatron_taper.config import load_config
    from megatron_taper.parallel.model import local_part
    from megatron_taper.training.trainer import Trainer

    trainer = Trainer(load_config(None, overrides))
    own = 0
    for param in trainer.pm.module.parameters():
        own += local_part(param.data).nbytes
        own += sum(local_part(v).nbytes for v in trainer.optimizer.state[param].values())
    return trainer.checkpointer.bytes_read, own


def _resumed_step_with_a_lagging_listing(overrides):
    """Build a Trainer (it resumes on construction) while rank 1's listing of checkpoints/ misses
    the newest folder, as a shared filesystem's listing can right after a restart: the step it
    resumed."""
    from megatron_taper.checkpoint import folders
    from megatron_taper.config import load_config
    from megatron_taper.training.trainer import Trainer

    listing = folders.list_checkpoints
    if os.environ["RANK"] == "1":
        folders.list_checkpoints = lambda root: listing(root)[:-1]
    try:
        return Trainer(load_config(None, overrides)).step
    finally:
        folders.list_checkpoints = listing


SHARDED = {"tp2": ["parallel.tp=2"], "fsdp2": ["parallel.zero=fsdp2"]}  # the 2-rank layouts each rank reads from


@pytest.fixture(scope="module")
def launched(tmp_path_factory, byte_tokens):
    """The tp=2 x pp=2 run stopped after step 3 (4 processes); then in one 2-process launch: its
    step-3 checkpoint resumed at fsdp2 dp=2; per SHARDED layout a run stopped after step 2 and the
    bytes each rank reads resuming it; an fsdp2 run checkpointing every 2 steps and the step its
    ranks resume while rank 1's listing lags."""
    root, data = tmp_path_factory.mktemp("sharded"), byte_tokens
    _run(4, root / "tp2pp2", data, "parallel.tp=2", "parallel.pp=2", "train.exit_after=3")
    step3 = root / "tp2pp2" / "checkpoints" / "step-3"
    cases = [(_fit, (_args(root / "resumed_2", data, f"run.resume={step3}", "parallel.zero=fsdp2"),))]
    for name, layout in SHARDED.items():
        step2 = root / name / "checkpoints" / "step-2"
        cases += [(_fit, (_args(root / name, data, *layout, "train.exit_after=2"),)),
                  (_bytes_read, (_args(root / f"probe_{name}", data, f"run.resume={step2}", *layout),))]
    lagging = _args(root / "lagging", data, "parallel.zero=fsdp2", "checkpoint.interval=2")
    cases += [(_fit, (lagging,)), (_resumed_step_with_a_lagging_listing, (lagging + ["train.steps=8"],))]
    out = run_cases(2, cases, timeout=300)
    assert out[0] == out[1] == out[3] == out[5] == [0, 0]
    return {"root": root, "bytes_read": {"tp2": out[2], "fsdp2": out[4]}, "lagging_resumed": out[6]}


def test_tp2_pp2_checkpoint_resumes_at_fsdp2_and_one_process(launched, tmp_path, byte_tokens):
    """(the reference and the one-process resume run in this process)"""
    assert _fit(_args(tmp_path / "ref", byte_tokens)) == 0
    ref = _losses(tmp_path / "ref")
    step3 = launched["root"] / "tp2pp2" / "checkpoints" / "step-3"
    meta = json.loads((step3 / "meta.json").read_text())
    assert meta["format"] == 2 and len({r["file"] for e in meta["tensors"].values() for r in e["records"]}) == 4
    assert not [n for n in os.listdir(step3) if n.endswith(".pt") and n != "trainer.pt"]  # nothing gathered
    assert _fit(_args(tmp_path / "resumed_1", byte_tokens, f"run.resume={step3}")) == 0
    for run_dir, extra in ((launched["root"] / "resumed_2", ["parallel.zero=fsdp2"]), (tmp_path / "resumed_1", [])):
        got = _losses(run_dir)
        assert sorted(got) == [4, 5, 6]
        diff = max(abs(got[s] - ref[s]) for s in got)
        print(f"tp=2 x pp=2 -> {extra or 'one process'}: max |loss - uninterrupted| over steps 4-6 = {diff:.1e}")
        assert diff < TOL, (extra, got, ref)


def test_each_rank_reads_its_shard(launched, tmp_path, byte_tokens):
    """(one process reads in this process)"""
    for name, layout in SHARDED.items():
        step2 = launched["root"] / name / "checkpoints" / "step-2"
        total = sum(f.stat().st_size for f in (step2 / "shards").iterdir())
        for read, own in launched["bytes_read"][name]:
            print(f"{layout[0]}: read {read} bytes, own shard {own} bytes, checkpoint {total} bytes")
            assert read == own and read < 0.7 * total  # replicated norms are read by both ranks
        read, own = _bytes_read(_args(tmp_path / f"probe_{name}", byte_tokens, f"run.resume={step2}"))
        assert read == own and total * 0.95 < read <= total  # safetensors headers are the rest


def test_sigkill_during_async_save_keeps_the_previous_checkpoint(tmp_path, byte_tokens):
    args = ["-m", "megatron_taper.train", *MODEL, *TRAIN, "train.steps=8", f"data.path={byte_tokens}",
            "checkpoint.interval=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    straight = tmp_path / "straight"
    train_in_process([*args[2:], f"run.dir={straight}"])
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, *args, f"run.dir={run_dir}", "checkpoint.async_save=true"], cwd=REPO,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    ckpts, killed, deadline = run_dir / "checkpoints", False, time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if (ckpts / "step-2").is_dir() and (ckpts / ".tmp-step-4").is_dir():  # step 4's save is pending
            os.killpg(proc.pid, signal.SIGKILL)
            killed = True
            break
        time.sleep(0.002)
    proc.wait(30)
    assert killed, f"the run ended before it could be killed:\n{proc.stderr.read()[-3000:]}"
    assert sorted(os.listdir(ckpts)) == [".tmp-step-4", "step-2"]
    train_in_process([*args[2:], f"run.dir={run_dir}", "checkpoint.async_save=true"])  # resumes from step-2
    assert _losses(run_dir) == _losses(straight)  # bitwise, every step
    assert sorted(os.listdir(ckpts)) == ["step-2", "step-4", "step-6", "step-8"]


def test_every_rank_resumes_the_step_rank_0_lists(launched):
    """issue 41: ranks chose their resume checkpoint each from its own listing, so a lagging one
    resumed an older step and its fsdp2 shards trained against the others' newer ones. Now every
    rank follows rank 0's candidates (rank 0 warns, naming the ranks that listed otherwise)."""
    assert sorted(os.listdir(launched["root"] / "lagging" / "checkpoints"))[-1] == "step-6"
    assert launched["lagging_resumed"] == [6, 6]


def test_resuming_an_earlier_step_sets_the_abandoned_branch_aside(tmp_path, byte_tokens):
    """issue 41: resuming step-4 explicitly with step-6 and step-7 present, keep=1 pruned by step
    number: it deleted the new step-5 and the source and kept step-7, which a later auto-resume
    continued. Now the first save renames the later ones abandoned-step-N (with a warning), prunes
    this branch only, and an auto-resume continues it."""
    run = tmp_path / "run"
    base = MODEL + TRAIN + [f"run.dir={run}", f"data.path={byte_tokens}", "checkpoint.interval=1"]
    train_in_process(base + ["train.steps=7"])
    root = run / "checkpoints"
    branch = train_in_process(base + ["train.steps=5", f"run.resume={root / 'step-4'}", "checkpoint.keep=1"])
    assert "abandoned-step-6, abandoned-step-7" in branch.stderr
    assert sorted(os.listdir(root)) == ["abandoned-step-6", "abandoned-step-7", "step-5"]
    resumed = train_in_process(base + ["train.steps=6", "checkpoint.keep=1"])
    assert "resumed from:" in resumed.stdout and "step-5 at step 5" in resumed.stdout


def test_metadata_naming_files_outside_the_folder_or_no_trainer_state_is_a_checkpoint_error(tmp_path, byte_tokens):
    """issue 41: a meta.json without trainer.pt was a KeyError (exit 1) instead of a checkpoint an
    auto-resume skips for the previous one; a meta.json could name files outside its folder. Both
    are now CheckpointErrors naming meta.json: the resume falls back to step-2 with a warning, and
    a name climbing out of the folder is refused before anything is read."""
    from megatron_taper.checkpoint.checkpointer import verify_checkpoint
    from megatron_taper.checkpoint.files import CheckpointError

    run = tmp_path / "run"
    base = MODEL + TRAIN + [f"run.dir={run}", f"data.path={byte_tokens}", "checkpoint.interval=2"]
    train_in_process(base + ["train.steps=4"])
    step4 = run / "checkpoints" / "step-4"
    meta = json.loads((step4 / "meta.json").read_text())
    del meta["files"]["trainer.pt"]
    (step4 / "meta.json").write_text(json.dumps(meta))
    resumed = train_in_process(base + ["train.steps=5"])
    assert "lists no trainer.pt" in resumed.stderr and "step-2 at step 2" in resumed.stdout
    step2 = run / "checkpoints" / "step-2"
    meta = json.loads((step2 / "meta.json").read_text())
    meta["files"]["../../outside.bin"] = {"size": 1, "sha256": "0"}
    (step2 / "meta.json").write_text(json.dumps(meta))
    outside = r"meta\.json: names the file '\.\./\.\./outside\.bin', which is not inside"
    with pytest.raises(CheckpointError, match=outside):
        verify_checkpoint(str(step2))
