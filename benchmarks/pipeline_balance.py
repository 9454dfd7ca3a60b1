"""Step time and per-stage busy time of a tapered model on 2 pipeline stages: FLOPs split vs layer count.

Starts 2 gloo processes on this machine (1 thread each), builds the same cosine-tapered model
split by `parallel.pp_balance=flops`, by `uniform` (equal layer counts) and by `profile` (measured
per-layer times), and alternates them step by step so that machine noise hits all alike. Per
split: the layers per stage, the predicted FLOPs bottleneck / ideal, the median step time, and
each stage's median busy time per step (time inside its forward/backward compute, not waiting on
the other stage). Prints one JSON object. When the machine has fewer free cores than processes,
the stages do not really run at once and the step time follows the total work, not the slowest
stage; the busy times show the balance regardless, and `estimated_step_s_on_free_cores` is the
1F1B step they imply ((m + pp - 1) / m x the busiest stage).

    python benchmarks/pipeline_balance.py [--steps 4] [--rounds 3] [key=value ...]

`--schedules 1f1b,interleaved_1f1b,interleaved_zero_bubble,zbv,dualpipev` compares schedules
instead (all with the FLOPs split, parallel.pp processes): per schedule the measured bubble as
busy / wall (mean over stages of busy time over step time) beside the predicted one for equal
forward, input-gradient and weight-gradient times per chunk: m / (m + pp - 1) for 1f1b and gpipe,
m / (m + (pp - 1) / v) for interleaved_1f1b with v chunks per rank, and 1 (no bubble: what the
zero-bubble schedules are built to reach under that assumption) for interleaved_zero_bubble, zbv
and dualpipev. With fewer free cores than processes the stages take turns and busy / wall
measures the machine, not the schedule (`cpu_cores` is reported).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from megatron_taper.config import load_config
from megatron_taper.parallel.spawn import run_distributed

# Matmul-dominated like real models (at d_model 128 on CPU, norms, RoPE and softmax are a large
# share of a layer's time and FLOPs predict it poorly; pp_balance=profile is for such cases).
MODEL = ["model.n_layers=8", "model.d_model=384", "model.n_heads=6", "model.mlp_width=1536",
         "model.seq_len=64", "model.vocab_size=256", "model.taper.multiple=64",
         "train.global_batch=8", "train.micro_batch=2", "train.device=cpu", "parallel.pp=2"]
BALANCES = ("flops", "uniform", "profile")


def _batches(cfg, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    n = cfg.train.global_batch // cfg.train.micro_batch
    return [torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.model.seq_len + 1), generator=g)
            for _ in range(n)]


def compute_timer() -> list[float]:
    """Time this process spends computing stage forwards and backwards (not waiting for peers):
    wraps torch.distributed.pipelining's per-chunk methods in this benchmark process only.
    Returns a one-element list the wrappers add seconds to."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    total = [0.0]
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        inner = getattr(_PipelineStageBase, name, None)
        if inner is None:
            continue

        def timed(self, *args, _inner=inner, **kwargs):
            t0 = time.perf_counter()
            try:
                return _inner(self, *args, **kwargs)
            finally:
                total[0] += time.perf_counter() - t0

        setattr(_PipelineStageBase, name, timed)
    return total


