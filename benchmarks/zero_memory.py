"""Per-rank memory of parameters, gradients and optimizer state under ZeRO-3, measured.

    python benchmarks/zero_memory.py [--engines fsdp2,deepspeed] [--hsdp] [key=value ...]

Runs one training step of the model (default: 4 layers, d=128, tapered; override with key=value)
at dp=1 (parallel.zero=none: the unsharded total) and at dp=2 for each engine, each on its own
gloo processes (megatron_taper/parallel/spawn.py) on the CPU, and prints one JSON object: per
engine and rank the bytes this rank holds, measured from the live tensors (not computed from shapes):
  params_bytes   parameters (fsdp2: the local DTensor shards; deepspeed: the ZeRO partitions
                 `ds_tensor`, with parallel.deepspeed.param_persistence_threshold=0 so that no
                 parameter stays whole)
  grads_bytes    gradients after backward, before the optimizer step (fsdp2: the reduce-scattered
                 local shards; deepspeed: its flat gradient partition buffer)
  optim_bytes    AdamW state (exp_avg, exp_avg_sq, step) after the step
  master_bytes   deepspeed only: its fp32 master partitions (a second copy even in fp32)
next to `ideal_*` = the dp=1 total / dp. Shards are uneven when a tensor's first dimension does
not divide by dp (FSDP2 pads nothing in its local view; DeepSpeed pads partitions).
`--hsdp` instead runs fsdp2 at 4 processes, flat (dp=4) and HSDP (parallel.dp_replicate=2 x
parallel.dp_shard=2), with `ideal_*` = the dp=1 total / the ranks the state is sharded over.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os

from megatron_taper.parallel.spawn import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT = ["model.n_layers=4", "model.d_model=128", "model.n_heads=4", "model.mlp_width=384",
           "model.vocab_size=4096", "model.seq_len=64", "model.taper.multiple=32",
           "train.global_batch=4", "train.micro_batch=2", "train.device=cpu", "train.precision=fp32",
           "parallel.deepspeed.param_persistence_threshold=0"]


def _nbytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def worker(engine: str, overrides: list[str]) -> list[dict]:
    """On each rank: one training step; every rank's row (rank order)."""
    import torch
    import torch.distributed as dist

    from megatron_taper.config import load_config
    from megatron_taper.cost.preflight import preflight
    from megatron_taper.parallel.context import init_parallel, world_size
    from megatron_taper.training.build import build_run

    cfg = load_config(None, DEFAULT + overrides + [f"parallel.zero={engine}", "train.device=cpu"])
    preflight(cfg, world_size())  # e.g. deepspeed with one process: a clear error before joining
    ctx = init_parallel(cfg.parallel, "cpu")
    run = build_run(cfg, ctx)
    pm, optimizer = run.model, run.optimizer
    accum = cfg.train.global_batch // (cfg.train.micro_batch * ctx.dp)
    gen = torch.Generator().manual_seed(ctx.dp_rank)
    batches = [torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.model.seq_len + 1), generator=gen)
               for _ in range(accum)]
    params = list(pm.module.parameters())
    pm.forward_backward(batches, contextlib.nullcontext)
    row = {"engine": engine, "dp": ctx.dp, "rank": ctx.rank}
    if engine == "deepspeed":
        zero = pm.engine.optimizer
        row["params_bytes"] = _nbytes(p.ds_tensor for p in params)
        row["grads_bytes"] = _nbytes([zero.grad_partitions_flat_buffer])
    else:
        row["params_bytes"] = _nbytes(params)
        row["grads_bytes"] = _nbytes(p.grad for p in params)
    pm.optimizer_step(optimizer, cfg.train.grad_clip)
    if engine == "deepspeed":
        inner = pm.engine.optimizer.optimizer
        row["optim_bytes"] = _nbytes(v for s in inner.state.values() for v in s.values() if torch.is_tensor(v))
        row["master_bytes"] = _nbytes(pm.engine.optimizer.fp32_partitioned_groups_flat)
    else:
        row["optim_bytes"] = _nbytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    rows: list = [None] * ctx.world_size
    dist.all_gather_object(rows, row)
    return rows


def launch(engine: str, dp: int, overrides: list[str]) -> list[dict]:
    """One step of `engine` on `dp` gloo processes (the shared launcher, one thread each); the rows."""
    extensions = os.environ.get("TORCH_EXTENSIONS_DIR", os.path.join(REPO, ".cache", "torch_extensions"))
    return run_distributed(worker, dp, engine, overrides, timeout=3600, device="cpu",
                           env={"TORCH_EXTENSIONS_DIR": extensions})[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="fsdp2,deepspeed")
    parser.add_argument("--hsdp", action="store_true", help="fsdp2 at dp=4: flat and HSDP 2 x 2")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.hsdp:  # global_batch 4 over dp = 4
        args.overrides = ["train.micro_batch=1", *args.overrides]
    total = launch("none", 1, args.overrides)[0]
    report = {"total_dp1": {k: total[k] for k in ("params_bytes", "grads_bytes", "optim_bytes")}}
    runs = ([("dp4", "fsdp2", 4, [], 4), ("hsdp_2x2", "fsdp2", 4, ["parallel.dp_replicate=2"], 2)] if args.hsdp else
            [("dp2", engine, 2, [], 2) for engine in args.engines.split(",")])
    for key, engine, nproc, extra, shards in runs:
        for row in launch(engine, nproc, args.overrides + extra):
            for k in ("params_bytes", "grads_bytes", "optim_bytes"):
                row["ideal_" + k] = total[k] / shards
            report.setdefault(key, []).append(row)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
