"""Faults survived (README "Surviving faults"), injected with MEGATRON_TAPER_FAULT.

- A malformed MEGATRON_TAPER_FAULT or fault section is one error line (exit 2), nothing written.
- Under launch/torchrun.sh (2 gloo workers, in-job restarts): rank 1 SIGSTOPped at step 3 is
  detected by rank 0's watchdog (fault.step_timeout_s), which writes its stacks, names rank 1 and
  exits 4; torchrun restarts the workers, which resume from the last checkpoint; rank 0 SIGKILLed
  at step 7 is restarted the same way; rank 1's loss at step 9 is NaN: both ranks agree to roll
  back to step-8 and skip batch 9 (fault.rollback_after=1); the run ends with losses, grad norms
  and every checkpoint record (weights and AdamW state, by sha256) bitwise equal to the run that
  skipped batch 9 from the start without faults. Rank 1 also sleeps 0.2 s before every step: the
  metrics name it as the slowest to be ready, and a warning names it as a straggler.
- A NaN loss at step 7, and a loss spike at step 7, with fault.rollback_after=1: the run reloads
  step-6, skips the data of step 7 (RUN/data_skips.json) and ends bitwise equal to a run that
  skipped the same batch from the start (the same file in its fresh run folder).
- Retention: with checkpoint.keep=1 and keep_every=4, NaNs at steps 3-5 and rollback_after=3,
  the save of step 4 (inside the bad streak) is not written, so step-2, the rollback target,
  survives pruning; the run ends with step-4, step-8 (multiples of 4) and step-10 (the newest).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_taper.fault.inject import parse_faults
from megatron_taper.fault.rollback import DataSkips
from megatron_taper.validation import ConfigError
from tests.helpers.runner import REPO, read_metrics, train_in_process

STEPS = 10
TINY = ["--config", "configs/tiny_taper.yaml", "model.n_layers=2", "model.d_model=64", "model.n_heads=4",
        "model.mlp_width=128", "model.vocab_size=256", "model.seq_len=32", "model.taper.multiple=16",
        "train.global_batch=8", "train.micro_batch=4", f"train.steps={STEPS}", "train.log_interval=1",
        "train.eval_interval=0", "train.device=cpu", "checkpoint.interval=2", "checkpoint.keep=0",
        "run.tensorboard=false"]
STEP_TIMEOUT = 5  # s: the steps take ~0.05 s; room for a loaded machine
COLLECTIVE_TIMEOUT = 600  # s: init_parallel's process-group timeout, what a hang waited for before


def test_malformed_fault_settings_are_one_error(byte_tokens, tmp_path, monkeypatch):
    assert parse_faults("") == []
    assert [(p.kind, p.rank, p.step, p.arg) for p in parse_faults("sleep:1:3:0.2,nan:0:5")] == [
        ("sleep", 1, 3, 0.2), ("nan", 0, 5, 0.0)]
    for bad in ("kil:0:3", "kill:0", "kill:-1:3", "kill:0:0", "sleep:0:3:x", "spike:0:2:0"):
        with pytest.raises(ConfigError, match="MEGATRON_TAPER_FAULT="):
            parse_faults(bad)
    run = tmp_path / "run"
    monkeypatch.setenv("MEGATRON_TAPER_FAULT", "kill:zero:3")
    proc = train_in_process([*TINY, f"data.path={byte_tokens}", f"run.dir={run}"], check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: MEGATRON_TAPER_FAULT='kill:zero:3': 'kill:zero:3' must be KIND:RANK:STEP[:ARG] with KIND one of "
        "kill, stop, term, raise, bad_input, nan, spike, sleep, write_fail, RANK >= 0, STEP >= 1 and ARG a number > 0 "
        "(spike: loss factor, sleep: seconds)"]
    assert not run.exists()
    monkeypatch.delenv("MEGATRON_TAPER_FAULT")
    proc = train_in_process([*TINY, f"data.path={byte_tokens}", f"run.dir={run}", "fault.step_timeout_s=-1"],
                            check=False)
    assert proc.returncode == 2 and "fault.step_timeout_s=-1.0 is outside the allowed range" in proc.stderr
    assert not run.exists()


def _start_torchrun_sh(args: list[str], fault: str = "") -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VENV": sys.prefix, "MEGATRON_TAPER_FAULT": fault,
           "TAPER_PREFLIGHT_DONE": "1",  # tests/launch/test_launchers.py covers torchrun.sh's checks
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    return subprocess.Popen(["bash", "launch/torchrun.sh", "2", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _torchrun_sh(args: list[str], fault: str = "") -> subprocess.CompletedProcess:
    return _finish(_start_torchrun_sh(args, fault))


def _records(run_dir) -> dict:
    """What must be bitwise equal: per step loss and grad norm; per checkpoint every record's sha256."""
    metrics = [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(run_dir) if "loss" in r]
    shas = {}
    for name in sorted(os.listdir(run_dir / "checkpoints")):
        meta = json.loads((run_dir / "checkpoints" / name / "meta.json").read_text())
        shas[name] = {k: [rec["sha256"] for rec in e["records"]] for k, e in meta["tensors"].items()}
    return {"metrics": metrics, "checkpoints": shas}


