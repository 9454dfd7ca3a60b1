"""launch/train.sbatch on a real Slurm cluster that these tests start on this machine.

2 emulated nodes x 1 process against torchrun with 2 processes on one machine; a job signalled
mid-run checkpoints, requeues itself, resumes and ends bitwise equal to an uninterrupted job;
a worker SIGKILLed mid-run is restarted inside the job (torchrun.sh's in-job restart, no
requeue) and the job ends equal to the uninterrupted one; tools/sweep.py --slurm runs a job array;
the cluster is stopped (only its own daemons) also when a test fails. The jobs of the selected
tests are submitted together (`launched`) and run at the same time; each test waits for its own.
Skipped, with the reason, where no cluster can be started (not root, packages missing).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.runner import REPO
from tests.helpers.slurm_cluster import SlurmCluster, free_ports, running_cluster

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]

STEPS = 30
TINY = [
    "--config", "configs/tiny_taper.yaml",
    "model.n_layers=2", "model.d_model=64", "model.n_heads=2", "model.mlp_width=128",
    "model.vocab_size=256", "model.seq_len=64", "model.taper.multiple=16",
    f"train.steps={STEPS}", "train.global_batch=8", "train.micro_batch=4", "train.warmup_steps=5",
    "train.log_interval=1", "train.eval_interval=0", "train.eval_batches=2", "train.device=cpu",
    "checkpoint.interval=0", "run.tensorboard=false",
]
# numbers that must agree exactly between two runs of the same config (not the timings)
EXACT = ("step", "loss", "lr", "grad_norm", "tokens_seen", "eval_loss")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    # 4 CPUs per emulated node: the module's jobs (three on 2 nodes x 1 CPU, a 2-task array) fit at once
    with running_cluster(tmp_path_factory.mktemp("slurm"), nodes=2, cpus_per_node=4) as cluster:
        yield cluster


def job_env(cluster: SlurmCluster, rdzv_port: int, **extra: str) -> dict[str, str]:
    # a free port for the rendezvous: other test runs on this machine may use the default one
    return {**cluster.env, "OMP_NUM_THREADS": "1", "NPROC_PER_NODE": "1", "RDZV_PORT": str(rdzv_port), **extra}


@dataclass
class Job:
    id: int
    out: Path  # the job's output (sbatch --output)
    run_dir: Path


def submit(cluster: SlurmCluster, tokens: str, run_dir: Path, env: dict[str, str], *overrides: str) -> Job:
    run_dir.parent.mkdir(parents=True, exist_ok=True)  # slurmd writes the job's output there
    out = run_dir.parent / f"{run_dir.name}.slurm.out"
    # the torchtitan forms (--key=value, --key value) as well as key=value in TINY
    job = cluster.sbatch(["--nodes=2", f"--output={out}", "launch/train.sbatch", *TINY, *overrides,
                          f"--data.path={tokens}", "--run.dir", str(run_dir)], env=env, cwd=str(REPO))
    return Job(job, out, run_dir)


def finish(cluster: SlurmCluster, job: Job, timeout: float = 400) -> dict[str, str]:
    info = cluster.wait(job.id, timeout)
    log = job.out.read_text(errors="replace") if job.out.exists() else "(no job output)"
    assert info["JobState"] == "COMPLETED", f"job {job.id}: {info['JobState']} {info.get('ExitCode')}\n{log[-4000:]}"
    return info


def records(run_dir: Path) -> list[dict]:
    """metrics.jsonl, the last record per (step, kind), in step order, reduced to EXACT keys."""
    latest = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        latest[(r["step"], "eval_loss" in r)] = {k: r[k] for k in EXACT if k in r}
    return [latest[k] for k in sorted(latest)]


def sweep_tool(spec: Path, out: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/sweep.py", str(spec), "--out", str(out), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def launched(request, slurm, byte_tokens, tmp_path_factory):
    """The jobs of this module's selected tests, submitted at once, so that one job's waits (the queue,
    the rendezvous, a requeue's cred_expire, an in-job restart) overlap the others' work; each test
    waits for its own: the uninterrupted job and its torchrun twin, the signalled job, the job whose
    worker is killed at step STEPS // 2 (checkpoint.interval=10), and tools/sweep.py --slurm's job
    array. The signalled job gets its USR1s here, as soon as its first step is logged (the
    trainers' handlers are installed by then)."""
    selected = {item.originalname for item in request.session.items if item.path == request.path}
    wants = {name: f"test_{name}" in selected for name in (
        "signalled_job_requeues_and_resumes_bitwise", "killed_worker_recovers_inside_the_job", "sweep_as_job_array")}
    signalled_wanted, killed_wanted, sweep_wanted = wants.values()
    plain_wanted = signalled_wanted or killed_wanted or "test_sbatch_two_nodes_matches_torchrun" in selected
    root = tmp_path_factory.mktemp("jobs")
    ports = free_ports(4)
    jobs = SimpleNamespace(t0=time.monotonic(), plain=None, signalled=None, killed=None, sweep=None, ref=None,
                           ref_dir=root / "torchrun" / "run", sweep_out=root / "sweep", sweep_spec=root / "sweep.yaml",
                           sweep_env=job_env(slurm, ports[3]))  # sweep.sbatch offsets its RDZV_PORT by the task
    if plain_wanted:
        jobs.plain = submit(slurm, byte_tokens, root / "uninterrupted" / "run", job_env(slurm, ports[0]))
    if signalled_wanted:
        jobs.signalled = submit(slurm, byte_tokens, root / "signalled" / "run", job_env(slurm, ports[1]))
    if killed_wanted:
        jobs.killed = submit(slurm, byte_tokens, root / "killed" / "run",
                             job_env(slurm, ports[2], MEGATRON_TAPER_FAULT=f"kill:1:{STEPS // 2}"),
                             "checkpoint.interval=10")
    if sweep_wanted:
        overrides = "\n".join(f"  - {o}" for o in [*TINY[2:], "train.steps=6", f"data.path={byte_tokens}"])
        jobs.sweep_spec.write_text(f"recipe: {REPO}/configs/tiny_taper.yaml\noverrides:\n{overrides}\n"
                                   f"axes:\n  model.taper.start: [1.5, 1.0]\nseeds: [0]\n")
        jobs.sweep = sweep_tool(jobs.sweep_spec, jobs.sweep_out, jobs.sweep_env, "--slurm", "--", "--nodes=1")
    if plain_wanted:  # the same run as the uninterrupted job under launch/torchrun.sh, 2 processes here
        jobs.ref = subprocess.Popen(["bash", "launch/torchrun.sh", "2", *TINY, f"data.path={byte_tokens}",
                                     f"run.dir={jobs.ref_dir}"], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        if signalled_wanted:
            jobs.signalled_after = signal_after_first_step(slurm, jobs.signalled) - jobs.t0
        yield jobs
    finally:
        if jobs.ref is not None and jobs.ref.poll() is None:  # `uninterrupted` waits for it, unless it failed
            os.killpg(jobs.ref.pid, signal.SIGKILL)
            jobs.ref.communicate()


def signal_after_first_step(cluster: SlurmCluster, job: Job) -> float:
    """USR1 to the job's steps as soon as its first step is logged; the time it was sent."""
    metrics = job.run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    polls = 0
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert time.monotonic() < deadline, f"no step logged\n{job.out.read_text() if job.out.exists() else ''}"
        if polls % 10 == 0:  # the job's state (a process per look) twice a second, the file every 0.05 s
            assert cluster.job(job.id).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), cluster.job(job.id)
        polls += 1
        time.sleep(0.05)
    signalled = time.monotonic()
    # like --signal=USR1@N: every process of the job's steps, not the batch shell; twice, as
    # an impatient user or a preemption right after the warning would (the trainers keep one)
    for _ in range(2):
        subprocess.run(["scancel", "--signal=USR1", str(job.id)], env=cluster.env, check=True, timeout=30)
    return signalled


@pytest.fixture(scope="module")
def uninterrupted(slurm, launched):
    """The sbatch job on 2 nodes x 1 process that runs to the end, and the same run under
    launch/torchrun.sh with 2 processes on this machine, started with it (the job waits on Slurm
    much of its time): (run dir, seconds, job record, job output, torchrun run dir, torchrun seconds)."""
    ref = launched.ref
    stdout, stderr = ref.communicate(timeout=400)  # (`launched` stops it if this fails)
    ref_seconds = time.monotonic() - launched.t0
    assert ref.returncode == 0, stdout[-2000:] + stderr[-4000:]
    job = launched.plain
    info = finish(slurm, job)
    return job.run_dir, time.monotonic() - launched.t0, info, job.out, launched.ref_dir, ref_seconds


def test_sbatch_two_nodes_matches_torchrun(uninterrupted):
    run_dir, seconds, info, out, ref_dir, ref_seconds = uninterrupted
    assert info["NumNodes"] == "2" and info["Restarts"] == "0", info
    log = out.read_text()
    assert "2 node(s)" in log and "1 process(es) per node" in log, log[-2000:]
    got, want = records(run_dir), records(ref_dir)
    assert [r["step"] for r in got if "loss" in r] == list(range(1, STEPS + 1))
    assert got == want
    print(f"sbatch 2x1: {seconds:.1f}s, torchrun 2 processes (at the same time): {ref_seconds:.1f}s; "
          f"final loss {got[-1].get('eval_loss', got[-1].get('loss'))}")


@pytest.mark.slow  # over ~20 s alone
def test_signalled_job_requeues_and_resumes_bitwise(slurm, launched, uninterrupted):
    job = launched.signalled  # signalled (USR1, twice) by `launched` after its first logged step
    info = finish(slurm, job)
    log = job.out.read_text()

    assert info["Restarts"] == "1", info
    assert "requeueing job" in log and "restart 1:" in log, log[-4000:]
    logged = [json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r] == list(range(1, STEPS + 1))  # each step once
    got, want = records(job.run_dir), records(uninterrupted[0])
    assert got == want  # every logged number equal, bit for bit (JSON keeps full float precision)
    checkpoints = sorted(p.name for p in (job.run_dir / "checkpoints").iterdir())
    print(f"signalled after {launched.signalled_after:.1f}s; job done (with requeue) after "
          f"{time.monotonic() - launched.t0:.1f}s; checkpoints {checkpoints}")


@pytest.mark.slow  # over ~20 s alone
def test_killed_worker_recovers_inside_the_job(slurm, launched, uninterrupted):
    """A worker SIGKILLed mid-run (MEGATRON_TAPER_FAULT) is restarted by torchrun.sh's in-job
    restart on both nodes, resumes from the last checkpoint, and the job (never requeued) ends
    with losses equal to the uninterrupted job's."""
    job = launched.killed
    info = finish(slurm, job)
    assert info["Restarts"] == "0", info
    events = [json.loads(line) for line in (job.run_dir / "logs" / "faults.jsonl").read_text().splitlines()]
    fired = [e for e in events if e["event"] == "fired"]
    assert len(fired) == 1 and fired[0]["step"] == STEPS // 2, events
    # (torchrun's restart count is not one: the node whose worker survived restarts uncounted)
    again = [e for e in events if e["event"] == "first_step" and e["time"] > fired[0]["time"]]
    assert [e["step"] for e in again] == [11], events  # resumed from step-10
    assert records(job.run_dir) == records(uninterrupted[0])
    print(f"killed at step {STEPS // 2}: training again after {again[0]['time'] - fired[0]['time']:.1f} s")


def test_sweep_as_job_array(slurm, launched):
    """tools/sweep.py --slurm (run by `launched`): two runs as one job array of launch/sweep.sbatch,
    then --collect."""
    proc, spec, out, env = launched.sweep, launched.sweep_spec, launched.sweep_out, launched.sweep_env
    assert proc.returncode == 0 and "submitted 2 run(s)" in proc.stdout, proc.stdout + proc.stderr
    job = int(re.search(r"job array (\d+)", proc.stdout).group(1))

    def failed() -> bool:
        return "exited with" in "".join(
            p.read_text(errors="replace") for p in (out / "slurm").glob("*.out")).replace("exited with 0", "")

    deadline = time.monotonic() + 300
    # until the array leaves the queue (done, or it could not start) or a task failed; its runs'
    # state from the tool once, then (a python process per look, the queue is a cheap one)
    while time.monotonic() < deadline and slurm.queued(job) and not failed():
        time.sleep(0.5)
    runs = [json.loads(line) for line in sweep_tool(spec, out, env, "--dry-run").stdout.splitlines()]
    logs = "".join(p.read_text(errors="replace") for p in (out / "slurm").glob("*.out"))
    assert all(r["finished"] for r in runs), f"{logs[-4000:]}\njob {job}: {slurm.job(job)}"
    assert "array task 0" in logs and "array task 1" in logs
    proc = sweep_tool(spec, out, env, "--collect")
    assert proc.returncode == 0, proc.stderr
    table = json.loads((out / "results.json").read_text())["table"]
    assert [r["model.taper.start"] for r in table] == ["1.5", "1.0"] and all(r["seeds_done"] == 1 for r in table)


INNER_TEST = '''
import sys, time
import pytest
sys.path.insert(0, {repo!r})
from tests.helpers.slurm_cluster import MARKER, _pids_with_env, running_cluster

@pytest.fixture
def slurm(tmp_path):  # like test_slurm.py's fixture, with the default 2 CPUs per node
    with running_cluster(tmp_path / "c", nodes=2) as cluster:
        yield cluster

def test_fails_with_a_running_job(slurm):
    job = slurm.sbatch(["--nodes=2", "--output=/dev/null", "--wrap", "srun sleep 300"])
    slurm.wait(job, 30, states=("RUNNING",))
    time.sleep(0.5)
    pids = [proc.pid for _, proc in slurm._procs] + _pids_with_env(MARKER, str(slurm.root))
    with open({pid_file!r}, "w") as f:
        f.write(" ".join(map(str, sorted(set(pids)))))
    assert False, "deliberate failure with the cluster running"
'''


def test_cluster_is_stopped_when_a_test_fails(slurm, tmp_path):
    # `slurm` only to skip (with its reason) where no cluster can run; the inner one is separate.
    # A decoy named like a daemon, not started by the cluster: it must survive.
    decoy_bin = tmp_path / "slurmd"
    shutil.copy("/bin/sleep", decoy_bin)
    decoy = subprocess.Popen([str(decoy_bin), "300"])
    try:
        pid_file = tmp_path / "pids"
        test_file = tmp_path / "test_inner.py"
        test_file.write_text(textwrap.dedent(INNER_TEST.format(repo=str(REPO), pid_file=str(pid_file))))
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and "deliberate failure" in proc.stdout, proc.stdout[-3000:]
        pids = [int(p) for p in pid_file.read_text().split()]
        # munged, slurmctld, 2 slurmd, and the job's slurmstepd/srun/sleep processes
        assert len(pids) >= 6, pids
        deadline = time.monotonic() + 10
        while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive, f"left running: {[(p, _comm(p)) for p in alive]}"
        assert decoy.poll() is None, "a process the tests did not start was stopped"
        assert slurm.idle_nodes(), "the outer cluster was touched"
    finally:
        decoy.kill()
        decoy.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # zombies have ended
    except OSError:
        return False


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
