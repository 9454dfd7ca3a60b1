"""Chunked cross entropy (parallel/loss.py) against F.cross_entropy on the whole logits.

Values and gradients at tp = 1 (fp32 and bf16 logits) and tp = 2 (gloo, uneven vocabulary
shards), chunks that do not divide the token count, ignored targets (some, none, all) and a
non-unit upstream gradient. Tolerances: fp32 sums in another order, so the loss within 1e-6
relative (measured <= 8.6e-8: about one float32 ulp at loss ~4) and gradients within 1e-7
absolute (entries <= 0.7 / tokens; measured <= 1.9e-8). bf16 logits: both compute in fp32 and
round the gradient to bf16 once, so gradients agree within one bf16 ulp (2^-8 relative) of the
reference (measured: identical).
The end-to-end run (build_run with train.loss_chunk at tp = 2 against one process) is a case of
tests/parallel/test_tensor_parallel.py::test_tp_matches_one_process.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_taper.models.layers import IGNORE_INDEX
from megatron_taper.parallel.loss import chunked_cross_entropy, loss_function
from megatron_taper.parallel.tp.layers import split_sizes
from tests.helpers.harness import run_distributed

VOCAB, CHUNK = 11, 4  # 15 tokens: chunks of 4, 4, 4, 3


def _cases():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, VOCAB) * 3
    targets = torch.randint(0, VOCAB, (3, 5))
    targets[0, :2] = IGNORE_INDEX
    targets[2, 4] = IGNORE_INDEX
    targets[1, 0], targets[1, 1] = 5, 6  # the last id of tp=2 shard 0 and the first of shard 1
    return logits, {"some_ignored": targets, "none_ignored": targets.clamp(min=0),
                    "all_ignored": torch.full_like(targets, IGNORE_INDEX)}


def _compare(logits, targets, dtype, loss_fn, lo=0, hi=VOCAB):
    """(loss, reference loss, gradient of the [lo, hi) slice, reference gradient of that slice)."""
    full = logits.to(dtype, copy=True).requires_grad_()
    want = F.cross_entropy(full.flatten(0, 1).float(), targets.flatten())
    want.backward(torch.tensor(0.7))  # a non-unit upstream gradient (loss scaling, accumulation)
    local = logits[..., lo:hi].to(dtype, copy=True).requires_grad_()
    got = loss_fn(local, targets)
    got.backward(torch.tensor(0.7))
    return got.item(), want.item(), local.grad, full.grad[..., lo:hi]


def _check(name, loss, want, grad, want_grad, bf16=False):
    if name == "all_ignored":  # F.cross_entropy: NaN loss (0 / 0), zero gradient
        assert math.isnan(loss) and math.isnan(want), (loss, want)
        assert torch.equal(grad, torch.zeros_like(grad)) and torch.equal(want_grad, grad)
        return
    assert abs(loss - want) <= 1e-6 * abs(want), (name, loss, want)
    err = (grad.float() - want_grad.float()).abs()
    limit = want_grad.float().abs() * 2**-8 + 1e-30 if bf16 else 1e-7
    assert (err <= limit).all(), (name, err.max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_matches_plain_one_process(dtype):
    logits, cases = _cases()
    fn = loss_function(CHUNK)
    for name, targets in cases.items():
        _check(name, *_compare(logits, targets, dtype, fn), bf16=dtype == torch.bfloat16)
    # the unchunked choice is the plain loss, and one chunk holding every token is equal too
    assert loss_function(0).__name__ == "cross_entropy"
    one = chunked_cross_entropy(logits, cases["none_ignored"], chunk=1000)
    assert abs(one.item() - F.cross_entropy(logits.flatten(0, 1), cases["none_ignored"].flatten()).item()) < 1e-5


def _tp_worker():
    import torch.distributed as dist

    group, rank = dist.group.WORLD, dist.get_rank()
    sizes = split_sizes(VOCAB, 2, 1)  # [6, 5]: uneven vocabulary shards
    lo = sum(sizes[:rank])
    logits, cases = _cases()
    fn = loss_function(CHUNK, group, lo)
    return {name: _compare(logits, targets, torch.float32, fn, lo, lo + sizes[rank]) for name, targets in cases.items()}


@pytest.mark.multiprocess
def test_chunked_vocab_parallel_matches_plain():
    for result in run_distributed(_tp_worker, 2, timeout=60):
        for name, values in result.items():
            _check(name, *values)
        ignored = result["some_ignored"][2][0, :2]
        assert torch.equal(ignored, torch.zeros_like(ignored))  # ignored positions: exactly 0 gradient
