"""Titans' banded sliding-window attention kernels against the dense-mask reference, and the
depthwise causal convolution on the memory's q, k, v against the token-by-token reference.

Tolerances (fp32 unless said): kernels vs the dense reference 1e-5 abs on outputs and input
gradients (measured max 4.8e-7 on outputs, blockwise and FlexAttention alike, 3.8e-6 on
gradients); a whole Titans model with the banded kernel vs the same model with the dense one
1e-5 abs on logits (measured 2.4e-7); the memory with the convolution at chunk 1 vs the
recurrence in float64: reads 1e-12 relative (measured 6e-16), state 1e-10; chunked at C > 1
within test_arch_families.CHUNK_TOLERANCE (measured 0.6-1.1e-3 at C=2 ... 0.6-1.0e-2 at C=16).
"""
import warnings

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask
from torch.utils.flop_counter import FlopCounterMode

from megatron_taper.config import load_config
from megatron_taper.cost.flops import model_costs
from megatron_taper.models import build_model
from megatron_taper.models.layers import Attention
from megatron_taper.models.local_attention import (
    band_block_mask,
    blockwise_window_attention,
    flex_window_attention,
    sliding_window_attention,
    window_visible,
)
from megatron_taper.models.titans.convolution import causal_conv
from megatron_taper.models.titans.cost import blockwise_pairs
from megatron_taper.models.titans.model import RowAttention, context_rows_mask, masked_attention
from tests.helpers.titans_reference import dense_window_attention, reference_features, reference_scan
from tests.models.test_arch_families import CHUNK_TOLERANCE, SEQ, build, memory_case

ATOL = 1e-5


def qkv(seq: int, prefix: int, heads: int = 4, kv_heads: int = 2, dim: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, seq, dim, generator=g)
    k, v = (torch.randn(2, kv_heads, prefix + seq, dim, generator=g) for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v)]


def outputs_and_grads(kernel, q, k, v, prefix, window):
    out = kernel(q, k, v, prefix=prefix, window=window)
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.shape[-1])).sum(), (q, k, v))
    return out, grads


def flex_eager(q, k, v, prefix, window):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        return flex_window_attention(q, k, v, prefix, window, compiled=False)


WINDOW_CASES = [(48, 3, 48), (48, 3, 12), (48, 3, 1), (48, 0, 12), (37, 4, 10), (20, 2, 64), (150, 5, 40)]


@pytest.mark.parametrize("seq,prefix,window", WINDOW_CASES)
def test_blockwise_kernel_matches_the_dense_mask(seq, prefix, window):
    q, k, v = qkv(seq, prefix)
    ref, ref_grads = outputs_and_grads(dense_window_attention, q, k, v, prefix, window)
    out, grads = outputs_and_grads(blockwise_window_attention, q, k, v, prefix, window)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL)


@pytest.mark.parametrize("seq,prefix,window", WINDOW_CASES)
def test_flex_kernel_matches_the_dense_mask(seq, prefix, window):
    """Forward only: FlexAttention has no backward on CPU (its eager form runs here, the compiled
    one on CUDA with the same block mask)."""
    q, k, v = (t.detach() for t in qkv(seq, prefix))
    torch.testing.assert_close(flex_eager(q, k, v, prefix, window), dense_window_attention(q, k, v, prefix, window),
                               rtol=0, atol=ATOL)


def test_the_kernel_is_chosen_from_the_device():
    q, k, v = qkv(40, 2)
    assert torch.equal(sliding_window_attention(q, k, v, 2, 8), blockwise_window_attention(q, k, v, 2, 8))


@pytest.mark.parametrize("seq,prefix,window,block", [(300, 4, 64, 128), (1000, 16, 200, 128), (130, 0, 1, 64),
                                                     (64, 3, 100, 16)])
def test_band_block_mask_visits_the_blocks_create_block_mask_visits(seq, prefix, window, block):
    ours = band_block_mask(seq, prefix, window, torch.device("cpu"), block)
    theirs = create_block_mask(window_visible(prefix, window), None, None, seq, prefix + seq, "cpu", BLOCK_SIZE=block)
    assert torch.equal(ours.to_dense(), theirs.to_dense())  # the kv blocks each q block visits
    dense = window_visible(prefix, window)(0, 0, torch.arange(seq)[:, None], torch.arange(prefix + seq)[None, :])
    full = ours.full_kv_indices[0, 0]
    for qb, count in enumerate(ours.full_kv_num_blocks[0, 0].tolist()):  # `full` blocks: every valid pair visible
        for kb in full[qb, :count].tolist():
            assert dense[qb * block:(qb + 1) * block, kb * block:(kb + 1) * block].all(), (qb, kb)


def test_blockwise_work_grows_with_seq_times_window():
    assert blockwise_pairs(4096, 0, 64) == 64 * 64 + 63 * 64 * 128  # ~2 S W, not S^2 / 2
    assert blockwise_pairs(8192, 4, 64) < 2.01 * blockwise_pairs(4096, 4, 64)
    assert blockwise_pairs(40, 3, 64) == 40 * 43  # W >= S: one block, plain causal attention


