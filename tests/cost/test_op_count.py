"""Eager operators per micro-batch (cost/op_count.py) and their share of the step time
(cost/step_time.py): the count of a narrowed model is the real model's, a whole model is its ends
plus its blocks, and the time term is the larger of arithmetic and issue on a device that runs
ahead of the host (GPUs), their sum on a CPU."""
import dataclasses

import pytest
import torch

from megatron_taper.config import load_config
from megatron_taper.cost.devices import profiles
from megatron_taper.cost.op_count import count_ops, dispatched_ops, narrowed
from megatron_taper.cost.plan import Predictor
from megatron_taper.cost.step_time import RankWork, StepLayout, step_time


@pytest.mark.parametrize("recipe", ["tiny_taper", "tiny_titans", "tiny_bridge"])
def test_a_model_is_its_ends_plus_its_blocks_at_any_width(recipe):
    cfg = load_config(f"configs/{recipe}.yaml", []).model
    ops = count_ops(cfg)
    assert ops.block > ops.block_forward > 0 and ops.ends >= 0
    whole = narrowed(cfg, cfg.n_layers, cfg.seq_len)
    # 4 or 6 blocks, from the 1- and 2-block counts
    assert dispatched_ops(whole)[1] == ops.ends + cfg.n_layers * ops.block
    real_width = dataclasses.replace(cfg, n_layers=2)
    assert dispatched_ops(real_width)[1] == dispatched_ops(narrowed(cfg, 2, cfg.seq_len))[1]  # width-free


def test_a_family_refusing_the_narrow_widths_is_counted_at_widths_it_accepts(monkeypatch):
    """A family whose checks refuse NARROW's widths (here: 3 heads do not divide d_model 64) is
    counted at 16 per head: the same counts."""
    from megatron_taper.cost import op_count

    cfg = load_config("configs/tiny_taper.yaml", []).model
    want = count_ops(cfg)
    monkeypatch.setattr(op_count, "NARROW", {**op_count.NARROW, "n_heads": 3})
    assert narrowed(cfg, 2, 64).d_model == 16 * cfg.n_heads and count_ops(cfg) == want
    with pytest.raises(op_count.ConfigError, match="n_layers"):  # refused at every width: the family's error
        narrowed(cfg, 0, 64)


