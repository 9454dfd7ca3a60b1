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