@pytest.mark.parametrize("variant", ["mag", "mal"])
@pytest.mark.parametrize("window", [SEQ, SEQ // 4, 1, 7])
def test_titans_with_the_banded_kernel_matches_the_dense_one(variant, window):
    cfg, model = build(f"titans_{variant}", f"model.titans.window={window}")
    tokens = torch.randint(0, cfg.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        banded = model(tokens)
        for block in model.layers.values():
            block.window_kernel = dense_window_attention
        dense = model(tokens)
    torch.testing.assert_close(banded, dense, rtol=0, atol=ATOL)


def full_context_mask(prefix: int, seg: int) -> torch.Tensor:
    """The MAC context mask over all P + 2L rows of [P, h, x] (what MACBlock computed before)."""
    pos = torch.cat((torch.full((prefix,), -1), torch.arange(seg), torch.arange(seg)))
    is_x = torch.arange(prefix + 2 * seg) >= prefix + seg
    return ((pos[None, :] <= pos[:, None]) & (is_x[:, None] | ~is_x[None, :])) | (pos[None, :] < 0)


def test_mac_rows_attention_matches_attention_over_the_whole_context():
    torch.manual_seed(0)
    prefix, seg, dim = 3, 6, 32
    attn, rows = Attention(dim, 4, 2, 8), RowAttention(dim, 4, 2, 8)
    rows.load_state_dict(attn.state_dict())
    x = torch.randn(2, prefix + 2 * seg, dim)
    cos, sin = torch.randn(prefix + 2 * seg, 4), torch.randn(prefix + 2 * seg, 4)
    full = attn.wo(attn.attend(x, cos, sin, full_context_mask(prefix, seg))[:, prefix + seg:].flatten(2))
    mask = context_rows_mask(prefix, seg, x.device)
    out = rows(x, cos, sin, prefix + seg, lambda q, k, v: masked_attention(q, k, v, mask))
    torch.testing.assert_close(out, full, rtol=0, atol=ATOL)


# -- the depthwise causal convolution on the memory's q, k, v ----------------------------------


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("taps", [4, 2])
def test_memory_with_convolution_matches_the_token_by_token_recurrence(depth, taps):
    memory, x_kv, x_q, state = memory_case(depth, f"model.titans.conv_kernel={taps}")
    with torch.no_grad():
        memory.conv_k.normal_(generator=torch.Generator().manual_seed(2))  # taps far from the identity init
    ref, (ref_w, ref_s) = reference_scan(memory, x_kv, x_q, state)
    out, (w, s) = memory.scan(x_kv, x_q, state, chunk_size=1)
    assert ((out - ref).norm() / ref.norm()).item() < CHUNK_TOLERANCE[1]
    for a, b in zip(w + s, ref_w + ref_s):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for chunk in (4, 8):
        out, _ = memory.scan(x_kv, x_q, state, chunk_size=chunk)
        assert ((out - ref).norm() / ref.norm()).item() <= CHUNK_TOLERANCE[chunk]


def test_convolution_is_causal_with_a_reach_of_its_taps():
    memory, x_kv, x_q, _ = memory_case(2, "model.titans.conv_kernel=3")
    changed = x_kv.clone()
    changed[:, 10] += 1.0
    (k, v, *_), _ = memory.project(x_kv, x_q)
    (k2, v2, *_), _ = memory.project(changed, x_q)
    touched = ((k - k2).abs().amax(dim=(0, 1, 3)) > 0).nonzero().flatten().tolist()
    assert touched == [10, 11, 12]  # token t sees tokens t-2..t only


@pytest.mark.parametrize("cut", [1, 2, 9])
def test_projection_continues_across_calls_through_its_past(cut):
    memory, x_kv, x_q, _ = memory_case(1)
    whole, _ = memory.project(x_kv, x_q)
    first, past = memory.project(x_kv[:, :cut], x_q[:, :cut])
    second, _ = memory.project(x_kv[:, cut:], x_q[:, cut:], past)
    for a, b, c in zip(whole, first, second):
        torch.testing.assert_close(a, torch.cat((b, c), dim=2), rtol=0, atol=1e-12)


def test_reference_features_match_the_module():
    memory, x_kv, x_q, _ = memory_case(1, "model.titans.conv_kernel=4")
    (k, v, q, theta, log_eta, log_keep), _ = memory.project(x_kv, x_q)
    ref = reference_features(memory, x_kv, x_q)
    for a, b in zip((k, v, q, theta, log_eta.exp(), log_keep.exp()), ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_convolution_off_has_no_parameters_and_is_the_identity():
    cfg, model = build("titans_mag", "model.titans.conv_kernel=0")
    memory = model.layers["0"].memory
    assert memory.conv_q is None and not any("conv" in n for n, _ in model.named_parameters())
    x = torch.randn(2, 5, 8)
    assert causal_conv(x, None)[0] is x


def test_convolution_init_is_near_identity_and_split_independent():
    cfg, model = build("titans_mag")
    name = "layers.0.memory.conv_q"
    taps = model.get_parameter(name)
    assert taps.shape == (cfg.n_heads * cfg.head_dim, cfg.titans.conv_kernel)
    assert (taps[:, -1] - 1).abs().max() < 0.1 and taps[:, :-1].abs().max() < 0.1 and taps[:, :-1].abs().max() > 0
    torch.testing.assert_close(model.init_value(name, tuple(taps.shape), 0), taps.detach(), rtol=0, atol=0)
    with torch.device("meta"):
        meta = build_model(cfg)
    assert not list(meta.buffers()) and meta.get_parameter(name).is_meta


def test_cost_model_counts_the_convolution_and_the_band():
    overrides = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.mlp_width=64",
                 "model.vocab_size=64", "model.seq_len=30", "model.taper.multiple=16", "model.arch=titans",
                 "model.titans.window=7", "model.titans.conv_kernel=3", "model.titans.persistent_tokens=2"]
    cfg = load_config(None, overrides).model
    model = build_model(cfg)
    model.init_weights(0)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(torch.randint(0, cfg.vocab_size, (1, cfg.seq_len)))
    costs = model_costs(cfg)
    assert counter.get_total_flops() / cfg.seq_len == pytest.approx(costs.total_flops, rel=1e-9)
    assert costs.total_params == sum(p.numel() for p in model.parameters())
