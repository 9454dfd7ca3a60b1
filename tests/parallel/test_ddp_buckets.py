"""The DDP bucket-size rule (parallel/dp/ddp.py bucket_mb): a configured size wins; 0 scales
with dp (Megatron-LM's max(40M, 1M x dp) elements) and is capped by the module's size. The DDP
runs that use it are tests/parallel/test_step_engines.py::test_ddp_matches_one_process."""
import torch
from torch import nn

from megatron_taper.cost.step_time import DDP_MIN_BUCKET_ELEMENTS as MIN_BUCKET_ELEMENTS
from megatron_taper.parallel.dp.ddp import bucket_mb

MIB = 2**20


def _module(elements: int) -> nn.Module:
    module = nn.Module()
    module.weight = nn.Parameter(torch.empty(elements, device="meta"))
    return module


def test_configured_size_wins():
    assert bucket_mb(25.0, _module(10**9), dp=512) == 25.0


def test_scales_with_dp_for_a_large_model():
    big = _module(10**10)
    assert bucket_mb(0.0, big, dp=8) * MIB == 40_000_000 * 4  # up to dp = 40: 40M fp32 elements
    assert bucket_mb(0.0, big, dp=40) * MIB == 40_000_000 * 4
    assert bucket_mb(0.0, big, dp=512) * MIB == 512_000_000 * 4  # then 1M elements per dp rank


def test_capped_by_the_module():
    assert bucket_mb(0.0, _module(100_000_000), dp=8) * MIB == 25_000_000 * 4  # four buckets
    assert bucket_mb(0.0, _module(1000), dp=8) * MIB == MIN_BUCKET_ELEMENTS * 4  # floor: 1 MiB
    frozen = _module(100_000_000)
    frozen.weight.requires_grad_(False)
    assert bucket_mb(0.0, frozen, dp=8) * MIB == MIN_BUCKET_ELEMENTS * 4  # trainable elements only
