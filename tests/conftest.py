"""Fixtures shared by the whole suite."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import runner` from any test folder
from runner import stdlib_bytes  # noqa: E402


@pytest.fixture(scope="session")
def byte_tokens(tmp_path_factory) -> str:
    """A .npy file of the standard library's bytes as tokens (vocab 256)."""
    path = tmp_path_factory.mktemp("tokens") / "stdlib_bytes.npy"
    np.save(path, np.frombuffer(stdlib_bytes(), dtype=np.uint8).astype(np.uint16))
    return str(path)
