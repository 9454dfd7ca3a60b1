"""Balanced-tree single-layer LM (models/tree/) and the ALiBi position option.

Tree: the batched up-/down-sweep against a direct fold of every prefix, causality, the counted
levels and cell applications, the cost model against the module, torch's FLOP counter and
autograd's saved tensors, layouts it refuses, and training + exact resume through the Trainer.
ALiBi: the attention against an explicit softmax with the additive bias, and the per-head slopes
of a rank that holds only some heads (what a tensor-parallel plan relies on).
"""
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_taper.config import load_config
from megatron_taper.cost.flops import model_costs
from megatron_taper.cost.preflight import preflight
from megatron_taper.models import build_model
from megatron_taper.models.layers import Attention, alibi_bias, alibi_slopes
from megatron_taper.models.tree.cost import SweepCount, tree_depth
from megatron_taper.models.tree.sweeps import tree_prefixes
from megatron_taper.validation import ConfigError
from tests.helpers.runner import TINY, assert_resumes_exactly, saved_elements

TREE = ["model.arch=tree", "model.n_layers=1", "model.d_model=32", "model.n_heads=4", "model.mlp_width=64",
        "model.vocab_size=97", "model.taper.multiple=16", "model.tree.cell_width=48"]
# Prefix states are RMS-normalised (entries ~1) and each is at most 2 log2(n) compositions deep;
# the batched sweep and the one-pair-at-a-time fold differ only in fp32 rounding of the matmuls
# (measured <= 5e-7 up to n = 64), so 1e-5 is loose for rounding and far below any wrong pairing.
STATE_ATOL = 1e-5


def tree_model(seq_len: int, *extra: str):
    cfg = load_config(None, [*TREE, f"model.seq_len={seq_len}", *extra]).model
    model = build_model(cfg)
    model.init_weights(0)
    return cfg, model


def direct_fold(cell, leaves: torch.Tensor) -> torch.Tensor:
    """Reference: every prefix [0, t] folded on its own, one cell application at a time: the
    blocks of t+1's binary expansion, largest first, left-folded; each block's node built from
    its two halves (memoised: O(n) nodes, O(n log n) folds)."""
    nodes: dict[tuple[int, int], torch.Tensor] = {}

    def node(start: int, size: int) -> torch.Tensor:
        if (start, size) not in nodes:
            half = size // 2
            nodes[start, size] = leaves[:, start] if size == 1 else cell(
                torch.cat([node(start, half), node(start + half, half)], dim=-1))
        return nodes[start, size]

    out = []
    for t in range(leaves.shape[1]):
        length, start, state = t + 1, 0, None
        for k in reversed(range(length.bit_length())):
            if length >> k & 1:
                block = node(start, 1 << k)
                state = block if state is None else cell(torch.cat([state, block], dim=-1))
                start += 1 << k
        out.append(state)
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("seq_len", [1, 2, 3, 6, 13, 37, 64])
def test_sweep_matches_direct_fold_with_log_depth(seq_len):
    torch.manual_seed(seq_len)
    cfg, model = tree_model(seq_len)
    cell = model.layers["0"].cell
    leaves = torch.randn(2, seq_len, cfg.d_model)
    count = SweepCount()
    with torch.no_grad():
        got = tree_prefixes(cell, leaves, count)
        ref = direct_fold(cell, leaves)
    torch.testing.assert_close(got, ref, rtol=0, atol=STATE_ATOL)
    assert count == tree_depth(seq_len)
    log2 = math.floor(math.log2(seq_len))
    assert count.up_levels == log2 and count.levels <= 2 * log2  # O(log n) sequential cell levels
    assert count.cell_pairs < 2 * seq_len  # O(n) cell applications
    print(f"n={seq_len}: {count.levels} sequential cell levels, {count.cell_pairs} cell applications")


