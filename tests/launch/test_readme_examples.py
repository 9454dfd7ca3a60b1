"""README.md's examples run as written after the quickstart.

Runs `bash launch/quickstart.sh` (QUICKSTART_INSTALL=0: the environment running the tests is
installed already; its cache folder is the user's, so a second run reuses the tokenizer and
shards as a user's does), then every command of the README blocks marked
`<!-- example: tests/launch/test_readme_examples.py ... -->` (now: "Training by hand", "Inspecting a
model and a pipeline plan", "Evaluation, samples, Hugging Face, lm-eval"), in their order, in a
folder that looks like the repository (configs/, tools/, launch/ and .venv linked), so relative
paths such as runs/quickstart resolve as they do for a user. The one change: trainer commands
run train.steps=1 (replaced where the command sets it, appended where not): one step still writes
the metrics, the held-out loss and the checkpoint every later command reads. `python tools/X.py`
and `python -m megatron_taper.train` run in this process (the same main() the script calls),
everything else (torchrun, bash) as a process. The lm-eval line needs the optional lm-eval
package: it is run only where that is installed.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runner import REPO

MARK = "<!-- example: tests/launch/test_readme_examples.py runs this block after the quickstart -->"
STEPS = "train.steps=1"
TRAINERS = ("megatron_taper.train", "launch/torchrun.sh", "launch/quickstart.sh")


def readme_commands() -> list[str]:
    """The commands of the marked blocks, continuation lines joined, comments dropped."""
    lines = (REPO / "README.md").read_text().splitlines()
    commands = []
    for i, line in enumerate(lines):
        if line.strip() != MARK:
            continue
        assert lines[i + 1].startswith("```"), f"README.md:{i + 2}: the example mark is not before a code block"
        block = []
        for body in lines[i + 2:]:
            if body.startswith("```"):
                break
            block.append(body)
        commands += [c for c in "\n".join(block).replace("\\\n", " ").splitlines() if c.strip()]
    return commands


def tiny_steps(argv: list[str]) -> list[str]:
    if not any(t in " ".join(argv) for t in TRAINERS):
        return argv
    argv = [STEPS if re.fullmatch(r"(--)?train\.steps=\d+", a) else a for a in argv]
    return argv if STEPS in argv else [*argv, STEPS]


def _in_process(argv: list[str]):
    """main() of `.venv/bin/python tools/X.py ...` or `.venv/bin/python -m megatron_taper.train ...`."""
    if argv[0] != ".venv/bin/python":
        return None
    if argv[1:3] == ["-m", "megatron_taper.train"]:
        from megatron_taper.train import main

        return lambda: main(argv[3:])
    if argv[1].startswith("tools/") and argv[1].endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"readme_{Path(argv[1]).stem}", REPO / argv[1])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return lambda: module.main(argv[2:])
    return None


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("readme")
    for name in ("configs", "tools", "launch"):
        (root / name).symlink_to(REPO / name)
    (root / ".venv").symlink_to(sys.prefix)
    return root


def _run(argv: list[str], cwd: Path, env: dict, monkeypatch) -> None:
    call = _in_process(argv)
    if call is not None:
        monkeypatch.chdir(cwd)
        code = call()
        assert code == 0, f"{shlex.join(argv)} exited {code}"
        return
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{shlex.join(argv)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-3000:]}"


@pytest.mark.slow  # over ~20 s alone
def test_every_readme_example_runs_after_the_quickstart(workspace, monkeypatch):
    commands = readme_commands()
    assert len(commands) >= 10 and all(" runs/tiny_taper" not in c for c in commands)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "QUICKSTART_INSTALL": "0",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    _run(tiny_steps(["bash", "launch/quickstart.sh"]), workspace, env, monkeypatch)
    assert (workspace / "runs" / "quickstart" / "checkpoints" / "step-1").is_dir()
    has_lm_eval = importlib.util.find_spec("lm_eval") is not None
    for command in commands:
        argv = shlex.split(command, comments=True)
        if "megatron_taper.inference.lm_eval_adapter" in argv and not has_lm_eval:
            continue  # the optional extra (pip install -e ".[lmeval]") is not installed here
        _run(tiny_steps(argv), workspace, env, monkeypatch)
    for made in ("runs/tiny_taper/checkpoints/step-1", "runs/tiny_tp2/checkpoints/step-1", "runs/tiny_auto",
                 "exported/quickstart/model.safetensors", "runs/finetune/checkpoints/step-1", "hf/quickstart",
                 "runs/from_hf/checkpoints/step-1"):
        assert (workspace / made).exists(), made
