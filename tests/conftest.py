"""Fixtures shared by the whole suite, and its markers.

tests/ is a package tree mirroring megatron_taper/ (one folder per feature); shared helpers live
in tests/helpers and are imported as `tests.helpers.<name>` (pytest puts the repository root on
sys.path). Markers (pytest.ini): `multiprocess` (gloo process groups or torchrun), `slurm` (a
throw-away Slurm cluster), `slow` (over ~20 s alone); e.g. `bash tests/run.sh -m "not slurm"`.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.runner import stdlib_bytes


@pytest.fixture(scope="session")
def byte_tokens(tmp_path_factory) -> str:
    """A .npy file of the standard library's bytes as tokens (vocab 256)."""
    path = tmp_path_factory.mktemp("tokens") / "stdlib_bytes.npy"
    np.save(path, np.frombuffer(stdlib_bytes(), dtype=np.uint8).astype(np.uint16))
    return str(path)


def _file_weight(items: list[pytest.Item]) -> float:
    """A rough cost of a test file from its markers: a Slurm cluster or a slow test ~20 s, a run
    of several processes ~5 s, anything else well under a second."""
    cost = {"slurm": 20.0, "slow": 20.0, "multiprocess": 5.0}
    return sum(max((cost[m.name] for m in item.iter_markers() if m.name in cost), default=0.5) for item in items)


def pytest_collection_modifyitems(session, config, items):
    """The costliest files first (their tests in their own order): pytest-xdist's loadfile hands out
    files in this order under --no-loadscope-reorder (tests/run.sh passes it; by default xdist
    re-sorts files by their number of tests), so the long ones start early instead of leaving one
    worker running alone at the end."""
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    order = sorted(by_file, key=lambda f: -_file_weight(by_file[f]))
    items[:] = [item for f in order for item in by_file[f]]
