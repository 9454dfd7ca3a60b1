"""Exactness of the min-max stage partition against brute force, tie-breaking, memory limits, errors."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_taper.config import load_config
from megatron_taper.cost.partition import (
    MemoryModel,
    evaluate,
    in_flight_microbatches,
    partition,
    plan_pipeline,
)


def all_splits(n_layers: int, n_stages: int):
    for cuts in itertools.combinations(range(1, n_layers), n_stages - 1):
        yield (0, *cuts, n_layers)


def brute_force(costs, n_stages, first=0, last=0, memory=None):
    """Best split by the documented rule: bottleneck, then sum of squares, then smallest bounds."""
    best = None
    for bounds in all_splits(len(costs), n_stages):
        p = evaluate(bounds, costs, first, last)
        if memory is not None and not _fits(memory, bounds):
            continue
        key = (p.bottleneck, sum(c * c for c in p.costs), bounds)
        if best is None or key < best[0]:
            best = (key, p)
    return None if best is None else best[1]


def _fits(memory, bounds):
    n = len(bounds) - 1
    for s in range(n):
        layers = range(bounds[s], bounds[s + 1])
        static = sum(memory.static[i] for i in layers) + (memory.first_static if s == 0 else 0) \
            + (memory.last_static if s == n - 1 else 0)
        act = sum(memory.act[i] for i in layers) + (memory.first_act if s == 0 else 0) \
            + (memory.last_act if s == n - 1 else 0)
        if static + act * memory.in_flight[s] > memory.limits[s]:
            return False
    return True


def test_deepspeed_counter_example():
    p = partition([9, 1, 2, 7, 7, 4, 9, 19, 5], 4)
    assert p.bottleneck == 20
    assert p.stages == [[0, 1, 2, 3], [4, 5, 6], [7], [8]]


@st.composite
def problems(draw):
    n = draw(st.integers(1, 12))
    s = draw(st.integers(1, min(5, n)))
    costs = draw(st.lists(st.integers(0, 30), min_size=n, max_size=n))
    first = draw(st.integers(0, 20))
    last = draw(st.integers(0, 20))
    return costs, s, first, last


@settings(max_examples=300, deadline=None)
@given(problems())
def test_matches_brute_force(problem):
    costs, s, first, last = problem
    p = partition(costs, s, first, last)
    ref = brute_force(costs, s, first, last)
    assert p.bottleneck == ref.bottleneck
    assert p.bounds == ref.bounds  # the documented tie-breaking, exactly
    assert all(len(stage) >= 1 for stage in p.stages)
    assert sum(p.stages, []) == list(range(len(costs)))


@settings(max_examples=200, deadline=None)
@given(problems(), st.data())
def test_memory_limits_match_brute_force(problem, data):
    costs, s, first, last = problem
    n = len(costs)
    static = data.draw(st.lists(st.integers(0, 10), min_size=n, max_size=n))
    act = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    limit = data.draw(st.integers(5, 80))
    memory = MemoryModel(static, act, in_flight_microbatches(s, 4), [limit] * s, first_static=3, last_static=4)
    ref = brute_force(costs, s, first, last, memory)
    if ref is None:
        with pytest.raises(ValueError, match="parallel.pp_memory_gb"):
            partition(costs, s, first, last, memory)
        return
    p = partition(costs, s, first, last, memory)
    assert (p.bottleneck, p.bounds) == (ref.bottleneck, ref.bounds)


def test_memory_limit_moves_layers_off_early_stages():
    # Under 1F1B stage 0 holds 4 micro-batches: a tight limit pushes layers later.
    costs = [1.0] * 8
    act = [1.0] * 8
    free = partition(costs, 4)
    memory = MemoryModel([0.0] * 8, act, in_flight_microbatches(4, 8), [5.0] * 4)
    limited = partition(costs, 4, memory=memory)
    assert free.stages[0] == [0, 1]
    assert len(limited.stages[0]) == 1 and limited.bottleneck > free.bottleneck


def test_in_flight():
    assert in_flight_microbatches(4, 8) == [4, 3, 2, 1]
    assert in_flight_microbatches(4, 2) == [2, 2, 2, 1]
    assert in_flight_microbatches(3, 5, "gpipe") == [5, 5, 5]


def test_errors():
    with pytest.raises(ValueError, match="non-negative"):
        partition([1, -2, 3], 2)
    memory = MemoryModel([10.0] * 4, [0.0] * 4, [1, 1], [15.0, 15.0])
    with pytest.raises(ValueError, match=r"no split of 4 layers into 2 pipeline stages fits.*1\.33x"):
        partition([1, 1, 1, 1], 2, memory=memory)


def _model(**over):
    base = {"model.n_layers": 10, "model.d_model": 256, "model.n_heads": 4, "model.mlp_width": 512,
            "model.vocab_size": 1000, "model.seq_len": 128}
    base.update(over)
    return load_config(None, [f"{k}={v}" for k, v in base.items()]).model


def test_plan_tapered_flops_beats_uniform():
    plan = plan_pipeline(_model(**{"model.n_layers": 12}), 4)
    assert sum(plan.stage_layers, []) == list(range(12))
    assert plan.bottleneck_over_ideal < plan.uniform_bottleneck_over_ideal
    # cosine taper: early layers are wider, so the first stage gets no more layers than the last
    assert len(plan.stage_layers[0]) <= len(plan.stage_layers[-1])
    uniform = plan_pipeline(_model(), 4, balance="uniform")
    assert [len(s) for s in uniform.stage_layers] == [2, 2, 3, 3]  # extra layers on later stages
    assert uniform.bottleneck_over_ideal == pytest.approx(uniform.uniform_bottleneck_over_ideal)


def test_plan_virtual_stages_round_robin():
    plan = plan_pipeline(_model(), 2, virtual=2, schedule="interleaved_1f1b")
    assert len(plan.stages) == 4 and [s.rank for s in plan.stages] == [0, 1, 0, 1]
    assert plan.rank_chunks(1) == [1, 3]


def test_plan_memory_limit_error_names_key():
    with pytest.raises(ValueError, match="parallel.pp_memory_gb"):
        plan_pipeline(_model(), 2, memory_gb=[0.001])
    plan = plan_pipeline(_model(), 2, memory_gb=[10.0], microbatches=4, micro_batch=2)
    assert all(s.static_bytes + s.act_bytes <= 10 * 2**30 for s in plan.stages)


def test_plan_profile_uses_measured_times():
    import torch

    from megatron_taper.models import build_model
    from megatron_taper.parallel.pp.profile import profile_layer_times

    cfg = _model(**{"model.n_layers": 4, "model.d_model": 64, "model.n_heads": 2, "model.mlp_width": 128,
                    "model.seq_len": 16})
    model = build_model(cfg)
    model.init_weights(0)
    times, emb, head = profile_layer_times(model, 2, 16, torch.device("cpu"), warmup=1, iters=1)
    assert len(times) == 4 and all(t > 0 for t in times) and emb > 0 and head > 0
    plan = plan_pipeline(cfg, 2, balance="profile", measured=([1.0, 1.0, 1.0, 5.0], 0.0, 0.0))
    assert plan.stage_layers == [[0, 1, 2], [3]]
    with pytest.raises(ValueError, match="profile"):
        plan_pipeline(cfg, 2, balance="profile")


def test_interleaved_in_flight_follows_torch_schedule():
    """interleaved_in_flight against the action lists torch's ScheduleInterleaved1F1B builds
    (its per-rank planner, given the schedule's shape attributes): the most forwards without
    their backward yet, per rank."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    from megatron_taper.cost.partition import interleaved_in_flight

    for pp, v, m in [(2, 2, 4), (2, 2, 2), (4, 2, 8), (4, 3, 4), (2, 4, 6)]:
        rounds = max(1, m // pp)
        shape = SimpleNamespace(n_local_stages=v, pp_group_size=pp, microbatches_per_round=m // rounds,
                                _n_microbatches=m)
        for rank in range(pp):
            live = most = 0
            for action in ScheduleInterleaved1F1B._calculate_single_rank_operations(shape, rank):
                if action is not None:
                    live += 1 if action.computation_type == _ComputationType.FORWARD else -1
                    most = max(most, live)
            assert interleaved_in_flight(pp, v, m, rank) == most, (pp, v, m, rank, most)