def _worker(overrides: list[str], steps: int, rounds: int, variants: dict[str, list[str]]) -> dict | None:
    """On each stage's process: every variant's steps; rank 0 returns the report, the others None."""
    from megatron_taper.training.build import build_run

    rank, world = dist.get_rank(), dist.get_world_size()

    busy = compute_timer()
    models = {}
    for key, extra in variants.items():
        cfg = load_config(None, MODEL + overrides + extra + ["train.device=cpu"])
        run = build_run(cfg)
        models[key] = (cfg, run.model, run.optimizer)
    step_s: dict[str, list[float]] = {b: [] for b in variants}
    busy_s: dict[str, list[float]] = {b: [] for b in variants}

    def one_step(cfg, pm, opt, step):
        pm.forward_backward(_batches(cfg, step), contextlib.nullcontext)
        pm.clip_gradients(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for cfg, pm, opt in models.values():  # warm-up: shape inference, allocator
        one_step(cfg, pm, opt, 0)
    for _ in range(rounds):  # splits alternate step by step, so machine noise hits all alike
        for step in range(steps):
            for balance, (cfg, pm, opt) in models.items():
                dist.barrier()
                busy0, t0 = busy[0], time.perf_counter()
                one_step(cfg, pm, opt, step + 1)
                dist.barrier()
                step_s[balance].append(time.perf_counter() - t0)
                busy_s[balance].append(busy[0] - busy0)
    mine = {b: {"busy_s": statistics.median(busy_s[b]), "step_s": statistics.median(step_s[b]),
                "layers": sorted(int(k) for k in models[b][1].module.layers.keys()),
                "plan": models[b][1].plan} for b in variants}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    report = None
    if rank == 0:
        report = {}
        for b in variants:
            cfg = models[b][0]
            n_micro = cfg.parallel.microbatches or cfg.train.global_batch // cfg.train.micro_batch
            plan = gathered[0][b]["plan"]
            step = max(g[b]["step_s"] for g in gathered)
            busy = [g[b]["busy_s"] for g in gathered]
            report[b] = {
                "stages": [f"{g[b]['layers'][0]}-{g[b]['layers'][-1]}" for g in gathered],
                "measured_busy_over_wall": round(sum(busy) / len(busy) / step, 4),
                "predicted_busy_over_wall": round(_predicted_busy(cfg.parallel, n_micro), 4),
                "predicted_bottleneck_over_ideal": round(plan.bottleneck_over_ideal, 4),
                "step_s": round(step, 4),
                "stage_busy_s": [round(x, 4) for x in busy],
                "busy_bottleneck_over_mean": round(max(busy) / (sum(busy) / len(busy)), 4),
                "busy_total_s": round(sum(busy), 4),
                # 1F1B on free cores: m micro-batches through the slowest stage plus pp - 1 of fill
                "estimated_step_s_on_free_cores": round(max(busy) * (n_micro + len(busy) - 1) / n_micro, 4),
            }
    dist.barrier()
    return report


def _predicted_busy(parallel, m: int) -> float:
    """Busy / wall of a schedule with equal per-chunk forward / input-gradient / weight-gradient
    times (module doc)."""
    from megatron_taper.config import ZERO_BUBBLE_SCHEDULES

    pp, v = parallel.pp, parallel.virtual_stages
    if parallel.pp_schedule in ZERO_BUBBLE_SCHEDULES:
        return 1.0
    return m / (m + (pp - 1) / v)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per split per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--schedules", default="", help="compare these parallel.pp_schedule values instead")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides (model.*, train.*)")
    args = parser.parse_args(argv)
    cfg = load_config(None, MODEL + args.overrides)  # fail early on bad overrides
    if args.schedules:
        variants = {s: ["parallel.pp_balance=flops", f"parallel.pp_schedule={s}"] for s in args.schedules.split(",")}
    else:
        variants = {b: [f"parallel.pp_balance={b}"] for b in BALANCES}
    world = cfg.parallel.pp * cfg.parallel.tp
    # 1 thread per stage; train.device=cpu in every variant (_worker): gloo
    report = run_distributed(_worker, world, args.overrides, args.steps, args.rounds, variants, timeout=3600,
                             device="cpu")[0]
    m = cfg.model
    result = {
        "model": {"n_layers": m.n_layers, "d_model": m.d_model, "mlp_width": m.mlp_width, "seq_len": m.seq_len,
                  "taper": f"{m.taper.schedule} {m.taper.start}", "vocab_size": m.vocab_size},
        "processes": world, "threads_per_process": 1, "cpu_cores": len(os.sched_getaffinity(0)),
        "microbatches_per_step": cfg.train.global_batch // cfg.train.micro_batch,
        "micro_batch": cfg.train.micro_batch, "steps_timed": args.steps * args.rounds,
        **report,
    }
    if not args.schedules:
        result["speedup_flops_over_uniform"] = round(report["uniform"]["step_s"] / report["flops"]["step_s"], 4)
        result["speedup_profile_over_uniform"] = round(report["uniform"]["step_s"] / report["profile"]["step_s"], 4)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
