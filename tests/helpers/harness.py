"""Run a function on N gloo processes from inside pytest: megatron_taper.parallel.spawn's launcher
on the CPU (tests are gloo runs on any machine), its fork server also preloading pytest.

    from tests.helpers.harness import run_distributed

    def _check(tp):            # module level, so child processes can import it
        ...                    # torch.distributed is initialised (gloo); RANK, WORLD_SIZE,
        return something       # LOCAL_RANK, MASTER_ADDR/PORT are set; return value is pickled

    def test_x():
        results = run_distributed(_check, 2, 2, timeout=60)   # one result per rank

A rank that raises fails the test with that rank's traceback (DistributedTestError); spawn.py's
docstring says the rest.
"""
from __future__ import annotations

from typing import Any, Callable

from megatron_taper.parallel.spawn import PRELOAD
from megatron_taper.parallel.spawn import RankFailure as DistributedTestError
from megatron_taper.parallel.spawn import run_distributed as _run_distributed

__all__ = ["DistributedTestError", "run_distributed"]

# test modules import pytest: the fork server imports it once for every child
TEST_PRELOAD = (*PRELOAD, "pytest")


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                    env: dict[str, str] | None = None) -> list[Any]:
    """Run fn(*args) on `world_size` gloo processes; return the per-rank results (rank order)."""
    return _run_distributed(fn, world_size, *args, timeout=timeout, env=env, device="cpu", preload=TEST_PRELOAD)