@pytest.mark.multiprocess
@pytest.mark.slow  # over ~20 s alone: 2 x 2 workers, 3 attempts and a step timeout
def test_hang_dead_worker_nan_and_slow_rank_under_torchrun_bitwise(byte_tokens, tmp_path):
    args = [*TINY, f"data.path={byte_tokens}", f"fault.step_timeout_s={STEP_TIMEOUT}", "fault.rollback_after=1"]
    faulty, straight = tmp_path / "faulty", tmp_path / "straight"
    straight.mkdir()
    (straight / "data_skips.json").write_text('{"windows": [[9, 9]]}')
    # the reference runs meanwhile: the faulty run spends most of its time waiting (step timeout, restarts)
    reference = _start_torchrun_sh([*args, f"run.dir={straight}"])
    proc = _torchrun_sh([*args, f"run.dir={faulty}"], fault="stop:1:3,kill:0:7,sleep:1:1:0.2,nan:1:9")
    straight_proc = _finish(reference)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    hang = [line for line in out.splitlines() if line.startswith("hang: rank 0:")]
    assert len(hang) == 1 and "stopped first: rank 1 (heartbeat not written" in hang[0], out[-4000:]
    assert "straggler: rank 1 needs " in out, out[-4000:]
    assert (f"rollback: 1 bad step(s) from step 9 (non-finite; fault.rollback_after=1): reloaded "
            f"{faulty / 'checkpoints' / 'step-8'} at step 8; data batches 9-9 are skipped") in out, out[-4000:]
    assert {r["ready_s_max_rank"] for r in read_metrics(faulty) if "loss" in r} == {1}
    stacks = (faulty / "logs" / "stacks-rank0.txt").read_text()
    assert "in section step of step 3" in stacks and "megatron_taper/training/trainer.py" in stacks
    assert "gloo:all_reduce #" in stacks.split("The last collectives this rank issued")[1]
    events = [json.loads(line) for line in (faulty / "logs" / "faults.jsonl").read_text().splitlines()]
    fired = {e["kind"]: e for e in events if e["event"] == "fired"}
    restarts = {e["restart"]: e for e in events if e["event"] == "first_step"}
    assert sorted(fired) == ["kill", "nan", "stop"] and sorted(restarts) == ["0", "1", "2"]
    assert restarts["1"]["step"] == 3 and restarts["2"]["step"] == 7  # resumed from step-2 and step-6
    # the hang cost the step timeout and a restart, far below the collective timeout it waited for before
    recovery = restarts["1"]["time"] - fired["stop"]["time"]
    assert STEP_TIMEOUT < recovery < COLLECTIVE_TIMEOUT / 5, recovery

    assert straight_proc.returncode == 0, straight_proc.stderr[-4000:]
    want = _records(straight)
    assert [m[0] for m in want["metrics"]] == list(range(1, STEPS + 1))
    assert _records(faulty) == want


