"""Stops and recoveries under torchrun (2 gloo workers), as the console says them.

- issue 41: a stop signal was acted on only at log or checkpoint steps (tiny Titans took ~137 s to
  act on SIGTERM) and Ctrl-C was not handled at all (tracebacks, no checkpoint). With a log
  interval of 1,000 steps and no checkpoint interval, a SIGTERM that rank 1 alone gets before
  step 6 stops both ranks with a checkpoint of step 6 or 7 (the step at which it stopped against
  the one it was sent at: within two step times) and exit code 3; then Ctrl-C (SIGINT to
  torchrun's process group, as a terminal sends it; torchrun forwards it to the workers) stops the
  resumed run with a checkpoint too, and the next run resumes from that one.
- An in-job restart (torchrun --max-restarts) prints one line: which restart, why the previous
  attempt ended (the first error a rank recorded, a hang, or none recorded) and the step it
  resumes from; skipped non-finite steps are named in one line at the next log step.
- On CUDA (skipped elsewhere; not yet run on a GPU): the vote makes no implicit host sync (CUDA's
  sync debug mode "error") and agrees one step after a signal.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.runner import REPO, kill_tree, read_metrics, run_train, train_in_process

pytestmark = pytest.mark.multiprocess

TINY = ["--config", "configs/tiny_taper.yaml", "model.n_layers=2", "model.d_model=64", "model.n_heads=4",
        "model.mlp_width=128", "model.vocab_size=256", "model.seq_len=32", "model.taper.multiple=16",
        "train.global_batch=8", "train.micro_batch=4", "train.eval_interval=0", "train.device=cpu",
        "run.tensorboard=false"]


def _start(args: list[str], fault: str = "") -> subprocess.Popen:
    """torchrun with 2 workers, in a session of its own (its process group is what Ctrl-C reaches)."""
    cmd = [sys.executable, "-m", "megatron_taper.torchrun", "--nproc-per-node", "2", "--standalone",
           "-m", "megatron_taper.train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGATRON_TAPER_FAULT": fault}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 180) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"torchrun did not end in {timeout} s\nstdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}")


def _logged_steps(run) -> list[int]:
    """The steps of metrics.jsonl's complete lines (the trainer may be writing the last one)."""
    path = run / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(line)["step"] for line in lines]


def _checkpoints(run) -> list[int]:
    return sorted(int(n.split("-")[1]) for n in os.listdir(run / "checkpoints") if re.fullmatch(r"step-\d+", n))


def test_sigterm_stops_within_two_steps_and_ctrl_c_saves_and_resumes(byte_tokens, tmp_path):
    run = tmp_path / "run"
    args = [*TINY, f"data.path={byte_tokens}", f"run.dir={run}", "train.steps=3000", "train.log_interval=1000",
            "checkpoint.interval=0"]
    # rank 1 sends itself SIGTERM just before step 6: the signal is sent after step 5
    out, err = _finish(_start(args, fault="term:1:6"))
    shown = f"\nstdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
    # exit 3 (stopped with a checkpoint); torchrun sends SIGTERM to a worker still ending when the
    # other has exited (3 is a failure to plain torchrun; launch/torchrun.sh reports it as 3)
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", err)
    assert "3" in codes and set(codes) <= {"3", "-15"}, shown
    (stopped,) = _checkpoints(run)
    assert 6 <= stopped <= 5 + 2, shown
    assert f"stopped by SIGTERM at step {stopped} (the signal was first seen at the end of step 6); checkpoint " \
           f"written" in out, shown
    assert not (run / "metrics.jsonl").exists()  # no log step was reached: the stop did not wait for one

    # Ctrl-C: the resumed run logs every step, so that the test sees it train
    proc = _start([*args, "train.log_interval=1"])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and len(_logged_steps(run)) < 2:
        time.sleep(0.02)
    sent_after = _logged_steps(run)[-1]
    os.killpg(proc.pid, signal.SIGINT)
    out, err = _finish(proc)
    shown = f"\nstdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
    # (torchrun, itself stopped by SIGINT, reports no exit codes of its workers)
    assert "SIGINT: stopping within two steps with a checkpoint" in err, shown
    interrupted = _checkpoints(run)[-1]
    assert interrupted > sent_after, shown
    assert f"stopped by SIGINT at step {interrupted} (the signal was first seen at the end of step " \
           f"{interrupted - 1}); checkpoint written" in out, shown
    assert "KeyboardInterrupt" not in err and "Traceback" not in err, shown
    assert "torchrun: stopped by SIGINT; the workers were stopped" in err, shown

    resumed = train_in_process([*args, "train.exit_after=1"])  # one process, the same global batch
    assert f"resumed from: {run / 'checkpoints' / f'step-{interrupted}'} at step {interrupted}" in resumed.stdout
    assert _checkpoints(run)[-1] == interrupted + 1


def test_an_in_job_restart_and_a_skipped_step_say_one_line_each(byte_tokens, tmp_path):
    run = tmp_path / "run"
    proc = run_train([*TINY, f"data.path={byte_tokens}", f"run.dir={run}", "train.steps=6", "train.log_interval=3",
                      "checkpoint.interval=2"], nproc=2,
                     env={"PET_MAX_RESTARTS": "1", "MEGATRON_TAPER_FAULT": "raise:1:3,nan:0:5"})
    restarts = [line for line in proc.stdout.splitlines() if " restart " in line]
    assert len(restarts) == 1, proc.stdout[-3000:]
    assert restarts[0].endswith(
        f"restart 1 of this job (torchrun --max-restarts; the previous attempt ended after an error on rank 1: "
        f"InjectedFault: MEGATRON_TAPER_FAULT: injected exception on rank 1 before step 3 (traceback in "
        f"{run / 'logs' / 'rank-1.log'})): resumed from: {run / 'checkpoints' / 'step-2'} at step 2"), restarts
    skipped = [line for line in proc.stdout.splitlines() if " skipped: " in line]
    assert len(skipped) == 1 and skipped[0].endswith(
        "step 5 was skipped: non-finite loss or gradient norm, the optimizer did not step (1 skipped so far; "
        "train.max_nonfinite=5 in a row stop the run)"), proc.stdout[-3000:]
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [3, 6]


