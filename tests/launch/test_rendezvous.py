"""Single-node launches keep torch's unauthenticated rendezvous store on loopback: launch/torchrun.sh
(through python -m megatron_taper.torchrun) listens on 127.0.0.1 only, and no single-node launch path
(quickstart, sweeps) calls torchrun's own --standalone, whose store listens on every interface."""
import os
import re
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers.runner import REPO, TINY, kill_tree, process_tree


def _listening(pids: list[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket the processes listen on."""
    found = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
            found.append((conn.laddr.ip, conn.laddr.port, conn.pid))
    return found


@pytest.mark.multiprocess
def test_torchrun_sh_rendezvous_store_listens_on_loopback_only(byte_tokens, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VENV": sys.prefix, "TAPER_PREFLIGHT_DONE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.Popen(["bash", "launch/torchrun.sh", "2", *TINY, f"data.path={byte_tokens}",
                             f"run.dir={tmp_path / 'run'}", "train.steps=1000"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        agent, deadline = None, time.monotonic() + 90
        while time.monotonic() < deadline and not (tmp_path / "run" / "metrics.jsonl").exists():
            time.sleep(0.1)
            if agent is None:  # torchrun's agent, found once
                agent = next((p for p in process_tree(proc.pid) if "--nproc-per-node" in _cmdline(p)), None)
        assert agent is not None and (tmp_path / "run" / "metrics.jsonl").exists(), "the run did not start"
        listening = _listening([agent])
        workers = [p for p in process_tree(agent) if p != agent and "megatron_taper.train" in _cmdline(p)]
        addrs = {_environ(p).get("MASTER_ADDR") for p in workers}
    finally:
        kill_tree(proc.pid)
        out = proc.communicate(timeout=30)[0]
    assert listening, f"the agent listens on nothing:\n{out[-3000:]}"
    assert {ip for ip, _, _ in listening} == {"127.0.0.1"}, listening  # torch's own --standalone: '::' (all)
    assert len(workers) == 2 and addrs == {"127.0.0.1"}, (workers, addrs)


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def _environ(pid: int) -> dict:
    try:
        return psutil.Process(pid).environ()
    except psutil.Error:
        return {}


def test_no_single_node_launch_path_uses_torchs_own_standalone():
    paths = ["launch/quickstart.sh", "launch/torchrun.sh", "tools/sweep.py", "megatron_taper/sweep.py"]
    for path in paths:
        text = (REPO / path).read_text()
        assert not re.search(r"(torch\.distributed\.run|bin/torchrun\"?)[^\n]*--standalone", text), path
    assert "megatron_taper.torchrun" in (REPO / "launch/torchrun.sh").read_text()


def test_loopback_rendezvous_refuses_more_than_one_node():
    proc = subprocess.run([sys.executable, "-m", "megatron_taper.torchrun", "--nnodes", "2", "--rdzv-backend",
                           "loopback", "--rdzv-endpoint", "127.0.0.1:0", "--nproc-per-node", "1", "-m", "json.tool"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "the loopback rendezvous is for one node (got --nnodes 2)" in proc.stderr


