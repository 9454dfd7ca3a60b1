"""Context parallelism composed with pipeline parallelism and FSDP2 (one process as reference).

The model, batches and steps are test_context_parallel.py's (tests/helpers/cp_harness.py: 2
layers, d=64, GQA, seq_len 64, 3 AdamW steps of 2 micro-batches), and so are the tolerances and
why they hold: the cp run computes the same fp32 sums in another order. Pipelining moves the
[b, S / cp, D] hidden states between stages unchanged; FSDP2 shards over dp x cp and reduce-
scatters the gradients in fp32 (the sum over dp x cp in another order than DDP's all-reduce).
"""
import pytest

from tests.helpers.cp_harness import compare, merge_stages, reference, stage_worker
from tests.helpers.harness import run_distributed
from tests.parallel.test_context_parallel import MODEL

pytestmark = pytest.mark.multiprocess


def _reference(overrides):
    return reference(MODEL + [o for o in overrides if o.startswith("model.")])


def test_cp2_with_pp2_and_with_fsdp2_over_dp_x_cp():
    """4 processes: cp=2 x pp=2 under 1F1B, interleaved 1F1B and ZB-V (4 layers: 2 chunks per
    rank; each stage's micro-batches are [b, S / 2] slices, the last stage computes the loss
    shares; ZB-V's split backward runs the reduce-scatter of K/V gradients in its input-gradient
    pass); cp=2 x dp=2 with fsdp2 (each parameter sharded over the 4
    ranks of dp x cp); cp=2 x tp=2 with sequence parallelism (each tp rank holds 16 of its cp
    slice's 32 tokens, which straddle the slice's two chunks; attention's RoPE tables are those of
    the slice's true positions), RoPE with the all-gather and Gated Attention with the ring."""
    layouts = {"cp=2 x pp=2 1f1b": ["parallel.cp=2", "parallel.pp=2"],
               "cp=2 x pp=2 interleaved_1f1b": ["parallel.cp=2", "parallel.pp=2", "model.n_layers=4",
                                                "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual=2"],
               "cp=2 x pp=2 zbv": ["parallel.cp=2", "parallel.pp=2", "model.n_layers=4", "parallel.pp_schedule=zbv"],
               "cp=2 x dp=2 fsdp2": ["parallel.cp=2", "parallel.zero=fsdp2"],
               "cp=2 x tp=2 sequence parallel rope": ["parallel.cp=2", "parallel.tp=2",
                                                      "parallel.sequence_parallel=true"],
               "cp=2 x tp=2 sequence parallel gated ring": ["parallel.cp=2", "parallel.tp=2",
                                                            "parallel.sequence_parallel=true",
                                                            "parallel.cp_attention=ring", "model.arch=gated_attention"]}
    got = merge_stages(run_distributed(stage_worker, 4, [MODEL + o for o in layouts.values()], timeout=240))
    for (label, overrides), rec in zip(layouts.items(), got):
        compare(rec, _reference(overrides), label)


def test_cp2_with_fsdp2_at_dp1():
    """2 processes: cp=2 x dp=1 with fsdp2, which shards over the cp group (dp x cp = 2): the
    Transformer, and Titans (its memory state passed between the slices, parallel/cp/state.py;
    test_cp_titans.py's model and tolerances)."""
    from tests.parallel.test_cp_titans import MODEL as TITANS
    from tests.parallel.test_cp_titans import TOLERANCES as TITANS_TOLERANCES

    overrides = ["parallel.cp=2", "parallel.zero=fsdp2"]
    got = merge_stages(run_distributed(stage_worker, 2, [MODEL + overrides, TITANS + overrides], timeout=120))
    compare(got[0], _reference(overrides), "cp=2 fsdp2")
    compare(got[1], reference(TITANS), "titans cp=2 fsdp2", TITANS_TOLERANCES)


def test_cp2_with_compile():
    """2 processes, 2 steps: cp=2 with train.compile=true (each block compiled; the K/V all-gather
    traces into the block's graph without a graph break). Compiled kernels sum in another order,
    within the same tolerances."""
    overrides = ["parallel.cp=2", "train.compile=true"]
    got = merge_stages(run_distributed(stage_worker, 2, [MODEL + overrides], 2, timeout=180))[0]
    compare(got, reference(MODEL, steps=2), "cp=2 compile")


def test_memory_model_and_partition_shard_the_state_over_dp_x_cp():
    """fsdp2 at cp=2 x dp=1 shards the state over 2 ranks, as at dp=2 (cost/memory.py); the pipeline
    plan at cp=2 x pp=2 books per rank the static bytes of dp=2 x pp=2 (the same 2 micro-batches of
    2 sequences per rank) and a lower peak: each rank keeps the activations of half the tokens
    (ring: no K/V of the whole sequence)."""
    from megatron_taper.config import load_config
    from megatron_taper.cost.memory import MemorySetup, model_memory
    from megatron_taper.parallel.pp.schedule import plan_stages

    def cfg(overrides):
        return load_config(None, MODEL + ["parallel.zero=fsdp2", "train.device=cpu", *overrides])

    def static(overrides, dp):
        c = cfg(overrides)
        return model_memory(c.model, MemorySetup.from_config(c.parallel, c.train, dp, False)).stage(range(2)).static

    assert static(["parallel.cp=2"], 1) == static([], 2) < static(["parallel.cp=2", "parallel.zero=none"], 1)
    ring = ["parallel.pp=2", "parallel.cp_attention=ring"]
    plans = {cp: plan_stages(c.model, c.parallel, c.train, 2 // cp)
             for cp, c in ((1, cfg([*ring, "train.global_batch=8"])), (2, cfg([*ring, "parallel.cp=2"])))}
    for rank in range(2):
        assert plans[2].rank_static_bytes(rank) == plans[1].rank_static_bytes(rank)
        assert plans[2].rank_peak_bytes(rank) < plans[1].rank_peak_bytes(rank)
