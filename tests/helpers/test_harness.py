"""The multi-process harness itself: results, a failing rank's traceback, no hang, timeout."""
import time

import pytest

from tests.helpers.harness import DistributedTestError, run_distributed

pytestmark = pytest.mark.multiprocess


def _sum_ranks(scale):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return scale * t.item(), dist.get_rank()


def _rank1_raises():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("boom on rank one")
    dist.barrier()  # rank 0 would wait forever for rank 1


def _sleeps():
    time.sleep(60)


def test_results_in_rank_order():
    assert run_distributed(_sum_ranks, 3, 2.0, timeout=60) == [(6.0, 0), (6.0, 1), (6.0, 2)]


def test_failing_rank_reports_traceback_without_hanging():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="(?s)rank 1 .*boom on rank one"):
        run_distributed(_rank1_raises, 2, timeout=60)
    assert time.monotonic() - start < 30


def test_timeout():
    with pytest.raises(DistributedTestError, match="timed out"):
        run_distributed(_sleeps, 2, timeout=3)
