"""The mixture-of-experts MLP (models/moe.py) on one process: routing losses against a hand
computation, dropless outputs against a per-token dense reference, the grouped GEMM against the
loop, the auxiliary-loss-free bias, activation checkpointing, and the taper's budgets.

Tolerances: the grouped GEMM and the loop compute the same float32 products, summed in another
order: outputs and gradients within SCALED_TOL = 1e-6 of each tensor's largest magnitude (single
elements that cancel show larger relative differences). The per-token reference
runs in float64: the float32 outputs (values up to ~10, sums of 16- and 8-term products) are
within REFERENCE_ATOL = 1e-5 of it (about 100 float32 ulps at 1; measured <= 4.2e-6). The routing
losses are compared with closed forms to float32 rounding (1e-6).
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_taper.config import ConfigError, load_config
from megatron_taper.cost.flops import model_costs, uniform_twin
from megatron_taper.cost.partition import plan_pipeline
from megatron_taper.models import build_model
from megatron_taper.models.moe import MoE, balance_experts, load_metrics, routing_losses
from megatron_taper.taper import layer_widths, moe_layers
from tests.helpers.runner import REPO

ATOL = RTOL = 1e-6
REFERENCE_ATOL = 1e-5
SCALED_TOL = 1e-6
TINY_MOE = ["model.n_layers=4", "model.d_model=32", "model.n_heads=2", "model.mlp_width=64", "model.vocab_size=64",
            "model.seq_len=16", "model.taper.multiple=8", "model.moe.experts=4", "model.moe.expert_width=32"]


def _moe(seed: int = 0, **kwargs) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(16, kwargs.pop("n_experts", 4), kwargs.pop("top_k", 2), 8, **kwargs)
    with torch.no_grad():
        for p in moe.parameters():
            if p.requires_grad:
                p.normal_(0, 0.5)
    return moe


def test_routing_losses_equal_a_hand_computation():
    # 2 experts, top-1; logits [0, ln 3] -> p = (1/4, 3/4), [ln 3, 0] -> p = (3/4, 1/4)
    moe = MoE(2, 2, 1, 4, aux_loss_weight=0.5, z_loss_weight=0.25)
    with torch.no_grad():
        moe.router.copy_(torch.tensor([[0.0, math.log(3)], [math.log(3), 0.0]]))
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])  # choices: 1, 0, 1, 1
    logits, probs, chosen, gates = moe.route(x)
    assert chosen.flatten().tolist() == [1, 0, 1, 1]
    torch.testing.assert_close(gates, torch.full((4, 1), 0.75))  # top-1: the chosen probability
    balance, z_loss = routing_losses(logits, probs, chosen)
    # f = (1/4, 3/4), P = (3/8, 5/8): N * sum f_i P_i = 2 * (3/32 + 15/32) = 1.125
    assert balance.item() == pytest.approx(1.125, abs=ATOL)
    assert z_loss.item() == pytest.approx(math.log(4) ** 2, abs=ATOL)  # logsumexp = ln 4 for every token
    # the losses reach the router's gradient with their weights times aux_scale, the output unchanged
    moe.aux_scale = 0.5
    with torch.no_grad():
        for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
            w.normal_()
    out = moe(x)
    out.sum().backward()
    got = moe.router.grad.clone()
    moe.router.grad = None
    weights = (moe.aux_loss_weight, moe.z_loss_weight)
    moe.aux_loss_weight = moe.z_loss_weight = 0.0
    plain = moe(x)
    assert torch.equal(plain, out)
    logits, probs, chosen, _ = moe.route(x)
    balance, z_loss = routing_losses(logits, probs, chosen)
    (plain.sum() + 0.5 * (weights[0] * balance + weights[1] * z_loss)).backward()
    torch.testing.assert_close(got, moe.router.grad, atol=ATOL, rtol=0)
    assert moe.loss_log.tolist() == pytest.approx([2 * 1.125, 2 * math.log(4) ** 2, 2.0])  # two counted forwards


def _per_token_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its k experts one by one (and the shared expert), gates from the router."""
    _, _, chosen, gates = moe.route(x)
    e = moe.experts
    rows = []
    for t in range(x.shape[0]):
        y = moe.shared(x[t]) if moe.shared is not None else torch.zeros_like(x[t])
        for j in range(moe.top_k):
            i = chosen[t, j]
            y = y + gates[t, j] * ((F.silu(x[t] @ e.w1[i]) * (x[t] @ e.w3[i])) @ e.w2[i])
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize("shared", [0, 8])
def test_dropless_output_equals_a_per_token_reference_and_grouped_equals_loop(shared):
    moe = _moe(shared_width=shared)
    x = torch.randn(3, 10, 16)  # 30 tokens over 4 experts, top-2: uneven counts, none dropped
    grads = {}
    for grouped in (True, False):
        moe.experts.use_grouped_mm = grouped
        moe.zero_grad()
        xi = x.clone().requires_grad_()
        out = moe(xi)
        out.square().sum().backward()
        grads[grouped] = (out.detach(), xi.grad, *(p.grad.clone() for p in moe.parameters() if p.requires_grad))
    ref = _per_token_reference(copy.deepcopy(moe).double(), x.reshape(-1, 16).double()).reshape(x.shape)
    print(f"shared {shared}: |grouped - float64 per token| {(grads[True][0] - ref).abs().max():.1e}, |grouped - loop| "
          f"{max((a - b).abs().max().item() for a, b in zip(grads[True], grads[False])):.1e}")
    torch.testing.assert_close(grads[True][0], ref.float(), atol=REFERENCE_ATOL, rtol=0)
    for a, b in zip(grads[True], grads[False]):  # within SCALED_TOL of each tensor's largest magnitude
        torch.testing.assert_close(a, b, atol=SCALED_TOL * b.abs().max().item(), rtol=0)


