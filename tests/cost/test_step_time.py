"""The step-time model's per-call terms (cost/step_time.py): collective latency, the collective
kinds' efficiencies, the vocab-parallel ends' tp collectives, DDP's buckets, ZeRO's units, the
bubble of unequal stages and a CPU host's shared cores, each against arithmetic by hand."""
import dataclasses

import pytest

from megatron_taper.cost.devices import profiles
from megatron_taper.cost.step_time import (
    RankWork,
    StepLayout,
    collective_seconds,
    ddp_bucket_elements,
    ring_seconds,
    step_time,
)

CPU = dataclasses.replace(profiles()["cpu"], cores=2, intra_node_gb_per_s=2.0, inter_node_gb_per_s=2.0, mfu=0.5,
                          all_gather_efficiency=0.25, reduce_scatter_efficiency=0.2, collective_latency_us=1000.0,
                          concurrent_efficiency=0.8, memory_tb_per_s=0.02)
WORK = RankWork(flops=1e9, linear_flops=8e8, recompute_flops=0.0, blocks=4, recomputed_blocks=0, params=1e6)
LAYOUT = StepLayout(tp=1, pp=1, dp=1, virtual=1, schedule="1f1b", zero="none", sequence_parallel=False,
                    micro_batch=2, microbatches=3, bf16=False, float8=False, overlap=False)


def test_collective_kinds_and_latency():
    assert collective_seconds("all_reduce", 8e6, 1, 1, CPU) == 0.0  # no group, no call
    assert collective_seconds("all_reduce", 8e6, 2, 2, CPU) == pytest.approx(1e-3 + ring_seconds(8e6, 2, 2e9, True))
    assert collective_seconds("all_gather", 8e6, 2, 2, CPU) == pytest.approx(1e-3 + 0.5 * 8e6 / (0.25 * 2e9))
    assert collective_seconds("reduce_scatter", 8e6, 2, 2, CPU) == pytest.approx(1e-3 + 0.5 * 8e6 / (0.2 * 2e9))
    h100 = profiles()["h100"]  # NCCL: one bus bandwidth for all three kinds, latency not modelled
    assert collective_seconds("all_gather", 8e6, 8, 8, h100) == ring_seconds(8e6, 8, 450e9, False)


def test_shared_cores_rate_and_the_hosts_bound():
    assert CPU.rank_share(1) == 1.0 and CPU.rank_share(2) == CPU.rank_share(4) == 0.8
    assert profiles()["h100"].rank_share(512) == 1.0
    # 4 ranks (dp = 4) on 2 cores: each computes at a core's shared rate, two at a time
    dp4 = dataclasses.replace(LAYOUT, dp=4, compute_share=0.8)
    alone = step_time([WORK], dp4, d_model=64, seq_len=128, device=CPU)
    shared = step_time([WORK], dataclasses.replace(dp4, host_cores=2), d_model=64, seq_len=128, device=CPU)
    quiet = step_time([WORK], dp4, d_model=64, seq_len=128, device=dataclasses.replace(CPU, collective_latency_us=0))
    assert 0 < quiet.dp < alone.dp  # the gradient all-reduce's buckets pay the latency per call
    # a rank waiting out a collective's latency is not busy: the bound counts the step without it
    assert shared.total == pytest.approx(4 * (quiet.compute + quiet.dp + quiet.optimizer) / 2)
    assert step_time([WORK], dataclasses.replace(dp4, host_cores=4), d_model=64, seq_len=128,
                     device=CPU).total == pytest.approx(alone.total)  # a core each: no bound


def test_tp_counts_the_vocab_parallel_ends():
    tp = dataclasses.replace(LAYOUT, tp=2)
    hidden = 2 * 128 * 64 * 4  # [b, S, d] fp32
    plain = step_time([WORK], tp, d_model=64, seq_len=128, device=CPU)
    ends = step_time([dataclasses.replace(WORK, vocab_collectives=4)], tp, d_model=64, seq_len=128, device=CPU)
    one = collective_seconds("all_reduce", hidden, 2, 2, CPU)
    assert plain.tp == pytest.approx(3 * 16 * one) and ends.tp == pytest.approx(3 * 20 * one)