def test_causal():
    cfg, model = tree_model(37)
    x = torch.randint(0, cfg.vocab_size, (2, 37))
    cut = 20
    changed = x.clone()
    changed[:, cut + 1:] = (x[:, cut + 1:] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(x), model(changed)
    # the same rows go through the same matmuls whatever the other rows hold: equal to rounding
    torch.testing.assert_close(a[:, :cut + 1], b[:, :cut + 1], rtol=0, atol=1e-6)
    assert (a[:, cut + 1:] - b[:, cut + 1:]).abs().amax(dim=-1).min() > 1e-4  # every later position sees it


@pytest.mark.parametrize("seq_len", [37, 64])
def test_cost_model_matches_module_flop_counter_and_saved_tensors(seq_len):
    cfg, model = tree_model(seq_len)
    costs = model_costs(cfg)
    assert costs.total_params == sum(p.numel() for p in model.parameters())
    assert costs.layers[0].params == sum(p.numel() for p in model.layers["0"].parameters())
    assert costs.layers[0].params_split.total == costs.layers[0].params
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (2, seq_len)))
    assert counter.get_total_flops() / (2 * seq_len) == pytest.approx(costs.total_flops, rel=1e-9)

    x = torch.randn(2, seq_len, cfg.d_model, requires_grad=True)
    saved = saved_elements(model, lambda: model.layers["0"](x))
    act = costs.layers[0].act
    assert act.total - act.input_copies == pytest.approx(saved / (2 * seq_len), rel=0.07)


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.pp=2"], 2, "model.arch='tree' has a single layer, nothing to split over pipeline stages"),
    (["parallel.tp=2", "parallel.sequence_parallel=true"], 2, "the tree spans the whole sequence"),
    (["parallel.tp=4", "model.tree.cell_width=48"], 4, "fewer than parallel.tp"),
    (["model.n_layers=2"], 1, "model.arch='tree' is a single-layer model"),
])
def test_layouts_the_tree_refuses(overrides, world, message):
    cfg = load_config(None, [*TREE, *overrides])
    with pytest.raises(ConfigError, match=message):
        preflight(cfg, world)


def test_position_option_is_checked_per_family():
    with pytest.raises(ConfigError, match="model.position='alibi': model.arch='tree' supports none"):
        load_config(None, [*TREE, "model.position=alibi"])
    with pytest.raises(ConfigError, match="model.arch='titans' supports rope"):
        load_config(None, ["model.arch=titans", "model.position=alibi"])
    assert load_config(None, ["model.position=alibi"]).model.position_encoding == "alibi"
    assert load_config(None, []).model.position_encoding == "rope"


def test_trains_and_resumes_exactly(byte_tokens, tmp_path):
    recipe = ["--config", "configs/tiny_tree.yaml", *TINY, "model.n_layers=1", "model.tree.cell_width=64",
              f"data.path={byte_tokens}", "train.steps=6", "train.eval_interval=4"]
    assert_resumes_exactly(recipe, tmp_path)


def test_alibi_attention_matches_explicit_softmax():
    torch.manual_seed(0)
    attn = Attention(32, 4, 2, 8, position="alibi")
    x = torch.randn(2, 11, 32)
    with torch.no_grad():
        got = attn.attend(x, torch.empty(0), torch.empty(0))  # [B, S, H, E]; no rotary tables used
        q = attn.wq(x).view(2, 11, 4, 8).transpose(1, 2)
        k = attn.wk(x).view(2, 11, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
        v = attn.wv(x).view(2, 11, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
        slopes = torch.tensor([2.0 ** (-8 * h / 4) for h in (1, 2, 3, 4)])
        i, j = torch.arange(11)[:, None], torch.arange(11)[None, :]
        bias = torch.where(j <= i, -slopes[:, None, None] * (i - j), float("-inf"))
        ref = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8) + bias, dim=-1) @ v
    torch.testing.assert_close(got, ref.transpose(1, 2), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(alibi_bias(slopes, 11), bias)


def test_alibi_slopes_follow_the_global_head_index():
    """A rank holding heads 2..3 of 4 (tp=2) uses those heads' slopes: its output equals the
    corresponding heads of the whole attention."""
    torch.manual_seed(1)
    whole = Attention(32, 4, 4, 8, position="alibi")
    half = Attention(32, 4, 4, 8, position="alibi")
    half.first_head = 2
    with torch.no_grad():
        for name in ("wq", "wk", "wv"):
            getattr(half, name).weight = torch.nn.Parameter(getattr(whole, name).weight[16:].clone())
        x = torch.randn(2, 9, 32)
        torch.testing.assert_close(half.attend(x, None, None), whole.attend(x, None, None)[:, :, 2:])
    assert alibi_slopes(8, 4, 4, torch.device("cpu")).tolist() == [2.0 ** (-8 * h / 8) for h in (5, 6, 7, 8)]
