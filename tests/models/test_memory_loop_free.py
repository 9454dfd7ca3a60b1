"""The linear memory's loop-free chunkwise form and Memory Caching's batched segments against the
loops they replaced (tests/helpers/memory_caching_reference.py: one Python iteration per chunk and
per segment, the definition of the chunked math), in float64 to 1e-10 (measured: reads ~1e-16,
gradients ~1e-14 with gates sharpened x50); float32 within 1e-5 of the float64 loop (measured
~1e-7: the forms only reorder sums). And the operator count the trainer pays: independent of the
sequence length for the linear memory."""
import itertools

import pytest
import torch

from megatron_taper.config import load_config
from megatron_taper.cost.op_count import dispatched_ops, narrowed
from tests.helpers.memory_caching_reference import loop_linear_scan, loop_reads
from tests.helpers.runner import REPO
from tests.models.test_memory_caching import mixer_case


def linear_case(seq: int, dtype=torch.float64):
    """A linear memory (layer 0's base, float64) with sharpened gates, and its features for x [2, seq, D]."""
    mixer, _ = mixer_case("linear_memory", "none")
    memory = mixer.memory.to(dtype)
    torch.manual_seed(1)
    x = torch.randn(2, seq, memory.wq.in_features, dtype=dtype)
    return memory, x


def grads(out, inputs):
    return torch.autograd.grad(out.square().sum(), inputs, allow_unused=True)


def assert_all_close(a, b, tol):
    for u, v in zip(a, b):
        if u is None or v is None:
            assert u is None and v is None
            continue
        torch.testing.assert_close(u, v, rtol=tol, atol=tol)


@pytest.mark.parametrize("seq, chunk", [(24, 4), (26, 4), (26, 7), (5, 8), (9, 1)])
def test_linear_scan_equals_the_chunk_loop(seq, chunk):
    memory, x = linear_case(seq)
    features = tuple(f.detach().requires_grad_() for f in memory.project(x, x)[0])
    start = torch.randn(2, features[0].shape[1], memory.head_dim, memory.head_dim, dtype=torch.float64,
                        requires_grad=True)
    gamma = torch.rand(2, features[0].shape[1], seq, 1, dtype=torch.float64)

    def mix(layer, r, read, positions):  # a per-token hook that also reads the query, like soup's
        return gamma[:, :, positions] * read + r.flip(-1)

    for hook in (None, mix):
        reads, state = memory.scan_features(features, ([start], []), chunk, mix=hook)
        ref, ref_state = loop_linear_scan(memory, features, ([start], []), chunk, mix=hook)
        torch.testing.assert_close(reads, ref, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(state[0][0], ref_state[0][0], rtol=1e-10, atol=1e-12)
        loss = reads.square().sum() + state[0][0].sin().sum()
        ref_loss = ref.square().sum() + ref_state[0][0].sin().sum()
        assert_all_close(torch.autograd.grad(loss, [*features, start]),
                         torch.autograd.grad(ref_loss, [*features, start]), 1e-10)


VARIANTS = ["none", "residual", "grm", "soup", "ssc"]
SHAPES = [(), ("model.memory_caching.segment=13",),
          ("model.memory_caching.linear_chunk=3", "model.titans.chunk_size=3"), ("model.titans.chunk_size=16",)]
CASES = [(arch, variant, mode, extra)
         for arch, variant, mode, extra in itertools.product(
             ["linear_memory", "deep_memory"], VARIANTS, ["checkpoint", "independent"], SHAPES)
         if not (variant == "none" and mode == "independent")]


@pytest.mark.parametrize("arch, variant, mode, extra", CASES)
def test_mixer_equals_the_segment_loop(arch, variant, mode, extra):
    """Every variant and write mode over both bases; segments of 6 in 26 tokens (a short last one),
    of 13 (whole: the deep memory folds independent segments into the batch), chunks not aligned."""
    mixer, x = mixer_case(arch, variant, f"model.memory_caching.write_mode={mode}", *extra)
    x.requires_grad_()
    inputs = [x, *mixer.parameters()]
    out, ref = mixer.reads(x), loop_reads(mixer, x)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    assert_all_close(grads(out, inputs), grads(ref, inputs), 1e-10)


@pytest.mark.parametrize("arch", ["linear_memory", "deep_memory"])
def test_float32_is_near_the_float64_loop(arch):
    mixer, x = mixer_case(arch, "grm")
    ref = loop_reads(mixer, x)
    out = mixer.float().reads(x.float())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_linear_memory_operators_do_not_grow_with_the_sequence():
    """One block's forward + backward operators (cost/op_count.py's count) at 1024 and 4096 tokens,
    the 760M recipe's structure at narrowed widths: equal (measured 690 and 690, every variant's
    segment loop and chunk loop gone)."""
    cfg = load_config(str(REPO / "configs/linear_memory_caching_760m_taper.yaml"), []).model
    per_block = []
    for seq in (1024, 4096):
        one, two = (dispatched_ops(narrowed(cfg, n, seq))[1] for n in (1, 2))
        per_block.append(two - one)
    assert per_block[1] == pytest.approx(per_block[0], rel=0.10)
    assert per_block[0] < 1000


def test_state_passing_under_autocast_keeps_fp32_states():
    """Under bf16 autocast the torch state passing runs in the states' fp32, as the loop's elementwise
    update did (measured 1e-7 relative against float64; a bf16 product rounds every state to ~4e-3)."""
    from megatron_taper.models.kernels.state_passing import chunk_states_torch

    torch.manual_seed(0)
    updates = torch.randn(2, 2, 16, 16, 16).to(torch.bfloat16)
    log_decays, initial = -0.1 * torch.rand(2, 2, 16), torch.zeros(2, 2, 16, 16)
    want = chunk_states_torch(updates.double(), log_decays.double(), initial.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunk_states_torch(updates, log_decays, initial)
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max()