def test_the_bias_moves_the_choice_not_the_gates_and_balances_toward_the_mean_load():
    moe = _moe(n_experts=4, top_k=1)
    x = torch.randn(40, 16)
    _, probs, _, _ = moe.route(x)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    _, _, chosen, gates = moe.route(x)
    assert (chosen == 3).all() and torch.equal(gates, probs[:, 3:])  # the gate: the unbiased probability
    with torch.no_grad():
        moe.expert_bias.zero_()
    moe(x)  # a training forward counts the load: expert i got load[i] of the 40 assignments
    load = moe.load_step.clone()
    balance_experts(moe, 0.01, stepped=torch.tensor(False))  # a skipped step moves nothing
    assert torch.equal(moe.expert_bias, torch.zeros(4)) and moe.load_step.sum() == 0
    moe(x)
    balance_experts(moe, 0.01)
    torch.testing.assert_close(moe.expert_bias, 0.01 * torch.sign(load.mean() - load))
    metrics = load_metrics(moe)
    share = 2 * load / load.sum()  # two forwards counted since the start
    share = share / share.sum()
    assert metrics["moe/mlp/load_max"].item() == pytest.approx(4 * share.max().item())
    assert metrics["moe/mlp/load_entropy"].item() == pytest.approx(
        -(share * share.clamp(min=1e-30).log()).sum().item() / math.log(4))
    assert load_metrics(moe)["moe/mlp/load_max"].item() == 0  # read and cleared


def test_activation_checkpointing_counts_each_token_once_with_the_same_gradients():
    from torch.utils.checkpoint import checkpoint

    moe = _moe()
    x = torch.randn(20, 16)
    moe(x).sum().backward()
    plain = [p.grad.clone() for p in moe.parameters() if p.requires_grad]
    moe.zero_grad()
    checkpoint(moe, x, use_reentrant=False).sum().backward()  # the forward runs again inside backward
    assert moe.load_step.sum().item() == 2 * 20 * 2  # two training forwards of 20 tokens x top-2
    for a, p in zip(plain, (p for p in moe.parameters() if p.requires_grad)):
        torch.testing.assert_close(a, p.grad, atol=ATOL, rtol=RTOL)


