"""Hope-attention's online Continuum Memory System: the chunked closed form against the
token-by-token autograd reference (tests/helpers/hope_reference.py), the step-size parameter, the
cost model's count of the inner updates, and the plain chain kept as the ablation.

Tolerance (fp32): outputs and outer gradients (by w1, w3, w2 and the input) within 1e-5 of the
reference relative to the largest entry of each tensor (measured: <= 5e-7); the gradient by the
scalar raw_step, a sum of terms that partly cancel, within 1e-5 relative to max(1, |value|)
(measured: <= 4e-7 on values of 0.2 to 0.9). In float64 every error is below 1e-14.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megatron_taper.config import load_config
from megatron_taper.cost.flops import model_costs
from megatron_taper.models import build_model
from megatron_taper.models.hope_attention.model import ContinuumLevel
from tests.helpers.hope_reference import reference_level

TOL = 1e-5
D, W, B, S = 16, 24, 2, 18


def _level(period: int, eta: float, seed: int = 0) -> ContinuumLevel:
    g = torch.Generator().manual_seed(seed)
    level = ContinuumLevel(D, W, period)
    with torch.no_grad():
        for p, std in ((level.w1, 0.3), (level.w3, 0.3), (level.w2, 0.2)):
            p.copy_(torch.randn(p.shape, generator=g) * std)
        level.raw_step.fill_(math.log(math.expm1(eta)))
    return level


def _inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = F.rms_norm(torch.randn(B, S, D, generator=g), (D,))  # a normalised input, as the block gives
    return n.requires_grad_(), torch.randn(B, S, D, generator=g)  # input, outer-loss probe


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("period", [1, 4, 5, 18, 32], ids=lambda p: f"C{p}")
def test_chunked_level_matches_token_by_token_reference(period):
    level = _level(period, eta=0.5)
    n, probe = _inputs()
    params = [level.w1, level.w3, level.w2, level.raw_step]
    out = level(n)
    ref = reference_level(*params, n, period)
    # the reference leaves raw_step out of the graph when no update runs (period >= S)
    got_grads, ref_grads = (torch.autograd.grad((y * probe).sum(), params + [n], allow_unused=True,
                                                materialize_grads=True) for y in (out, ref))
    errors = {"out": _relative_error(out, ref)}
    errors.update({name: _relative_error(a, b) for name, a, b in
                   zip(("w1", "w3", "w2", "input"), got_grads[:3] + got_grads[4:], ref_grads[:3] + ref_grads[4:])})
    errors["raw_step"] = ((got_grads[3] - ref_grads[3]).abs() / ref_grads[3].abs().clamp(min=1)).item()
    print(f"C={period}: " + ", ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) < TOL, errors
    plain = F.linear(F.silu(F.linear(n, level.w1)) * F.linear(n, level.w3), level.w2)
    torch.testing.assert_close(out[:, :period], plain[:, :period], rtol=0, atol=1e-6)  # the first chunk
    if period < S:  # the updates matter: later chunks differ from the plain SwiGLU
        assert (out[:, period:] - plain[:, period:]).abs().max() > 1e-2
    else:
        assert got_grads[3].item() == 0  # no update ran: eta has a zero gradient (not none)


def _config(*extra: str):
    return load_config(None, ["model.arch=hope_attention", "model.n_layers=2", "model.d_model=32",
                              "model.n_heads=2", "model.mlp_width=64", "model.vocab_size=64", "model.seq_len=40",
                              "model.taper.multiple=16", *extra]).model


def test_online_is_the_default_and_the_step_size_starts_at_online_lr():
    cfg = _config("model.hope.online_lr=0.05", "model.hope.chunk_size=4")  # periods 4 and 16 < S = 40
    assert cfg.hope.online
    model = build_model(cfg)
    model.init_weights(0)
    steps = {n: p for n, p in model.named_parameters() if n.endswith("raw_step")}
    assert sorted(steps) == [f"layers.{i}.cms.{j}.raw_step" for i in range(2) for j in range(2)]
    for p in steps.values():
        assert F.softplus(p).item() == pytest.approx(0.05, rel=1e-6)
    with torch.device("meta"):  # the meta build holds no buffers: every tensor is a parameter
        meta = build_model(cfg)
    assert not list(meta.buffers())
    assert [n for n, _ in meta.named_parameters()] == [n for n, _ in model.named_parameters()]
    model(torch.randint(0, 64, (2, 40))).float().logsumexp(-1).mean().backward()
    for name, p in steps.items():
        assert p.grad is not None and p.grad.abs().item() > 0, name


def test_a_level_without_update_still_gets_a_step_gradient():
    """With the default periods 16 and 64 at S = 40, level 1 never updates: its raw_step gets a
    zero gradient, not none (DDP needs a gradient for every parameter)."""
    model = build_model(_config())
    model.init_weights(0)
    model(torch.randint(0, 64, (2, 40))).float().logsumexp(-1).mean().backward()
    for i in range(2):
        assert model.get_parameter(f"layers.{i}.cms.0.raw_step").grad.abs().item() > 0
        assert model.get_parameter(f"layers.{i}.cms.1.raw_step").grad.item() == 0


def test_plain_chain_is_the_ablation():
    cfg = _config("model.hope.online=false")
    model = build_model(cfg)
    model.init_weights(0)
    assert not [n for n, _ in model.named_parameters() if n.endswith("raw_step")]
    block, x = model.layers["0"], torch.randn(2, 40, 32)
    n = block.cms_norms[0](x)
    level = block.cms[0]
    expected = F.linear(F.silu(F.linear(n, level.w1)) * F.linear(n, level.w3), level.w2)
    torch.testing.assert_close(level(n), expected, rtol=0, atol=0)


@pytest.mark.parametrize("chunks", [("6", "4"), ("40", "2"), ("3", "5")], ids=lambda c: "x".join(c))
def test_cost_model_counts_the_inner_updates(chunks):
    """FLOP counter = cost model, also for periods that do not divide the sequence (the last
    chunk updates nothing) and for a level whose one chunk is the whole sequence."""
    cfg = _config(f"model.hope.chunk_size={chunks[0]}", f"model.hope.chunk_growth={chunks[1]}")
    model = build_model(cfg)
    model.init_weights(0)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(torch.randint(0, 64, (2, 40)))
    costs = model_costs(cfg, causal=False)
    assert counter.get_total_flops() / (2 * 40) == pytest.approx(costs.total_flops, rel=1e-9)
    plain = model_costs(_config("model.hope.online=false"), causal=False)
    assert costs.total_params == plain.total_params + 2 * 2  # one step size per level
    if chunks[0] != "40":
        assert costs.total_flops > plain.total_flops
