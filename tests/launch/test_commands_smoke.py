"""Every command answers `--help` with exit 0 and a usage line: the console entry points (setup.py's
console_scripts), every tools/*.py and every benchmarks/*.py. The list is read from setup.py and
the folders, so a new script is covered without editing this file; a file that is not a command
(no `if __name__ == "__main__":`: a module other scripts import) is reported as skipped, by name.

Fast on purpose: no interpreter per command (importing torch costs seconds each). A small driver
runs a batch of commands in one fresh interpreter, each as Python would run it (a file through
runpy as __main__ with its folder first on sys.path; an entry point by calling its function) under
sys.argv = [command, "--help"], catching SystemExit; BATCHES such interpreters run at once.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.runner import REPO

BATCHES = 2
# console scripts that wrap an optional extra's own command line: skipped where the extra is missing
NEEDS = {"megatron-taper-lm-eval": ("lm_eval", "lm-evaluation-harness (the .[lmeval] extra)")}
DRIVER = r"""
import contextlib, importlib, io, json, os, runpy, sys, traceback

jobs, answers = json.loads(sys.argv[1]), {}
for name, kind, target in jobs:
    out, argv, path = io.StringIO(), sys.argv[:], sys.path[:]
    code = "returned without exiting (no --help?)"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                if kind == "file":
                    sys.argv = [target, "--help"]
                    sys.path.insert(0, os.path.dirname(target))
                    runpy.run_path(target, run_name="__main__")
                else:
                    module, function = target.split(":")
                    sys.argv = [name, "--help"]
                    sys.exit(getattr(importlib.import_module(module), function)())  # as the console script
            except SystemExit as e:
                code = 0 if e.code is None else e.code
    except BaseException:  # noqa: BLE001 - reported by the test
        code = "raised:\n" + traceback.format_exc()[-3000:]
    finally:
        sys.argv, sys.path[:] = argv, path
    text = out.getvalue()  # its head (the usage line) and its tail (an error), where it is long
    text = text if len(text) <= 6000 else text[:3000] + "\n[...]\n" + text[-3000:]
    answers[name] = {"code": code if isinstance(code, (int, str)) else repr(code), "output": text}
with open(sys.argv[2], "w") as f:
    json.dump(answers, f)
"""


def console_scripts() -> dict[str, str]:
    """name -> "module:function" of setup.py's console_scripts (read from its source, not the install)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "entry_points":
            entries = ast.literal_eval(node.value)["console_scripts"]
            return {name.strip(): target.strip() for name, target in (e.split("=") for e in entries)}
    raise AssertionError("setup.py has no entry_points")


def is_command(path) -> bool:
    """Whether the file runs something as a script (has an `if __name__ == "__main__":` block)."""
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
               for node in ast.parse(path.read_text()).body)


def commands() -> tuple[list[tuple[str, str, str]], dict[str, str]]:
    """([(name, "entry" | "file", target)], {skipped name: why})."""
    jobs, skipped = [], {}
    for name, target in sorted(console_scripts().items()):
        module, what = NEEDS.get(name, (None, ""))
        if module and importlib.util.find_spec(module) is None:
            skipped[name] = f"wraps the command line of {what}, not installed here"
        else:
            jobs.append((name, "entry", target))
    for folder in ("tools", "benchmarks"):
        for path in sorted((REPO / folder).glob("*.py")):
            name = f"{folder}/{path.name}"
            if path.name == "__init__.py":
                continue
            if is_command(path):
                jobs.append((name, "file", str(path)))
            else:
                skipped[name] = "not a command: no `if __name__ == \"__main__\":` (a module other scripts import)"
    return jobs, skipped


JOBS, SKIPPED = commands()


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> dict:
    """Every command's answer to --help, from BATCHES driver processes running side by side."""
    folder = tmp_path_factory.mktemp("help")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    procs = []
    for i in range(BATCHES):
        out = folder / f"batch{i}.json"
        procs.append((out, subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(JOBS[i::BATCHES]), str(out)],
                                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            text=True)))
    found = {}
    for out, proc in procs:
        log, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0 and out.exists(), f"the driver failed:\n{log[-3000:]}"
        found |= json.loads(out.read_text())
    return found


def test_every_command_is_listed():
    """The console scripts, the tools and the benchmarks are all here; a skip names its reason."""
    names = {name for name, _, _ in JOBS}
    assert {"megatron-taper-train", "tools/show_model.py", "benchmarks/cpu_profile.py"} <= names
    assert len([n for n in {*names, *SKIPPED} if n.startswith("megatron-taper-")]) == len(console_scripts())
    assert not names & set(SKIPPED)


@pytest.mark.parametrize("name", [name for name, _, _ in JOBS] + [
    pytest.param(name, marks=pytest.mark.skip(reason=f"{name}: {why}")) for name, why in SKIPPED.items()])
def test_command_answers_help(answers, name):
    answer = answers[name]
    assert answer["code"] == 0, f"{name} --help: exit {answer['code']}\n{answer['output']}"
    assert re.search(r"(?im)^usage:", answer["output"]), f"{name} --help printed no usage line:\n{answer['output']}"
