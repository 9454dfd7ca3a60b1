"""A throw-away Slurm cluster on this machine, for tests: munged + slurmctld + N emulated slurmd.

Everything lives in one folder (config, munge key and socket, state, spool, logs) and uses free
ports, so it does not touch /etc/slurm, /etc/munge, /etc/hosts or any daemon already running.
Clients find it through SLURM_CONF in `cluster.env`. `stop()` ends only what `start()` started:
the daemons by their Popen handles, and leftovers (slurmstepd, job processes) by a marker
variable in their environment that is set to this cluster's folder.

    with SlurmCluster(tmp_path) as cluster:          # raises ClusterUnavailable with the reason
        job = cluster.sbatch(["launch/train.sbatch", ...], env=cluster.env)
        cluster.wait(job)

Needs root and Debian's slurmctld, slurmd, slurm-client and munge (22.05 is built with
multiple-slurmd support, which the emulated nodes rely on).
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

MARKER = "MEGATRON_TAPER_TEST_CLUSTER"  # env var carried by every process of a test cluster
_SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
_PR_SET_PDEATHSIG = 1


class ClusterUnavailable(RuntimeError):
    """The cluster cannot be started here; the message says why (tests skip with it)."""


@contextlib.contextmanager
def running_cluster(root: str | os.PathLike, nodes: int = 2, cpus_per_node: int = 2) -> Iterator["SlurmCluster"]:
    """For pytest fixtures: a started cluster, or pytest.skip with the reason; always stopped."""
    import pytest

    reason = missing_requirements()
    if reason:
        pytest.skip(f"no Slurm cluster: {reason}")
    cluster = SlurmCluster(root, nodes=nodes, cpus_per_node=cpus_per_node)
    try:
        cluster.start()
    except ClusterUnavailable as e:
        pytest.skip(f"no Slurm cluster: could not start one: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()


def missing_requirements() -> str | None:
    """Why no cluster can be started on this machine, or None when it can be tried."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the test Slurm cluster needs root (slurmd runs jobs as their user)"
    missing = [p for p in ("munged", "munge", "unmunge", "slurmctld", "slurmd", "sbatch", "scontrol") if not _which(p)]
    if missing:
        return f"not installed: {', '.join(missing)} (apt-get install slurmctld slurmd slurm-client munge)"
    return None