def test_skipped_steps_are_named_at_the_next_log_step(byte_tokens, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_TAPER_FAULT", "nan:0:2,nan:0:3,nan:0:6")
    proc = train_in_process([*TINY, f"data.path={byte_tokens}", f"run.dir={tmp_path / 'run'}", "train.steps=8",
                             "train.log_interval=4", "checkpoint.interval=0"])
    skipped = [line.split(" ", 2)[2] for line in proc.stdout.splitlines() if " skipped: " in line]
    tail = "non-finite loss or gradient norm, the optimizer did not step"
    assert skipped == [f"2 steps from step 2 to step 3 were skipped: {tail} (2 skipped so far; "
                       f"train.max_nonfinite=5 in a row stop the run)",
                       f"step 6 was skipped: {tail} (3 skipped so far; train.max_nonfinite=5 in a row stop the run)"]


def test_what_ended_the_previous_attempt(tmp_path, monkeypatch):
    """Only records of the same torchrun run (its id) and attempt (restart count) count, and only
    those written after the checkpoint resumed from: a run folder keeps older jobs' logs."""
    from megatron_taper.console import previous_attempt_end, report_error

    logs = tmp_path / "logs"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert previous_attempt_end(str(logs), "run job-a, restart 0").startswith("without a recorded error: a worker was")
    report_error(RuntimeError("[gloo] connection closed by peer"), 0, str(tmp_path), expected=False)
    assert previous_attempt_end(str(logs), "run job-a, restart 0") == (
        f"after an error on rank 0: RuntimeError: [gloo] connection closed by peer (a lost connection: another rank "
        f"may have died first, without an error; traceback in {logs / 'rank-0.log'})")
    for other in ("run job-a, restart 1", "run job-b, restart 0"):
        assert previous_attempt_end(str(logs), other).startswith("without a recorded error"), other
    assert previous_attempt_end(str(logs), "run job-a, restart 0", since=time.time() + 1).startswith("without")
    (logs / "ended.json").write_text('{"rank": 1, "run_id": "job-a", "restart": "0", "time": 1e12}')
    assert previous_attempt_end(str(logs), "run job-a, restart 0") == (
        f"on a hang reported by rank 1 (stacks in {logs}/stacks-rank*.txt)")


class _PendingSave:
    """A Checkpointer's side of the vote: the background save of step 2 is pending from the start,
    written by this rank from the end of step `written_at` on."""

    def __init__(self, written_at: int):
        self.written_at, self.now, self.pending, self.finalised_at = written_at, 0, 2, None

    def saving(self):
        return None if self.pending is None else (self.pending, self.now >= self.written_at)

    def finalise(self, step: int) -> None:
        if self.pending == step:
            self.pending, self.finalised_at = None, self.now


def _vote_with_a_pending_save() -> tuple:
    import torch
    import torch.distributed as dist

    from megatron_taper.training.stop import StopSignal, StopVote

    rank = dist.get_rank()
    ctx = type("Ctx", (), {"mesh": "all ranks", "device": torch.device("cpu")})()
    stop, save = StopSignal(), _PendingSave(written_at=2 if rank == 0 else 4)
    vote, agreed = StopVote(ctx, stop, save), None
    for step in range(1, 9):
        save.now = step
        if step == 6 and rank == 0:
            stop.received = signal.SIGTERM
        agreed = vote.at_step_end(step)
        if agreed:
            return save.finalised_at, step, agreed.name, agreed.seen_at
    return save.finalised_at, None


def test_the_stop_vote_completes_a_background_save_when_every_rank_has_written():
    """Rank 0 has written its part at step 2, rank 1 at step 4: the vote of step 4 says so, read at
    step 5, where both ranks finalise the save (the same step, with no collective of its own); the
    stop seen by rank 0 at step 6 is still agreed at step 7 on both."""
    from tests.helpers.harness import run_distributed

    assert run_distributed(_vote_with_a_pending_save, 2, timeout=60) == [(5, 7, "SIGTERM", 6)] * 2


def _vote_on_cuda() -> None:
    """One NCCL rank: steps of device work, the vote at each end, under CUDA's sync debug mode
    "error" (an implicit host sync raises); a stop seen at the end of step 5 is agreed at step 6."""
    import torch
    import torch.distributed as dist

    from megatron_taper.training.stop import StopSignal, StopVote

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    ctx = type("Ctx", (), {"mesh": "one rank", "device": device})()
    stop = StopSignal()
    vote = StopVote(ctx, stop)
    x = torch.randn(2048, 2048, device=device)
    agreed = []
    torch.cuda.set_sync_debug_mode("error")
    for step in range(1, 9):
        for _ in range(20):
            x = torch.tanh(x @ x)
        if step == 5:
            stop.received = signal.SIGTERM
        result = vote.at_step_end(step)
        agreed.append((step, None if result is None else (result.name, result.seen_at)))
    torch.cuda.set_sync_debug_mode("default")
    dist.destroy_process_group()
    assert [a for a in agreed if a[1]][0] == (6, ("SIGTERM", 5)), agreed


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_the_stop_vote_never_syncs_the_host_on_cuda():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    proc = subprocess.run([sys.executable, "-c", "from tests.train.test_stops import _vote_on_cuda; _vote_on_cuda()"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
