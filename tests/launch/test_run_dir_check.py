"""The launch check refuses a run.dir it cannot write in (the folder, its checkpoints/, or the parent
a new run.dir would be created in) with one line, before torchrun starts any worker (it used to
take 3 futile restarts, or train to the end and fail at the save). Root writes in read-only
folders, so as root the checks run without the capabilities that allow it (setpriv)."""
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers.runner import REPO

ENV = {**os.environ, "VENV": sys.prefix, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}


def _unprivileged() -> list[str]:
    if os.geteuid() != 0:
        return []
    if not shutil.which("setpriv"):
        pytest.skip("root without setpriv: read-only folders are writable")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--"]


def test_unwritable_run_dir_checkpoints_and_parent_are_one_line_each(tmp_path):
    (tmp_path / "ro").mkdir()
    (tmp_path / "ckpt" / "checkpoints").mkdir(parents=True)
    (tmp_path / "ok" / "checkpoints").mkdir(parents=True)
    (tmp_path / "file").write_text("")
    for folder in (tmp_path / "ro", tmp_path / "ckpt" / "checkpoints"):
        folder.chmod(0o555)
    cases = {"ro": "ro", "ckpt": "ckpt", "new": "ro/new/run", "file": "file", "ok": "ok"}
    code = ("import sys\nfrom megatron_taper.launch_check import check_run_dir\n"
            "for name, path in zip(sys.argv[1::2], sys.argv[2::2]):\n"
            "    try:\n        check_run_dir(path)\n        print(name, 'ok')\n"
            "    except ValueError as e:\n        print(name, e)\n")
    argv = [a for name, rel in cases.items() for a in (name, str(tmp_path / rel))]
    proc = subprocess.run([*_unprivileged(), sys.executable, "-c", code, *argv], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    fix = "choose another run.dir or make it writable"
    assert got == {
        "ro": f"run.dir={tmp_path}/ro is not writable (Permission denied): {fix}",
        "ckpt": f"run.dir={tmp_path}/ckpt has a checkpoints/ that is not writable (Permission denied): {fix}",
        "new": f"run.dir={tmp_path}/ro/new/run cannot be created in {tmp_path}/ro (Permission denied): {fix}",
        "file": f"run.dir={tmp_path}/file is not writable (not a folder): {fix}",
        "ok": "ok",
    }
    assert sorted(os.listdir(tmp_path / "ok")) == ["checkpoints"]  # the probe left nothing


def test_torchrun_sh_refuses_a_read_only_run_dir_before_any_worker(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints").chmod(0o555)
    proc = subprocess.run([*_unprivileged(), "bash", "launch/torchrun.sh", "2", "--config", "configs/tiny_taper.yaml",
                           f"run.dir={run}"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == (f"error: run.dir={run} has a checkpoints/ that is not writable (Permission denied): "
                           "choose another run.dir or make it writable\n")
    assert proc.stdout == "" and sorted(os.listdir(run)) == ["checkpoints"]


def test_the_trainer_started_without_the_launch_check_refuses_it_too(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints").chmod(0o555)
    proc = subprocess.run([*_unprivileged(), sys.executable, "-m", "megatron_taper.train", "--config",
                           "configs/tiny_taper.yaml", f"run.dir={run}"], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "has a checkpoints/ that is not writable" in proc.stdout + proc.stderr
    assert not (run / "config.yaml").exists()  # refused before the run wrote anything (logs/ holds the error)
