"""Several cases on one set of gloo processes: one launch instead of one per case, so each rank
imports (DeepSpeed, the Trainer's modules) and warms up once.

    from tests.helpers.sessions import run_cases

    fitted, prepared, resumed = run_cases(2, [(_fit, (args_a,)), (_prepare, (folder,)), (_fit, (args_b,))])

Each case is (module-level function, its arguments); the ranks run the cases in order, with a
barrier after each (a case may read what an earlier one wrote); the result is, per case, the list
of the ranks' return values (rank order). A case that raises fails the whole launch with that
rank's traceback (harness.run_distributed).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from tests.helpers.harness import run_distributed

Case = tuple[Callable[..., Any], Sequence[Any]]


def run_cases(world_size: int, cases: list[Case], timeout: float = 300.0,
              env: dict[str, str] | None = None) -> list[list[Any]]:
    """Run `cases` one after another on `world_size` gloo processes; per case, the per-rank results."""
    ranks = run_distributed(_run_in_order, world_size, cases, timeout=timeout, env=env)
    return [[rank[i] for rank in ranks] for i in range(len(cases))]


def _run_in_order(cases: list[Case]) -> list[Any]:
    import torch.distributed as dist

    out = []
    for fn, args in cases:
        out.append(fn(*args))
        dist.barrier()
    return out
