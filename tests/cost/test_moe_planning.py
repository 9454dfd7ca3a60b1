"""The planner, the memory model and the step-time model with mixture-of-experts layers and expert
parallelism (cost/block.py moe_cost, cost/memory.py, cost/step_time.py, cost/plan.py; docs/moe.md
"Planning"). The MoE activation terms themselves are checked against torch's saved tensors in
tests/cost/test_memory_model.py (the transformer_moe cases). Everything here is arithmetic on the
config (no weights are built), compared with hand counts to 1e-12 relative."""
from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from megatron_taper.config import load_config
from megatron_taper.cost.block import moe_all_to_all_bytes, routed_experts
from megatron_taper.cost.devices import profiles
from megatron_taper.cost.flops import model_costs
from megatron_taper.cost.memory import GIB, MemorySetup, model_memory
from megatron_taper.cost.plan import USABLE_FRACTION, search, with_values
from megatron_taper.cost.preflight import check_moe_layout, preflight
from megatron_taper.cost.step_time import RankWork, StepLayout, step_time
from megatron_taper.taper import layer_widths, moe_layers
from megatron_taper.validation import ConfigError
from tests.helpers.runner import REPO

TINY_MOE = str(REPO / "configs" / "tiny_moe_taper.yaml")
MOE_1B = str(REPO / "configs" / "transformer_moe_1b_taper.yaml")


def _layers(cfg, **setup):
    return model_memory(cfg.model, MemorySetup(**setup)).layers


def test_each_ep_rank_holds_its_share_of_the_experts_state():
    """Routed experts' parameters, gradients and AdamW state divide by ep (zero=none: 16 bytes each);
    the router, routing bias and the dense layers stay whole; under fsdp2 the experts shard over the
    dp_shard / ep ranks holding them, so a rank's expert state is the same at every ep."""
    cfg = load_config(TINY_MOE, [])
    widths, moe = layer_widths(cfg.model), moe_layers(cfg.model)
    one, two = _layers(cfg, dp=2), _layers(cfg, dp=2, ep=2)
    for width, is_moe, a, b in zip(widths, moe, one, two):
        experts = routed_experts(cfg.model, width)[0] if is_moe else 0
        assert a.params - b.params == pytest.approx(experts / 2, rel=1e-12)
        assert a.static - b.static == pytest.approx(16.0 * experts / 2, rel=1e-12)
        # DDP holds the experts' gradients in no bucket at ep > 1: the first backward makes them
        assert b.grads == pytest.approx(4.0 * experts / 2, rel=1e-12) and a.grads == 0.0
    fsdp_one, fsdp_two = _layers(cfg, dp=4, zero="fsdp2"), _layers(cfg, dp=4, zero="fsdp2", ep=2)
    for width, is_moe, a, b in zip(widths, moe, fsdp_one, fsdp_two):
        experts = routed_experts(cfg.model, width)[0] if is_moe else 0
        dense = a.params - experts
        assert b.params == pytest.approx(dense + experts / 2, rel=1e-12)
        assert b.static == pytest.approx(16.0 / 4 * (dense + experts), rel=1e-12)  # 16 / dp_shard per parameter


