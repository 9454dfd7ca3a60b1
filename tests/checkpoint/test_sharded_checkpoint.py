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


def _run(nproc, run_dir, data, *extra):
    args = MODEL + TRAIN + [f"run.dir={run_dir}", f"data.path={data}", *extra]
    assert run_distributed(_fit, nproc, args, timeout=240) == [0] * nproc


def _losses(run_dir):
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def test_tp2_pp2_checkpoint_resumes_at_fsdp2_and_one_process(tmp_path, byte_tokens):
    _run(1, tmp_path / "ref", byte_tokens)
    ref = _losses(tmp_path / "ref")
    saved = tmp_path / "tp2pp2"
    _run(4, saved, byte_tokens, "parallel.tp=2", "parallel.pp=2", "train.exit_after=3")
    step3 = saved / "checkpoints" / "step-3"
    meta = json.loads((step3 / "meta.json").read_text())
    assert meta["format"] == 2 and len({r["file"] for e in meta["tensors"].values() for r in e["records"]}) == 4
    assert not [n for n in os.listdir(step3) if n.endswith(".pt") and n != "trainer.pt"]  # nothing gathered
    for nproc, extra in ((2, ["parallel.zero=fsdp2"]), (1, [])):
        run_dir = tmp_path / f"resumed_{nproc}"
        _run(nproc, run_dir, byte_tokens, f"run.resume={step3}", *extra)
        got = _losses(run_dir)
        assert sorted(got) == [4, 5, 6]
        diff = max(abs(got[s] - ref[s]) for s in got)
        print(f"tp=2 x pp=2 -> {extra or 'one process'}: max |loss - uninterrupted| over steps 4-6 = {diff:.1e}")
        assert diff < TOL, (extra, got, ref)


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


def test_each_rank_reads_its_shard(tmp_path, byte_tokens):
    for nproc, layout in ((2, ["parallel.tp=2"]), (2, ["parallel.zero=fsdp2"])):
        run_dir = tmp_path / layout[0].replace("=", "")
        _run(nproc, run_dir, byte_tokens, *layout, "train.exit_after=2")
        step2 = run_dir / "checkpoints" / "step-2"
        total = sum(f.stat().st_size for f in (step2 / "shards").iterdir())
        args = MODEL + TRAIN + [f"run.dir={tmp_path / 'probe'}", f"data.path={byte_tokens}", f"run.resume={step2}"]
        for read, own in run_distributed(_bytes_read, nproc, args + layout, timeout=120):
            print(f"{layout[0]}: read {read} bytes, own shard {own} bytes, checkpoint {total} bytes")
            assert read == own and read < 0.7 * total  # replicated norms are read by both ranks
        (read, own), = run_distributed(_bytes_read, 1, args, timeout=120)
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
    return Trainer(load_config(None, overrides)).step


def test_every_rank_resumes_the_step_rank_0_lists(tmp_path, byte_tokens):
    """issue 41: ranks chose their resume checkpoint each from its own listing, so a lagging one
    resumed an older step and its fsdp2 shards trained against the others' newer ones. Now every
    rank follows rank 0's candidates (rank 0 warns, naming the ranks that listed otherwise)."""
    run = tmp_path / "run"
    _run(2, run, byte_tokens, "parallel.zero=fsdp2", "checkpoint.interval=2")
    assert sorted(os.listdir(run / "checkpoints"))[-1] == "step-6"
    args = MODEL + TRAIN + [f"run.dir={run}", f"data.path={byte_tokens}", "parallel.zero=fsdp2", "train.steps=8"]
    assert run_distributed(_resumed_step_with_a_lagging_listing, 2, args, timeout=240) == [6, 6]


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
