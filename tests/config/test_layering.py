"""The layers of the package (README.md "Layout"), enforced on the import graph.

- every module imports (at module level) only from its own floor or the floors below (FLOORS);
- config (the ground floor), taper, validation, the family registry and cards, and the cost model
  import no torch at module level, and importing config loads no torch at all;
- `megatron-taper-train --print-config` and `--list-keys` import no torch, nor do the start-up
  checks of a launch (megatron_taper.launch_check) on a .npy token file;
- models import nothing from parallel at module level;
- the training loop (megatron_taper.train, .trainer and everything they import at module level)
  imports no post-training code (megatron_taper.inference).
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from tests.config.test_imports import imports_of, package_modules
from tests.helpers.runner import REPO

MODULES = package_modules()
TORCH_FREE = ["megatron_taper.config", "megatron_taper.recipe", "megatron_taper.taper", "megatron_taper.validation",
              "megatron_taper.cli",
              "megatron_taper.models", "megatron_taper.models.cards", "megatron_taper.models.spec",
              # each family's cost terms, TP plan and layout checks (and, through their package, its SPECS)
              *[m for m in MODULES if m.startswith("megatron_taper.models.") and m.endswith((".cost", ".parallel"))],
              "megatron_taper.train", "megatron_taper.console",
              "megatron_taper.launch_check",
              *[m for m in MODULES if m.startswith("megatron_taper.cost")]]


def _module_level_nodes(body: list[ast.stmt]):
    """Statements that run on import: into if / try / with blocks (not `if TYPE_CHECKING:`), not into functions."""
    for node in body:
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _module_level_nodes(node.orelse)
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    yield from _module_level_nodes(child.body if isinstance(child, ast.ExceptHandler) else [child])


def module_level_imports(name: str) -> set[str]:
    """Every module `name` imports at module level (outside functions and TYPE_CHECKING), third-party too."""
    tree = ast.parse(MODULES[name].read_text())
    found = set()
    for node in _module_level_nodes(tree.body):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def _top_level(name: str) -> set[str]:
    """Package modules imported at module level, by walking only module-level statements."""
    return {m for m in module_level_imports(name) if m in MODULES}


def _closure(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += [m for m in _top_level(name) if m not in seen]
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in MODULES]
    return seen


# floor of each part of the package, longest prefix wins; a module-level import never goes up
FLOORS = {
    "megatron_taper": 0, "megatron_taper.validation": 0, "megatron_taper.taper": 0, "megatron_taper.recipe": 0,
    "megatron_taper.models.spec": 0, "megatron_taper.models.cards": 0,  # the torch-free half of the families
    "megatron_taper.config": 1, "megatron_taper.cli": 1, "megatron_taper.models": 1,  # the registry
    "megatron_taper.cost": 2, "megatron_taper.training.metrics": 2,
    # each family's torch-free half: its cost terms, TP plan and layout checks
    **{m: 2 for m in MODULES if m.startswith("megatron_taper.models.") and m.endswith((".cost", ".parallel"))},
    "megatron_taper.models.*": 3, "megatron_taper.checkpoint.files": 3,  # family code; the checkpoint format
    "megatron_taper.parallel": 4, "megatron_taper.data": 4, "megatron_taper.training.optim": 4,
    "megatron_taper.checkpoint": 5, "megatron_taper.console": 5,
    "megatron_taper.fault": 5,
    "megatron_taper.launch_check": 6,
    "megatron_taper.training.build": 6, "megatron_taper.training.held_out": 6, "megatron_taper.training.carried": 6,
    "megatron_taper.training.run_lock": 6, "megatron_taper.training.stop": 6, "megatron_taper.training.state": 6,
    "megatron_taper.training.run_folder": 6, "megatron_taper.training.step_log": 6,
    "megatron_taper.training.checkpointing": 6, "megatron_taper.training.experts": 6,
    "megatron_taper.training.trainer": 7, "megatron_taper.train": 8,
    "megatron_taper.inference": 9, "megatron_taper.sweep": 9,
}


def floor(module: str) -> int:
    def matches(prefix: str) -> bool:
        if prefix.endswith(".*"):
            return module.startswith(prefix[:-1])
        return module == prefix or module.startswith(prefix + ".")

    return FLOORS[max((p for p in FLOORS if matches(p)), key=len)]


def test_no_module_imports_from_a_floor_above_it():
    upward = [f"{m} (floor {floor(m)}) imports {t} (floor {floor(t)})"
              for m in MODULES for t in _top_level(m) if t != "megatron_taper" and floor(t) > floor(m)]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("name", TORCH_FREE)
def test_ground_floor_and_cost_model_import_no_torch_at_module_level(name):
    closure = _closure(name)
    heavy = {m: sorted(i for i in module_level_imports(m) if i.split(".")[0] == "torch") for m in closure}
    assert not {m: t for m, t in heavy.items() if t}, f"{name} reaches torch at module level through {heavy}"


def test_models_import_nothing_from_parallel_at_module_level():
    for name in MODULES:
        if name.startswith("megatron_taper.models"):
            bad = sorted(m for m in _top_level(name) if m.startswith("megatron_taper.parallel"))
            assert not bad, f"{name} imports {bad} at module level"


def test_training_loop_imports_no_post_training_code():
    for start in ("megatron_taper.train", "megatron_taper.training.trainer"):
        bad = sorted(m for m in _closure(start) if m.startswith("megatron_taper.inference"))
        assert not bad, f"{start} reaches {bad} at module level"
        anywhere = {m for n in _closure(start) for m in imports_of(n, MODULES[n], MODULES)}
        assert not sorted(m for m in anywhere if m.startswith("megatron_taper.inference")), start


def _no_torch(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code + "\nimport sys\nassert 'torch' not in sys.modules, "
                           "sorted(m for m in sys.modules if m.startswith('torch'))[:5]"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_config_and_info_flags_load_no_torch():
    proc = _no_torch("import megatron_taper.config\n"
                     "from megatron_taper.config import load_config\n"
                     "load_config('configs/tiny_titans.yaml', ['model.titans.window=8'])")
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = _no_torch("from megatron_taper.train import main\n"
                     "assert main(['--config', 'configs/tiny_taper.yaml', '--print-config']) == 0\n"
                     "assert main(['--list-keys']) == 0\n"
                     "assert main(['--config', 'configs/tiny_taper.yaml', '--print-config', 'model.nlayers=2']) == 2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "model:\n  arch: transformer" in proc.stdout and "did you mean 'model.n_layers'" in proc.stderr
    # the start-up checks every torchrun.sh / train.sbatch launch runs first, on a .npy token file
    proc = _no_torch("import os, tempfile\nimport numpy as np\nfrom megatron_taper.launch_check import main\n"
                     "d = tempfile.mkdtemp()\nnp.save(d + '/t.npy', np.arange(8192, dtype=np.uint16) % 256)\n"
                     "assert main(['--config', 'configs/tiny_taper.yaml', '--world-size', '2', '--print-run-dir', "
                     "'model.vocab_size=256', f'data.path={d}/t.npy', f'run.dir={d}/run']) == 0")
    assert proc.returncode == 0, proc.stderr[-2000:]
