"""Mixture of experts with and without expert parallelism on the CPU (gloo): tokens/s, peak memory
per rank, and the all-to-all bytes measured against the cost model's.

    python benchmarks/moe_ep.py [--steps 6] [--rounds 3] [key=value ...]

Two fresh processes (1 thread each) per layout build the same MoE model at parallel.ep=1 (dp=2
through DDP: every rank holds every expert) and at parallel.ep=2 (each rank half the experts,
tokens sent by all-to-all: parallel/ep.py), and run whole training steps (forward + backward of
the rank's micro-batches, gradient reduction, clipping, AdamW) on the same random batches. One
process gives the baseline. The layouts run one after the other (not interleaved): on a shared
machine their times carry its noise. With parallel.zero=fsdp2 among the overrides, ep=1 shards every
expert over the 2 ranks and ep=2 keeps each rank's experts whole, outside fsdp2's shards
(results/moe_ep_fsdp2_cpu_*.json).

  tokens_per_s      median over rounds of the whole job's tokens / time
  peak_rss_gb       per rank, the process's host-RSS high-water mark at the end (runtime included)
  all_to_all        ep=2, per step and rank: the bytes rank 0 sent to the other rank through the
                    MoE layers' all-to-alls (counted from the splits by parallel/ep.py, forward and
                    backward), beside cost/block.py moe_all_to_all_bytes (balanced routing): their
                    ratio is the routing's imbalance toward the other rank's experts
  ep_rank_load_max  ep=2: per MoE layer, the rows the busier rank's experts received over the mean,
                    over all the run's forwards (from the layers' load counters), beside the
                    parallel.ep_imbalance the planner assumes (a per-micro-batch figure: larger)
Prints one JSON object.
"""
from __future__ import annotations

import resource
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from rounds import parse_round_args, print_round_result

from megatron_taper.config import load_config
from megatron_taper.cost.block import moe_all_to_all_bytes
from megatron_taper.models.moe import moe_modules
from megatron_taper.parallel.spawn import run_distributed
from megatron_taper.taper import moe_layers
from megatron_taper.training.build import build_run

SHAPE = ["model.n_layers=4", "model.d_model=128", "model.n_heads=4", "model.mlp_width=384", "model.taper.multiple=32",
         "model.vocab_size=4096", "model.seq_len=128", "model.moe.experts=8", "model.moe.top_k=2",
         "model.moe.expert_width=96", "model.moe.first_dense=1", "model.moe.bias_balance=true",
         "train.global_batch=8", "train.micro_batch=2", "train.device=cpu", "train.precision=fp32",
         "run.tensorboard=false"]


def batches(cfg, steps: int, dp: int, dp_rank: int) -> list[list[torch.Tensor]]:
    """Per step, this rank's micro-batches of that step's global batch (the same tokens at any dp)."""
    t, m = cfg.train, cfg.model
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        rows = torch.randint(0, m.vocab_size, (t.global_batch, m.seq_len + 1), generator=gen)
        mine = rows[dp_rank * t.global_batch // dp:(dp_rank + 1) * t.global_batch // dp]
        out.append(list(mine.split(t.micro_batch)))
    return out


def step(run, micro_batches: list[torch.Tensor]) -> None:
    run.model.forward_backward(micro_batches, lambda: torch.autocast("cpu", enabled=False))
    run.model.optimizer_step(run.optimizer, run.cfg.train.grad_clip)


def timed(run, data: list[list[torch.Tensor]]) -> float:
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    for micro_batches in data:
        step(run, micro_batches)
    if dist.is_initialized():
        dist.barrier()
    return time.perf_counter() - start


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def rank_main(ep: int, overrides: list[str], steps: int, rounds: int) -> dict:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(load_config(None, SHAPE + [f"run.dir={tmp}", f"parallel.ep={ep}", *overrides]))
        cfg = run.cfg
        data = batches(cfg, steps, world, rank)
        timed(run, data[:1])  # warm-up (DDP rebuilds its buckets after its first step)
        layers = [m for _, m in moe_modules(run.model.module)]
        dispatches = [m.dispatch for m in layers if m.dispatch is not None]
        sent_before = sum(d.sent_bytes for d in dispatches)
        tokens = steps * cfg.train.global_batch * cfg.model.seq_len
        rates = [tokens / timed(run, data) for _ in range(rounds)]
        out = {"tokens_per_s": statistics.median(rates), "peak_rss_gb": peak_rss_gb()}
        if dispatches:
            m = cfg.model
            sent = (sum(d.sent_bytes for d in dispatches) - sent_before) / (rounds * steps)
            predicted = sum(moe_layers(m)) * moe_all_to_all_bytes(m, cfg.train.global_batch // world * m.seq_len,
                                                                  world, 4)
            out.update({"all_to_all_bytes_per_step": sent, "model_all_to_all_bytes_per_step": predicted,
                        "measured_over_model": sent / predicted, "ep_rank_load_max": ep_rank_loads(layers, ep),
                        "planner_ep_imbalance": cfg.parallel.ep_imbalance})
    return out


def ep_rank_loads(layers, ep: int) -> list[float]:
    """Per MoE layer: its assignments since the build summed over the ranks, grouped by the ep rank
    holding each expert; the largest group over the mean (a collective)."""
    out = []
    for moe in layers:
        load = moe.load_log.clone()
        dist.all_reduce(load)
        per_rank = load.view(ep, -1).sum(1)
        out.append(float(per_rank.max() / per_rank.mean()))
    return out


def one_process(overrides: list[str], steps: int, rounds: int) -> float:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(load_config(None, SHAPE + [f"run.dir={tmp}", *overrides]))
        data = batches(run.cfg, steps, 1, 0)
        tokens = steps * run.cfg.train.global_batch * run.cfg.model.seq_len
        timed(run, data[:1])
        return statistics.median(tokens / timed(run, data) for _ in range(rounds))


def main() -> None:
    args = parse_round_args(__doc__, steps=6)
    layouts = {f"ep{ep}": run_distributed(rank_main, 2, ep, args.overrides, args.steps, args.rounds, timeout=3600,
                                          device="cpu") for ep in (1, 2)}
    single = one_process(args.overrides, args.steps, args.rounds)
    print_round_result("moe_ep", SHAPE, args, single, one_process_peak_rss_gb=peak_rss_gb(),
                       **{f"{name}_ranks": ranks for name, ranks in layouts.items()},
                       ep2_over_ep1=layouts["ep2"][0]["tokens_per_s"] / layouts["ep1"][0]["tokens_per_s"])


if __name__ == "__main__":
    main()