class SlurmCluster:
    def __init__(self, root: str | os.PathLike, nodes: int = 2, cpus_per_node: int = 2,
                 cred_expire: int = 5) -> None:
        self.root = Path(root).resolve()
        self.nodes = nodes
        self.cpus_per_node = cpus_per_node
        # a requeued job waits cred_expire seconds before it may start again (Slurm default 120)
        self.cred_expire = cred_expire
        self.node_names = [f"n{i + 1}" for i in range(nodes)]
        self.conf = self.root / "etc" / "slurm.conf"
        self.env: dict[str, str] = {}
        self._procs: list[tuple[str, subprocess.Popen]] = []
        self._sock_dir: Path | None = None
        self._stopped = True

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> "SlurmCluster":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self, timeout: float = 30.0) -> None:
        reason = missing_requirements()
        if reason:
            raise ClusterUnavailable(reason)
        self._stopped = False
        atexit.register(self.stop)
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> None:
        for sub in ("etc", "log", "state", "run", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # munged wants every folder above its socket traversable by all (pytest's tmp folders are
        # not) and the path must fit in a sockaddr_un: a short folder of its own in /tmp
        self._sock_dir = Path(tempfile.mkdtemp(prefix="taper-munge-", dir="/tmp"))
        self._sock_dir.chmod(0o755)
        key_dir = self.root / "munge"
        key_dir.mkdir(mode=0o700, exist_ok=True)
        key = key_dir / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        sock = self._sock_dir / "munge.sock"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), MARKER: str(self.root)}
        for var in [v for v in self.env if v.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            if var != "SLURM_CONF":  # a test run inside a slurm job must not leak its job into ours
                del self.env[var]

        self._spawn("munged", [_which("munged"), "-F", f"--socket={sock}", f"--key-file={key}",
                               f"--pid-file={key_dir / 'munged.pid'}", f"--seed-file={key_dir / 'seed'}",
                               f"--log-file={self.root / 'log' / 'munged.log'}"])
        self._wait(lambda: self._munge_ok(sock), 10.0, "munged did not answer")

        ports = free_ports(1 + self.nodes)
        self.conf.write_text(self._slurm_conf(sock, ports[0], ports[1:]))
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._wait(lambda: "UP" in self._run(["scontrol", "ping"]), timeout, "slurmctld did not come up")
        for name in self.node_names:
            self._spawn(f"slurmd-{name}", [_which("slurmd"), "-D", "-N", name, "-f", str(self.conf)])
        self._wait(lambda: set(self.idle_nodes()) == set(self.node_names), timeout,
                   f"nodes {self.node_names} did not become idle")

    def stop(self) -> None:
        """Cancel all jobs, stop the daemons this object started and any process they left."""
        if self._stopped:
            return
        self._stopped = True
        ctld = dict(self._procs).get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            jobs = self._run(["squeue", "-h", "-o", "%i"]).split()
            if jobs:
                self._run(["scancel", "--full", *jobs])
                self._wait(lambda: not self._run(["squeue", "-h", "-o", "%i"]).strip(), 15.0, None)
        for _name, proc in reversed(self._procs):
            _terminate(proc)
        self._procs.clear()
        for pid in _pids_with_env(MARKER, str(self.root)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._sock_dir is not None:
            shutil.rmtree(self._sock_dir, ignore_errors=True)

    # -- use -------------------------------------------------------------------------------

    def sbatch(self, args: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> int:
        out = subprocess.run(["sbatch", "--parsable", *args], env=env or self.env, cwd=cwd,
                             capture_output=True, text=True, timeout=30)
        if out.returncode:
            raise RuntimeError(f"sbatch failed ({out.returncode}): {out.stderr.strip()}")
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, NodeList, ...)."""
        text = self._run(["scontrol", "show", "job", "-o", str(job_id)])
        fields: dict[str, str] = {}
        for item in text.split():
            if "=" in item:
                k, v = item.split("=", 1)
                fields.setdefault(k, v)
        return fields

    def wait(self, job_id: int, timeout: float = 120.0,
             states: tuple[str, ...] = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                        "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED")) -> dict[str, str]:
        """Poll until the job reaches one of `states`; returns its final record."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.2)
        raise TimeoutError(f"job {job_id} not in {states} after {timeout:.0f}s: {info}\n{self.logs()}")

    def queued(self, job_id: int) -> bool:
        """Whether any task of job (array) `job_id` is still in the queue (pending or running)."""
        return bool(self._run(["squeue", "-h", "-j", str(job_id), "-o", "%i"]).strip())

    def idle_nodes(self) -> list[str]:
        return self._run(["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"]).split()

    def logs(self, lines: int = 30) -> str:
        parts = []
        for f in sorted((self.root / "log").glob("*")):
            tail = f.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {f.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    # -- internals -------------------------------------------------------------------------

    def _slurm_conf(self, munge_sock: Path, ctld_port: int, node_ports: list[int]) -> str:
        r = self.root
        nodes = "\n".join(
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs={self.cpus_per_node} State=UNKNOWN"
            for n, p in zip(self.node_names, node_ports))
        return f"""# test cluster written by tests/helpers/slurm_cluster.py
ClusterName=taper
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_sock},cred_expire={self.cred_expire}
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=10
MailProg=/bin/true
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self.root / "log" / f"{name}.out", "wb")
        proc = subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        out.close()
        self._procs.append((name, proc))

    def _munge_ok(self, sock: Path) -> bool:
        enc = subprocess.run([_which("munge"), "-n", f"--socket={sock}"], capture_output=True)
        if enc.returncode:
            return False
        dec = subprocess.run([_which("unmunge"), f"--socket={sock}"], input=enc.stdout, capture_output=True)
        return dec.returncode == 0

    def _run(self, argv: list[str]) -> str:
        try:
            out = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out.stdout if out.returncode == 0 else ""

    def _wait(self, ok, timeout: float, error: str | None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self._procs:
                if proc.poll() is not None and error:
                    raise ClusterUnavailable(f"{name} exited with {proc.returncode}\n{self.logs()}")
            if ok():
                return
            time.sleep(0.1)
        if error:
            raise ClusterUnavailable(f"{error} within {timeout:.0f}s\n{self.logs()}")


def _which(name: str) -> str | None:
    return shutil.which(name) or next((f"{d}/{name}" for d in _SBIN if os.access(f"{d}/{name}", os.X_OK)), None)


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the test process dies (even by SIGKILL)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _terminate(proc: subprocess.Popen, grace: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(grace)


def free_ports(n: int) -> list[int]:
    """n ports free now on 127.0.0.1 for a listener that binds them later (the daemons, a job's
    rendezvous store). Drawn below the kernel's ephemeral range (ip_local_port_range): a port from
    that range can be taken in between by any outgoing connection, e.g. another test's gloo
    sockets, which once made a job's store fail with EADDRINUSE."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    rng = random.SystemRandom()
    socks: list[socket.socket] = []
    try:
        while len(socks) < n:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", rng.randrange(10000, ephemeral_low)))
            except OSError:
                s.close()
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _pids_with_env(var: str, value: str) -> list[int]:
    """Processes (other than this one) whose environment has var=value."""
    needle = f"{var}={value}".encode()
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry.name))
        except OSError:
            continue
    return pids