def test_dispatched_rows_carry_the_imbalance_at_ep_only():
    """The rows the experts compute (per assignment the gathered input and the SwiGLU's 4 W) are the
    busiest rank's at ep > 1: ep_imbalance x its own; at ep = 1 a rank computes exactly its own."""
    cfg = load_config(TINY_MOE, [])
    m, tokens = cfg.model, 4 * cfg.model.seq_len
    widths, moe = layer_widths(m), moe_layers(m)
    base = dict(dp=2, micro_batch=4)
    assert _layers(cfg, ep_imbalance=2.0, **base) == _layers(cfg, **base)
    even, busy = _layers(cfg, ep=2, **base), _layers(cfg, ep=2, ep_imbalance=1.5, **base)
    for width, is_moe, a, b in zip(widths, moe, even, busy):
        rows = m.moe.top_k * (m.d_model + 4 * width) if is_moe else 0  # fp32: 4 bytes each
        assert b.kept - a.kept == pytest.approx(0.5 * 4.0 * rows * tokens, rel=1e-12, abs=0.0)
        # and the experts' backward moment, when it is the block's largest (the attention's may be)
        backward = m.moe.top_k * (2 * width + m.d_model) if is_moe else 0
        assert 0.5 * 4.0 * rows * tokens <= b.peak - a.peak <= 0.5 * 4.0 * (rows + backward) * tokens
    assert busy[1].peak - even[1].peak == pytest.approx(0.5 * 4.0 * 2 * (2 * 128 + 6 * 160) * tokens, rel=1e-12)


def test_step_time_prices_the_all_to_all_and_the_busiest_ranks_experts():
    h100 = profiles()["h100"]
    layout = StepLayout(tp=1, pp=1, dp=8, virtual=1, schedule="1f1b", zero="none", sequence_parallel=False,
                        micro_batch=2, microbatches=3, bf16=True, float8=False, overlap=False, ep=8,
                        ep_imbalance=1.25)
    per_token = 4.0 * 2 * 64 * 2 * 7 / 8  # moe_all_to_all_bytes: top-2 of d_model 64 in bf16 over ep = 8
    work = [RankWork(flops=1e9, linear_flops=8e8, recompute_flops=0.0, blocks=4, recomputed_blocks=0, params=1e6,
                     expert_flops=6e8, expert_params=5e5, moe_blocks=3, all_to_all_bytes=per_token)]
    cfg = load_config(None, ["model.d_model=64", "model.moe.experts=8", "model.moe.top_k=2", "model.n_heads=2"])
    assert moe_all_to_all_bytes(cfg.model, 1, 8, 2) == per_token
    tokens = 2 * 128
    t = step_time(work, layout, d_model=64, seq_len=128, device=h100)
    # 3 MoE blocks: their 4 exchanges at the busiest rank's load at NVLink's 450 GB/s (8 ranks, one node)
    assert t.ep == pytest.approx(3 * 1.25 * 3 * per_token * tokens / 450e9, rel=1e-12)
    # the busiest rank's experts: 0.25 more of their 3 x 6e8 FLOPs per token
    even = step_time(work, dataclasses.replace(layout, ep_imbalance=1.0), d_model=64, seq_len=128, device=h100)
    assert t.compute - even.compute == pytest.approx(3 * 0.25 * 3 * 6e8 * tokens / (0.4 * 989e12), rel=1e-9)
    # at ep = dp no rank shares its experts: DDP all-reduces the other 5e5 parameters only, over 8 ranks
    # (450 GB/s; one bucket: under 4 x the minimum bucket), and the optimizer steps all 1e6
    assert t.dp == pytest.approx(2 * 7 / 8 * 4 * 5e5 / 450e9, rel=1e-12)
    assert t.optimizer == pytest.approx(32 * 1e6 / 3.35e12, rel=1e-12)
    # at ep = 1 (every rank all experts) no all-to-all, no imbalance, all 1e6 all-reduced
    dense = step_time(work, dataclasses.replace(layout, ep=1), d_model=64, seq_len=128, device=h100)
    assert dense.ep == 0.0 and dense.compute == pytest.approx(even.compute, rel=1e-12)
    assert dense.dp == pytest.approx(2 * 7 / 8 * 4 * 1e6 / 450e9, rel=1e-12)


