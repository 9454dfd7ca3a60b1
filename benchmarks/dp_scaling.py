"""Data-parallel step throughput: torch DDP (parallel.zero=none) vs the per-parameter all-reduce
loop it replaced vs fsdp2, at dp=2 on gloo, next to one process.

Every engine runs the same step (forward + backward of the rank's micro-batches, gradient
reduction, clipping, AdamW) on the same random batches. Two processes run all three engines
alternately in rounds, so machine noise hits each alike; one process (1 thread, like each rank)
gives the baseline. Prints one JSON object: median tokens/s (whole job) of each, and ratios.

    python benchmarks/dp_scaling.py [--steps 10] [--rounds 3] [key=value ...]

"old_loop" is kept here only as the baseline: the model's parameters, one blocking all-reduce
(AVG over dp) per parameter after the whole backward, then the same clipping and AdamW.
"""
from __future__ import annotations

import contextlib
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from rounds import parse_round_args, print_round_result

from megatron_taper.config import load_config
from megatron_taper.parallel.spawn import run_distributed
from megatron_taper.training.build import build_run

SHAPE = ["model.n_layers=6", "model.d_model=256", "model.n_heads=4", "model.mlp_width=688",
         "model.taper.multiple=16", "model.vocab_size=4096", "model.seq_len=256", "train.global_batch=8",
         "train.micro_batch=4", "train.device=cpu", "train.precision=fp32", "run.tensorboard=false"]
ENGINES = ("ddp", "old_loop", "fsdp2")


def batches(cfg, steps: int, dp: int, dp_rank: int) -> list[list[torch.Tensor]]:
    """Per step, this rank's micro-batches of that step's global batch (the same tokens at any dp)."""
    t, m = cfg.train, cfg.model
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        rows = torch.randint(0, m.vocab_size, (t.global_batch, m.seq_len + 1), generator=g)
        mine = rows.view(dp, -1, m.seq_len + 1)[dp_rank]
        out.append(list(mine.split(t.micro_batch)))
    return out


def old_loop_step(run, micro_batches: list[torch.Tensor]) -> None:
    pm = run.model
    for tokens in micro_batches:
        loss = pm.loss_fn(pm.module(tokens[:, :-1]), tokens[:, 1:])
        (loss / len(micro_batches)).backward()
    for p in pm.module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=pm.ctx.dp_group)
    pm.clip_gradients(run.cfg.train.grad_clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)


def engine_step(run, micro_batches: list[torch.Tensor]) -> None:
    run.model.forward_backward(micro_batches, contextlib.nullcontext)
    run.model.optimizer_step(run.optimizer, run.cfg.train.grad_clip)


def timed(step, run, data: list[list[torch.Tensor]], barrier: bool) -> float:
    if barrier:
        dist.barrier()
    start = time.perf_counter()
    for micro_batches in data:
        step(run, micro_batches)
    if barrier:
        dist.barrier()
    return time.perf_counter() - start


def build(overrides: list[str], engine: str, run_dir: str):
    zero = "fsdp2" if engine == "fsdp2" else "none"
    cfg = load_config(None, SHAPE + [f"run.dir={run_dir}", f"parallel.zero={zero}", *overrides])
    run = build_run(cfg)
    if engine == "old_loop":
        run.model.dp_module = None  # the plain module; old_loop_step reduces by hand
    return run


def rank_main(overrides: list[str], steps: int, rounds: int) -> dict[str, float]:
    """On each of the dp processes: the median tokens/s (whole job) of each engine."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {e: build(overrides, e, tmp) for e in ENGINES}
        cfg = runs["ddp"].cfg
        data = batches(cfg, steps, world, rank)
        tokens = steps * cfg.train.global_batch * cfg.model.seq_len
        step_of = {"ddp": engine_step, "old_loop": old_loop_step, "fsdp2": engine_step}
        for e in ENGINES:  # warm-up (DDP rebuilds its buckets after its first step)
            timed(step_of[e], runs[e], data[:2], barrier=True)
        rates: dict[str, list[float]] = {e: [] for e in ENGINES}
        for _ in range(rounds):
            for e in ENGINES:
                rates[e].append(tokens / timed(step_of[e], runs[e], data, barrier=True))
    return {e: statistics.median(r) for e, r in rates.items()}


def one_process(overrides: list[str], steps: int, rounds: int) -> float:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        run = build(overrides, "ddp", tmp)
        data = batches(run.cfg, steps, 1, 0)
        tokens = steps * run.cfg.train.global_batch * run.cfg.model.seq_len
        timed(engine_step, run, data[:2], barrier=False)
        return statistics.median(tokens / timed(engine_step, run, data, barrier=False) for _ in range(rounds))


def main() -> None:
    args = parse_round_args(__doc__, steps=10)
    device = load_config(None, SHAPE + args.overrides).train.device
    dp2 = run_distributed(rank_main, 2, args.overrides, args.steps, args.rounds, timeout=3600, device=device)[0]
    single = one_process(args.overrides, args.steps, args.rounds)
    print_round_result("dp_scaling", SHAPE, args, single, **{f"dp2_{e}_tokens_per_s": v for e, v in dp2.items()},
                       ddp_over_old_loop=dp2["ddp"] / dp2["old_loop"],
                       fsdp2_over_old_loop=dp2["fsdp2"] / dp2["old_loop"],
                       ddp_dp2_over_one_process=dp2["ddp"] / single)


if __name__ == "__main__":
    main()