def test_ddp_buckets_and_zero_units_each_pay_the_latency():
    dp = dataclasses.replace(LAYOUT, dp=2)
    ddp = step_time([WORK], dp, d_model=64, seq_len=128, device=CPU)
    buckets = 4  # 1e6 trainable elements: 4 buckets of 250k (the rule's floor is 2^18 = 262,144: 4 buckets)
    assert -(-1e6 // ddp_bucket_elements(0.0, 1e6, 2)) == buckets
    assert ddp.dp == pytest.approx(buckets * collective_seconds("all_reduce", 4e6 / buckets, 2, 2, CPU))
    fsdp = step_time([WORK], dataclasses.replace(dp, zero="fsdp2"), d_model=64, seq_len=128, device=CPU)
    units = WORK.blocks + 1  # each block and the root
    gather = units * collective_seconds("all_gather", 4e6 / units, 2, 2, CPU)
    scatter = units * collective_seconds("reduce_scatter", 4e6 / units, 2, 2, CPU)
    assert fsdp.dp == pytest.approx(3 * (2 * gather + scatter))  # per micro-batch, nothing overlapped on the CPU


def test_bubble_is_the_other_stages_time():
    """1F1B: the warm-up and drain pass through the stages other than the slowest."""
    pp = dataclasses.replace(LAYOUT, pp=2, microbatches=4, compute_share=CPU.rank_share(2))
    light = dataclasses.replace(WORK, flops=5e8, linear_flops=4e8)
    t = step_time([light, WORK], pp, d_model=64, seq_len=128, device=CPU)
    boundary = 2 * (4.0 * 2 * 128 * 64 / 2e9 + 1e-3)  # the activation forward, its gradient backward
    rate = 0.5 * 0.094e12 * 0.8  # two ranks share the two cores
    heavy_s, light_s = 3 * 1e9 * 256 / rate + boundary, 3 * 5e8 * 256 / rate + boundary
    assert t.parts["micro_batch_s"] == pytest.approx(heavy_s) and t.bubble == pytest.approx(light_s)


def test_cp_messages_by_kind():
    """Context parallelism's messages per block (cost/cp.py kinds): a halo is one hop each way, a
    chain's hops run one after another and make the ranks a wavefront ((cp - 1) blocks' time), or
    wait block by block where every block also meets all cp ranks (an all-gather beside it)."""
    cp = dataclasses.replace(LAYOUT, cp=4)
    hop = 8e3 / 2e9 + 1e-3  # 8 kB at the link, plus the latency
    plain = step_time([WORK], cp, d_model=64, seq_len=128, device=CPU)
    per_block = plain.compute / 3 / WORK.blocks  # one micro-batch's compute of one block

    def cp_seconds(*block: tuple) -> float:
        work = dataclasses.replace(WORK, cp_messages=tuple(block for _ in range(WORK.blocks)))
        return step_time([work], cp, d_model=64, seq_len=128, device=CPU).cp / 3

    assert cp_seconds(("halo", 8e3)) == pytest.approx(WORK.blocks * 2 * hop)
    assert cp_seconds(("chain", 8e3)) == pytest.approx(WORK.blocks * 2 * 3 * hop + 3 * per_block)
    gather = collective_seconds("all_gather", 8e3, 4, 4, CPU) + collective_seconds("reduce_scatter", 8e3, 4, 4, CPU)
    assert cp_seconds(("chain", 8e3), ("allgather", 8e3)) == pytest.approx(
        WORK.blocks * (2 * 3 * hop + gather + 3 * per_block))


def test_the_planner_charges_each_family_its_own_cp_messages():
    """Predictor: the Transformer's cp term is its K / V all-gather (the default), a Titans model's
    its chain of memory state (cost/cp.py), with the chain's wavefront wait."""
    from megatron_taper.config import load_config
    from megatron_taper.cost.plan import Predictor

    h100 = profiles()["h100"]
    for arch in ("transformer", "titans"):
        cfg = load_config("configs/tiny_taper.yaml", [f"model.arch={arch}", "model.seq_len=8192", "parallel.cp=2",
                                                      "train.global_batch=8", "train.micro_batch=1"])
        predictor = Predictor(cfg, h100)
        got = predictor.predict(cfg, 1, float("inf"))
        blocks = predictor.rank_cp_messages(1, 1, "1f1b", 1, 2, True, "allgather", 1)[0]
        kinds = {kind for block in blocks for kind, _ in block}
        assert len(blocks) == cfg.model.n_layers and got.step.cp > 0
        if arch == "transformer":
            assert kinds == {"allgather"}
        else:  # at least the wavefront: one block's compute per micro-batch (cp - 1 = 1)
            assert "chain" in kinds and "allgather" not in kinds
            assert got.step.cp >= got.step.compute / cfg.model.n_layers
