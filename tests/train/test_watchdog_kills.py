"""The hang watchdog SIGKILLs only processes that are verifiably workers of its own attempt: a forged
heartbeat naming an unrelated sleeping process leaves it alive (it used to be killed), a heartbeat of
an earlier job that reused the rendezvous id is not counted (and its process is left alone), while a
frozen worker of this attempt on this host is still killed."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

from megatron_taper.fault.watchdog import EXIT_HANG, process_start
from tests.helpers.runner import REPO

ATTEMPT = {"TORCHELASTIC_RUN_ID": "job-a", "TORCHELASTIC_RESTART_COUNT": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29999"}
WATCHDOG = """
import sys, time
from megatron_taper.config import FaultConfig
from megatron_taper.fault.watchdog import Watchdog
watchdog = Watchdog(FaultConfig(step_timeout_s=0.5), 0, 4, sys.argv[1]).start()
watchdog.enter("step", 1)
time.sleep(60)
"""


def _sleeper(env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)


def _beat(logs, rank: int, proc: subprocess.Popen, attempt: dict) -> None:
    for _ in range(100):  # the start time is readable once the process exists
        if process_start(proc.pid) is not None:
            break
        time.sleep(0.01)
    (logs / f"heartbeat-rank{rank}.json").write_text(json.dumps({
        "rank": rank, "pid": proc.pid, "start_ticks": process_start(proc.pid), "host": socket.gethostname(),
        "step": 1, "section": "step", "began": time.time() - 20, "beat": time.time() - 10,
        "run_id": attempt["TORCHELASTIC_RUN_ID"], "restart": attempt["TORCHELASTIC_RESTART_COUNT"],
        "store": f"{attempt['MASTER_ADDR']}:{attempt['MASTER_PORT']}"}))


def test_only_this_attempts_frozen_workers_are_killed(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_", "RANK"))}
    unrelated = _sleeper(base)  # a forged heartbeat names it as rank 1
    genuine = _sleeper({**base, **ATTEMPT, "RANK": "2"})  # a frozen worker of this attempt
    earlier = {**ATTEMPT, "MASTER_PORT": "29111"}  # an earlier job that used the same rendezvous id
    stale = _sleeper({**base, **earlier, "RANK": "3"})
    try:
        _beat(logs, 1, unrelated, ATTEMPT)
        _beat(logs, 2, genuine, ATTEMPT)
        _beat(logs, 3, stale, earlier)
        proc = subprocess.run([sys.executable, "-c", WATCHDOG, str(logs)], cwd=REPO, capture_output=True, text=True,
                              timeout=60, env={**base, **ATTEMPT, "RANK": "0",
                                               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH",
                                                                                                        "")])})
        assert proc.returncode == EXIT_HANG, proc.stderr
        assert "stopped first: rank 1 (heartbeat not written for " in proc.stderr
        assert "rank 2 (heartbeat not written for " in proc.stderr
        assert "rank 3 (no heartbeat in this attempt)" in proc.stderr, proc.stderr
        assert genuine.wait(timeout=10) == -signal.SIGKILL
        time.sleep(0.2)
        assert unrelated.poll() is None and stale.poll() is None  # alive
    finally:
        for p in (unrelated, genuine, stale):
            p.kill()
            p.wait()