def test_bad_input_on_one_rank_ends_every_rank_at_once(byte_tokens, tmp_path):
    """A rank that ends on bad input alone (exit 2, which launch/torchrun.sh reports to torchrun as
    success so that it does not restart) used to leave the others waiting for it in a collective
    until fault.step_timeout_s (or, at startup, fault.startup_timeout_s: 15 minutes); now its
    watchdog record (RUN/logs/ended.json) ends them with 2 at their next poll, rank 0 naming it."""
    run = tmp_path / "run"
    # timeouts far beyond the test's wait: only the record can end rank 0 in time
    proc = _torchrun_sh([*TINY, f"data.path={byte_tokens}", f"run.dir={run}", "fault.step_timeout_s=600"],
                        fault="bad_input:1:3")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-4000:]
    assert ("error: rank 1: MEGATRON_TAPER_FAULT: injected bad input on rank 1 before step 3 (every rank exits "
            "with 2; this rank was ") in out, out[-4000:]
    ended = json.loads((run / "logs" / "ended.json").read_text())
    assert (ended["rank"], ended["code"]) == (1, 2)
    log = (run / "logs" / "rank-1.log").read_text()
    assert "ConfigError: MEGATRON_TAPER_FAULT: injected bad input on rank 1" in log


def test_nan_and_spike_roll_back_and_skip_their_data_bitwise(byte_tokens, tmp_path, monkeypatch):
    args = [*TINY, f"data.path={byte_tokens}"]
    reference = tmp_path / "skipped_from_the_start"
    reference.mkdir()
    (reference / "data_skips.json").write_text('{"windows": [[7, 7]]}')
    train_in_process([*args, f"run.dir={reference}"])
    want = _records(reference)
    assert [m[0] for m in want["metrics"]] == list(range(1, STEPS + 1))
    for fault, options in (("nan:0:7", []), ("spike:0:7:20", ["fault.spike_factor=3", "fault.spike_rollback=true"])):
        run = tmp_path / fault.split(":")[0]
        monkeypatch.setenv("MEGATRON_TAPER_FAULT", fault)
        proc = train_in_process([*args, f"run.dir={run}", "fault.rollback_after=1", *options])
        assert (f"rollback: 1 bad step(s) from step 7 (non-finite{' or spike' if options else ''}; "
                f"fault.rollback_after=1): reloaded {run / 'checkpoints' / 'step-6'} at step 6; data batches 7-7 "
                f"are skipped") in proc.stdout, proc.stdout[-3000:]
        if options:
            assert "loss spike at step 7: " in proc.stdout
        assert json.loads((run / "data_skips.json").read_text()) == {"windows": [[7, 7]], "global_batch": 8}
        assert _records(run) == want, fault


def test_pruning_keeps_the_rollback_target_and_every_kth(byte_tokens, tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("MEGATRON_TAPER_FAULT", "nan:0:3,nan:0:4,nan:0:5")
    proc = train_in_process([*TINY, f"data.path={byte_tokens}", f"run.dir={run}", "fault.rollback_after=3",
                             "checkpoint.keep=1", "checkpoint.keep_every=4"])
    assert "checkpoint of step 4 not written: the steps before it were bad" in proc.stdout
    assert (f"rollback: 3 bad step(s) from step 3 (non-finite; fault.rollback_after=3): reloaded "
            f"{run / 'checkpoints' / 'step-2'} at step 2; data batches 3-5 are skipped") in proc.stdout
    assert sorted(os.listdir(run / "checkpoints"), key=lambda n: int(n.split("-")[1])) == [
        "step-4", "step-8", "step-10"]
    assert [m[0] for m in _records(run)["metrics"]] == list(range(1, STEPS + 1))


def test_skipped_windows_are_refused_at_another_global_batch(tmp_path):
    """RUN/data_skips.json counts batches of the global batch it was written with: read at another
    one its windows would skip other samples, so that is one error naming the file and both sizes;
    a file written by hand (no global_batch) is taken as it is."""
    skips = DataSkips(str(tmp_path), 8)
    skips.add(3, 4, write=True)
    assert json.loads((tmp_path / "data_skips.json").read_text()) == {"windows": [[3, 4]], "global_batch": 8}
    assert DataSkips(str(tmp_path), 8).covers(4) and not DataSkips(str(tmp_path), 8).covers(5)
    with pytest.raises(ValueError, match=r"data_skips.json: its windows count batches of train.global_batch=8, "
                                         r"this run has train.global_batch=16"):
        DataSkips(str(tmp_path), 16)
    (tmp_path / "data_skips.json").write_text('{"windows": [[7, 7]]}')
    assert DataSkips(str(tmp_path), 16).windows == [(7, 7)]
    (tmp_path / "data_skips.json").write_text('[[7, 7]]')
    with pytest.raises(ValueError, match="not a list of data windows"):
        DataSkips(str(tmp_path), 8)
