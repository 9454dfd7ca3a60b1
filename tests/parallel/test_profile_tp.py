"""parallel.pp_balance=profile under tensor parallelism, on 2 gloo ranks (one tp=2 group).

make_plan is called as build_run calls it, with the meta model: each tp rank must time its own
shard of each block (parameters split by the family's tp plan, the tp collectives in the step),
never the whole block or model; with sequence parallelism the blocks see seq_len / tp positions.
The plan built from those times must be a valid split with the smallest bottleneck.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from megatron_taper.config import load_config
from tests.helpers.harness import run_distributed

pytestmark = pytest.mark.multiprocess

MODEL = ["model.n_layers=4", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=128",
         "model.seq_len=32", "train.global_batch=4", "train.micro_batch=2", "train.device=cpu", "train.seed=3",
         "train.precision=bf16"]


def _profile_plans(variants: list[list[str]]) -> list[dict]:
    return [_profile_plan(overrides) for overrides in variants]


def _profile_plan(overrides: list[str]) -> dict:
    """make_plan's stage layers, the measured times it used, and what each timed block held (its
    local parameter elements, its parallel linears, its input's sequence length)."""
    from megatron_taper.models import build_model
    from megatron_taper.parallel.context import init_parallel
    from megatron_taper.parallel.pp import profile
    from megatron_taper.parallel.pp import schedule as pipeline

    cfg = load_config(None, MODEL + overrides)
    ctx = init_parallel(load_config(None, MODEL + ["parallel.tp=2"]).parallel, "cpu")
    with torch.device("meta"):
        model = build_model(cfg.model)
    pieces: list[dict] = []
    measured: list = []
    block_run, meta_times = profile._block_run, pipeline.profile_meta_layer_times

    def spy_block(block, args, autocast):
        pieces.append({"numel": sum(p.numel() for p in block.parameters()), "seq": args[0].shape[1],
                       "parallel": sorted({type(m).__name__ for m in block.modules() if "Parallel" in
                                           type(m).__name__})})
        return block_run(block, args, autocast)

    def spy_times(*args, **kwargs):
        measured.append(meta_times(*args, **kwargs))
        return measured[-1]

    profile._block_run, pipeline.profile_meta_layer_times = spy_block, spy_times
    try:
        plan = pipeline.make_plan(model, ctx, cfg.model, cfg.parallel, cfg.train)
    finally:
        profile._block_run, pipeline.profile_meta_layer_times = block_run, meta_times
    full = [sum(p.numel() for p in block.parameters()) for block in model.layers.values()]
    return {"stages": plan.stage_layers, "measured": measured[0], "pieces": pieces, "full": full}


def _best_bottleneck(times: list[float], first: float, last: float) -> float:
    n = len(times)
    return min(max(first + sum(times[:k]), sum(times[k:]) + last) for k in range(1, n))


def test_profile_under_tp_times_each_ranks_shard():
    variants = [["parallel.pp=2", "parallel.tp=2", "parallel.pp_balance=profile"],
                ["parallel.pp=2", "parallel.tp=2", "parallel.pp_balance=profile", "parallel.sequence_parallel=true"]]
    ranks = run_distributed(_profile_plans, 2, variants, timeout=120)
    d = 64
    for v, (r0, r1) in enumerate(zip(*ranks)):
        sp = "parallel.sequence_parallel=true" in variants[v]
        assert r0["stages"] == r1["stages"] and r0["measured"] == r1["measured"]  # one plan on every rank
        stages = r0["stages"]
        assert len(stages) == 2 and all(stages) and list(itertools.chain(*stages)) == [0, 1, 2, 3]
        times, first, last = r0["measured"]
        assert len(times) == 4 and all(t > 0 for t in [*times, first, last])
        k = len(stages[0])
        bottleneck = max(first + sum(times[:k]), sum(times[k:]) + last)
        assert bottleneck == pytest.approx(_best_bottleneck(times, first, last))  # the balanced split
        for i, (p0, p1) in enumerate(zip(r0["pieces"], r1["pieces"])):
            # each rank holds half of every matrix; the two norms (d each) are replicated
            assert p0["numel"] < r0["full"][i] and p0["numel"] + p1["numel"] == r0["full"][i] + 2 * d, (v, i)
            assert p0["parallel"] == ["ColumnParallelLinear", "RowParallelLinear"]
            assert p0["seq"] == (16 if sp else 32)
        assert len(r0["pieces"]) == 4