def test_chunked_families_scale_with_the_sequence_and_the_tree_is_one_block():
    titans = load_config("configs/tiny_titans.yaml", []).model
    full, half = count_ops(titans), count_ops(titans, titans.seq_len // 2)
    assert full.block - half.block > 0.15 * full.block  # a chunk loop: the second half's chunks add operators
    taper = load_config("configs/tiny_taper.yaml", []).model
    assert count_ops(taper, 64) == count_ops(taper)  # attention: one operator whatever the length
    cfg = load_config("configs/tiny_titans.yaml", []).model  # beyond the cap: along the line of two counts
    assert count_ops(cfg, cap=64).block == pytest.approx(count_ops(cfg).block, rel=0.07)
    # the linear memory's loop-free scan: as many operators at 1024 tokens as at 512, and about as many at 128
    linear = load_config("configs/tiny_linear_memory_caching.yaml", []).model
    assert count_ops(linear, 1024) == count_ops(linear, 512)
    assert count_ops(linear, 512, cap=128).block == pytest.approx(count_ops(linear, 512).block, rel=0.05)
    tree = count_ops(load_config("configs/tiny_tree.yaml", []).model)
    assert tree.ends == 0 and tree.block > 0


def test_issue_time_overlaps_on_gpus_and_adds_on_a_cpu():
    work = RankWork(flops=1e6, linear_flops=5e5, recompute_flops=0.0, blocks=2, recomputed_blocks=0, params=1e3,
                    ops=10_000)
    gpu = dataclasses.replace(profiles()["h200"], op_overhead_us=10.0)
    layout = StepLayout(tp=1, pp=1, dp=1, virtual=1, schedule="1f1b", zero="none", sequence_parallel=False,
                        micro_batch=1, microbatches=2, bf16=True, float8=False, overlap=True)
    math = 3 * 1e6 * 128 / gpu.matmul_flops(True)
    assert step_time([work], layout, 64, 128, gpu).compute == pytest.approx(2 * max(math, 0.1))
    cpu = dataclasses.replace(profiles()["cpu"], op_overhead_us=10.0, cores=0)
    flat = dataclasses.replace(layout, bf16=False, overlap=False)
    math = 3 * 1e6 * 128 / cpu.matmul_flops(False)
    assert step_time([work], flat, 64, 128, cpu).compute == pytest.approx(2 * (math + 0.1))


def test_the_planner_counts_recomputed_forwards_and_the_ends_on_the_last_stage():
    cfg = load_config("configs/tiny_taper.yaml", ["parallel.pp=2", "parallel.microbatches=4"])
    rng = torch.random.get_rng_state()
    ops = count_ops(cfg.model)
    assert torch.equal(torch.random.get_rng_state(), rng)  # counting draws from a forked generator
    predictor = Predictor(cfg, profiles()["h200"])
    first, last = map(len, predictor.rank_layers(2, 1, "1f1b"))  # the FLOPs-balanced split
    assert predictor.rank_ops(2, 1, "1f1b", [0, 0], 1) == [first * ops.block, last * ops.block + ops.ends]
    assert predictor.rank_ops(2, 1, "1f1b", [1, 1], 1) == [first * ops.block + ops.block_forward,
                                                          last * ops.block + ops.block_forward + ops.ends]
    assert torch.get_default_dtype() == torch.float32  # counting leaves the process as it was


def test_op_checkpointing_pays_the_policy_per_forward_operator_in_series_when_eager():
    """activation_checkpointing=op, eager: each micro-batch pays its blocks' forward operators x
    op_checkpoint_overhead_us in series (cost/step_time.py); on a GPU the recomputed elementwise
    bytes hide, for this tiny model, under its operators' issue time. Compiled, the policy runs
    while tracing (none of its calls in a compiled step, checked on the CPU): no cost."""
    from megatron_taper.cost.preflight import step_split

    h200 = profiles()["h200"]
    predictor = None  # one for the four configurations: the same model, its counts made once
    for compile_setting in ("false", "true"):
        base = ["train.precision=bf16", f"train.compile={compile_setting}"]
        cfg = load_config("configs/tiny_taper.yaml", base)
        op_cfg = load_config("configs/tiny_taper.yaml", [*base, "train.activation_checkpointing=op"])
        predictor = predictor or Predictor(cfg, h200)
        none, op = predictor.predict(cfg, 1, float("inf")), predictor.predict(op_cfg, 1, float("inf"))
        per_micro_batch = (predictor.op_counts(1).block_forward * cfg.model.n_layers * h200.op_checkpoint_overhead_us
                           * 1e-6 if compile_setting == "false" else 0.0)
        micro_batches = step_split(cfg.parallel, cfg.train, 1)[1]
        assert op.step.total - none.step.total == pytest.approx(micro_batches * per_micro_batch, rel=1e-9, abs=1e-12)


def test_compiled_blocks_cost_the_host_their_launches_not_their_eager_operators():
    """train.compile: a measured family's blocks count the launches of their compiled graphs, its
    eager operators x the measured ratio (cost/speedups.json compiled_launches: 44 launches for a
    Transformer block's 225 operators, benchmarks/compiled_launches.py); the ends stay eager; a
    family not measured keeps its eager count. On an H200 the tiny model is host-bound, so its
    compiled step is that much shorter."""
    from megatron_taper.cost.float8 import read_speedups
    from megatron_taper.cost.op_count import compiled_launches
    from megatron_taper.cost.preflight import step_split

    measured = read_speedups()["compiled_launches"]["transformer"]
    cfg = load_config("configs/tiny_taper.yaml", ["train.precision=bf16", "train.compile=true"])
    assert compiled_launches(cfg.model) == (measured["forward"], measured["block"])
    assert 0.1 < measured["block"] < 0.3  # 44 / 225, measured under bf16 autocast
    ops, n = count_ops(cfg.model), cfg.model.n_layers
    h200 = profiles()["h200"]
    predictor = Predictor(cfg, h200)
    # one recomputed block: its forward again, as launches too
    assert predictor.rank_ops(1, 1, "1f1b", [1], 1, compiled=True) == pytest.approx(
        [n * ops.block * measured["block"] + ops.block_forward * measured["forward"] + ops.ends], rel=1e-12)
    compiled = predictor.predict(cfg, 1, float("inf"))
    eager = predictor.predict(load_config("configs/tiny_taper.yaml", ["train.precision=bf16", "train.compile=false"]),
                              1, float("inf"))
    micro_batches = step_split(cfg.parallel, cfg.train, 1)[1]
    issue = micro_batches * h200.op_overhead_us * 1e-6
    assert eager.step.compute == pytest.approx(issue * (n * ops.block + ops.ends), rel=1e-9)  # host-bound
    assert compiled.step.compute == pytest.approx(issue * (n * ops.block * measured["block"] + ops.ends), rel=1e-9)
    assert compiled_launches(load_config("configs/tiny_titans.yaml", []).model) == (1.0, 1.0)  # not measured