def test_expert_parallel_legality_is_one_rule():
    """check_moe_layout is what preflight applies (the trainer) and what refuses the planner's ep
    values: ep divides dp and the experts, with zero none or fsdp2, not with HSDP."""
    cfg = load_config(MOE_1B, [])  # 16 experts
    legal = {ep for ep in (1, 2, 4, 8, 16, 32) if _accepts(cfg, dict(ep=ep), dp=8)}
    assert legal == {1, 2, 4, 8}
    for values, dp, message in [
        (dict(ep=16), 8, "parallel.ep=16 must divide the data-parallel size 8"),
        (dict(ep=3), 3, "parallel.ep=3 must divide model.moe.experts=16"),
        (dict(ep=2, zero="fsdp2", dp_replicate=2), 8, "parallel.ep=2 with parallel.dp_replicate=2"),
    ]:
        with pytest.raises(ConfigError, match=message):
            check_moe_layout(cfg.model, dataclasses.replace(cfg.parallel, **values), cfg.train, dp)
    with pytest.raises(ConfigError, match="parallel.ep=2 spreads experts, but model.moe.experts=0"):
        preflight(load_config(None, ["parallel.ep=2"]), 2)


def _accepts(cfg, values: dict, dp: int) -> bool:
    try:
        check_moe_layout(cfg.model, dataclasses.replace(cfg.parallel, **values), cfg.train, dp)
    except ConfigError:
        return False
    return True


def _plan_layout_tool():
    spec = importlib.util.spec_from_file_location("plan_layout", REPO / "tools" / "plan_layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# a slice of plan.SEARCH_SPACE around the MoE recipe's candidates (the whole space takes ~10 s of CPU)
SPACE = (("parallel.tp", (1, 2)), ("parallel.pp", (1, 2)), ("parallel.zero", ("none", "fsdp2", "deepspeed")),
         ("parallel.ep", (1, 2, 8, 16)), ("train.micro_batch", (4,)),
         ("train.activation_checkpointing", ("none", "full")))


def test_moe_recipe_plans_ep_and_ep_wins_where_the_experts_do_not_fit_without_it():
    """The 1B MoE recipe on 8 H100s: the chosen layout is legal, fits its predicted memory, and the
    table names its ep. With zero=none (DDP) at 80 GiB the fastest layout keeps every expert on
    every rank (no all-to-all); at 20 GiB no layout without ep or pipelining fits (the experts'
    weights, gradients and AdamW state alone take most of it), and ep = 8 is the fastest."""
    cfg = load_config(MOE_1B, [])
    # the host's per-operator term left out: it counts the operators by running the model narrowed,
    # seconds of CPU for this one (tests/cost/test_op_count.py checks it); the step is then FLOP-bound
    h100 = dataclasses.replace(profiles()["h100"], op_overhead_us=0.0)
    result = search(cfg, 8, 80, h100, space=SPACE)
    best = result.layouts[0]
    chosen = with_values(cfg, best.values)
    assert preflight(chosen, 8).dp == best.layout.dp
    assert best.fits and best.peak <= USABLE_FRACTION * 80 * GIB
    assert {x.layout.ep for x in result.layouts} == {1, 2, 8}  # 16 does not divide dp = 8
    assert f"ep={best.layout.ep}" in best.describe().split()
    assert f" ep={best.layout.ep} " in _plan_layout_tool().to_text(result, 3, 0.0)

    # DDP (zero=none) at 80 and at 20 GiB: every legal layout fits 80 GiB, so the 20 GiB plan is the
    # same predictions under the smaller limit
    assert len(result.layouts) == result.legal
    ddp = [x for x in result.layouts if x.layout.zero == "none"]
    tight = [x for x in ddp if x.peak <= USABLE_FRACTION * 20 * GIB]
    assert ddp[0].layout.ep == 1 and ddp[0].layout.pp == 1
    assert tight[0].layout.ep == 8 and not [x for x in tight if x.layout.ep == 1 and x.layout.pp == 1]
    costs = model_costs(cfg.model)
    experts = sum(routed_experts(cfg.model, w)[0] for w, moe in zip(costs.widths, moe_layers(cfg.model)) if moe)
    assert 16.0 * experts > 0.75 * USABLE_FRACTION * 20 * GIB  # the experts' state at ep = 1: 78% of what fits