def test_compiled_moe_has_the_eager_outputs_and_gradients():
    """torch.compile's graphs (dynamo + AOTAutograd, no C++ build) keep the routing losses' gradient."""
    moe = _moe(shared_width=8, aux_loss_weight=0.1, z_loss_weight=0.01)
    x = torch.randn(2, 6, 16)
    eager = moe(x)
    eager.sum().backward()
    grads = [p.grad.clone() for p in moe.parameters() if p.requires_grad]
    moe.zero_grad()
    compiled = torch.compile(moe, backend="aot_eager")(x)
    compiled.sum().backward()
    torch.testing.assert_close(compiled, eager, atol=ATOL, rtol=RTOL)
    for a, p in zip(grads, (p for p in moe.parameters() if p.requires_grad)):
        torch.testing.assert_close(p.grad, a, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("extra", [[], ["model.moe.first_dense=1", "model.moe.shared_width=16"],
                                   ["model.taper.start=0.5", "model.moe.top_k=1"], ["model.arch=gated_attention"]])
def test_taper_keeps_total_parameters_and_active_flops_of_the_uniform_twin(extra):
    cfg = load_config(None, TINY_MOE + extra).model
    tapered, uniform = model_costs(cfg), model_costs(uniform_twin(cfg))
    assert tapered.widths != uniform.widths
    assert tapered.total_params == uniform.total_params
    assert tapered.total_flops == uniform.total_flops
    flags = moe_layers(cfg)
    expert_sum = sum(w for w, moe in zip(layer_widths(cfg), flags) if moe)
    assert expert_sum == sum(flags) * 32  # the expert budget, exactly
    model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == tapered.total_params
    assert [isinstance(block.mlp, MoE) for block in model.layers.values()] == flags
    model.init_weights(0)
    model(torch.randint(0, 64, (1, 16))).sum().backward()  # the family runs with its experts
    assert all(block.mlp.router.grad is not None for block in model.layers.values() if isinstance(block.mlp, MoE))


def test_recipes_are_twins_and_the_pipeline_plan_balances_active_flops():
    taper = load_config(str(REPO / "configs/tiny_moe_taper.yaml")).model
    uniform = load_config(str(REPO / "configs/tiny_moe_uniform.yaml")).model
    t, u = model_costs(taper), model_costs(uniform)
    assert (t.total_params, t.total_flops) == (u.total_params, u.total_flops)
    assert t.widths == [384, 160, 96, 32] and u.widths == [384, 96, 96, 96]
    plan = plan_pipeline(taper, 2)
    stages = [stage.layers for stage in plan.stages]
    print(f"tiny_moe_taper pp=2: stages {stages}, slowest / ideal {plan.bottleneck_over_ideal:.3f} "
          f"(layer-count split {plan.uniform_bottleneck_over_ideal:.3f})")
    assert plan.bottleneck_over_ideal <= plan.uniform_bottleneck_over_ideal
    big = load_config(str(REPO / "configs/transformer_moe_1b_taper.yaml")).model
    big_twin = model_costs(load_config(str(REPO / "configs/transformer_moe_1b_uniform.yaml")).model)
    b = model_costs(big)
    assert (b.total_params, b.total_flops) == (big_twin.total_params, big_twin.total_flops)
    assert 1e9 < b.total_params < 1.2e9
    plan = plan_pipeline(big, 4)
    print(f"transformer_moe_1b_taper pp=4: slowest / ideal {plan.bottleneck_over_ideal:.3f} "
          f"(layer-count split {plan.uniform_bottleneck_over_ideal:.3f})")
    assert plan.bottleneck_over_ideal < plan.uniform_bottleneck_over_ideal


@pytest.mark.parametrize("extra, message", [
    (["model.moe.top_k=5"], "model.moe.top_k=5 must be at most model.moe.experts=4"),
    (["model.moe.expert=8"], "did you mean 'model.moe.experts'"),
    (["model.arch=titans"], "model.moe.experts=4: model.arch='titans' keeps a dense MLP"),
    (["model.moe.first_dense=4"], "model.moe.first_dense=4 leaves no MoE layer"),
])
def test_bad_moe_settings_are_one_clear_error(extra, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, TINY_MOE + extra)


@pytest.mark.parametrize("layout, world, message", [
    (["parallel.zero=deepspeed"], 2, "model.moe with parallel.zero=deepspeed is not supported yet"),
    (["parallel.ep=2"], 3, "parallel.ep=2 must divide the data-parallel size 3"),
    (["parallel.ep=2", "model.moe.experts=3"], 2, "parallel.ep=2 must divide model.moe.experts=3"),
    (["parallel.ep=2", "parallel.zero=fsdp2", "parallel.dp_replicate=2"], 4,
     "parallel.ep=2 with parallel.dp_replicate=2 / parallel.dp_shard=0 .HSDP. is not supported yet"),
    (["parallel.ep=2", "model.moe.experts=0"], 2, "parallel.ep=2 spreads experts, but model.moe.experts=0"),
])
def test_layouts_not_built_are_refused(layout, world, message):
    from megatron_taper.cost.preflight import preflight

    with pytest.raises(ConfigError, match=message):
        preflight(load_config(None, TINY_MOE + layout), world)


@pytest.mark.parametrize("layout, world, dp", [
    (["parallel.ep=2", "parallel.zero=fsdp2"], 2, 2), (["parallel.ep=2"], 4, 4),
    (["parallel.ep=2", "parallel.zero=fsdp2"], 4, 4), (["parallel.ep=2", "parallel.pp=2"], 4, 2),
    (["parallel.ep=2", "parallel.tp=2"], 4, 2), (["parallel.tp=2"], 2, 1),
    (["parallel.tp=2", "parallel.sequence_parallel=true"], 2, 1),
])
def test_expert_parallel_layouts_pass_preflight(layout, world, dp):
    from megatron_taper.cost.preflight import preflight

    assert preflight(load_config(None, TINY_MOE + layout + ["train.micro_batch=1"]), world).dp == dp
