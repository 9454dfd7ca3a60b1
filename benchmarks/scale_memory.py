"""Peak resident host memory per rank while building, saving and resuming a tapered model.

    python benchmarks/scale_memory.py [--layers 12 --d-model 1280 --mlp-width 3456] [--layouts one,tp2,...]

For each layout (one process; pp=2, tp=2, fsdp2 dp=2 on 2; tp=2 x pp=2 and fsdp2 dp=4 on 4), a
torchrun job runs both code paths one after the other in the same processes:
  new   build_run (meta device, each rank materialises its own pieces), Checkpointer.save (each
        rank writes its pieces), Checkpointer.load (each rank reads its pieces)
  old   the construction of before: the whole model built and initialised on every rank, then
        parallelised; the save of before: logical tensors gathered per stage (logical_state) and
        written by dp/tp rank 0; the resume of before: every rank reads every stage's logical
        files (load_logical) and keeps its slices (load_logical_state)
Each phase's peak is VmHWM of /proc/self/status after resetting it (`echo 5 > /proc/self/clear_refs`)
at the start of the phase: the whole process, Python and torch included (`base_mib`: the resident
memory of a rank after importing torch and joining the process group, before any model).
AdamW state exists (one step with zero gradients), so checkpoints hold parameters + 2 moments.
Prints one JSON object: per layout and path, the largest peak over ranks in MiB for each phase,
next to this rank's shard (parameters + AdamW state it holds) and the full state / world size.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

LAYOUTS = {
    "one": (1, []),
    "pp2": (2, ["parallel.pp=2"]),
    "tp2": (2, ["parallel.tp=2"]),
    "fsdp2_dp2": (2, ["parallel.zero=fsdp2"]),
    "tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
    "fsdp2_dp4": (4, ["parallel.zero=fsdp2"]),
}
MIB = 2**20


def _peak_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / MIB
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / MIB
    raise RuntimeError("no VmRSS in /proc/self/status")


def _adam_state(pm, optimizer) -> None:
    """AdamW's moments without a forward pass: one step with zero gradients and lr 0."""
    import torch

    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in pm.module.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _shard_bytes(pm, optimizer) -> int:
    from megatron_taper.parallel.model import local_part

    total = 0
    for p in pm.module.parameters():
        total += local_part(p.data).nbytes + sum(local_part(v).nbytes for v in optimizer.state[p].values())
    return total


def worker(overrides: list[str], folder: str, out: str) -> None:
    import gc

    import torch
    import torch.distributed as dist

    from megatron_taper.checkpoint.checkpointer import Checkpointer, load_logical
    from megatron_taper.config import load_config
    from megatron_taper.models import build_model
    from megatron_taper.parallel.context import init_parallel, shutdown
    from megatron_taper.parallel.parallelize import parallelize
    from megatron_taper.training.build import build_run, seed_everything

    torch.set_num_threads(1)
    cfg = load_config(None, overrides)
    ctx = init_parallel(cfg.parallel, "cpu")
    row: dict = {"rank": ctx.rank, "base": _rss_mib()}

    # new path
    _peak_reset()
    run = build_run(cfg, ctx)
    row["new_build"] = _peak_mib()
    _adam_state(run.model, run.optimizer)
    row["shard"] = _shard_bytes(run.model, run.optimizer) / MIB
    ckpt = Checkpointer(os.path.join(folder, "new"), cfg.checkpoint, run.model)
    _peak_reset()
    ckpt.save(run.optimizer, 1, cfg.to_dict(), {"skipped": 0}, {})
    row["new_save"] = _peak_mib()
    _peak_reset()
    ckpt.load([os.path.join(folder, "new", "step-1")], cfg.model, run.optimizer, explicit=True)
    row["new_resume"] = _peak_mib()
    row["new_resume_bytes_read"] = ckpt.bytes_read / MIB
    del run, ckpt
    gc.collect()
    ctx.barrier()

    # old path (construction, gathered save, read-everything resume of before)
    _peak_reset()
    seed_everything(cfg.train.seed)
    model = build_model(cfg.model)
    model.init_weights(cfg.train.seed)
    pm = parallelize(model, ctx, cfg.model, cfg.parallel, cfg.train)
    optimizer = pm.build_optimizer(cfg.train)
    row["old_build"] = _peak_mib()
    _adam_state(pm, optimizer)
    old = os.path.join(folder, "old")
    if ctx.is_main:
        os.makedirs(old, exist_ok=True)
    ctx.barrier()
    _peak_reset()
    if ctx.dp_rank == 0 or pm.gathers_on_every_dp_rank:
        model_state, optim_state = pm.logical_state(optimizer)
        if ctx.dp_rank == 0 and ctx.tp_rank == 0:
            torch.save(model_state, os.path.join(old, f"model-pp{ctx.pp_rank}.pt"))
            torch.save(optim_state, os.path.join(old, f"optim-pp{ctx.pp_rank}.pt"))
        del model_state, optim_state
    ctx.barrier()
    row["old_save"] = _peak_mib()
    gc.collect()
    _peak_reset()
    files = {f"model-pp{k}.pt": {} for k in range(ctx.pp)}
    model_state, optim_state = load_logical(old, {"files": files})
    pm.load_logical_state(optimizer, model_state, optim_state, missing=KeyError)
    row["old_resume"] = _peak_mib()
    del model_state, optim_state
    gathered: list = [None] * ctx.world_size
    if ctx.mesh is not None:
        dist.all_gather_object(gathered, row)
    else:
        gathered = [row]
    if ctx.is_main:
        with open(out, "w") as f:
            json.dump(gathered, f)
    shutdown(ctx)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # default: ~320M parameters (3.8 GB of fp32 state): the old resume path holds the whole state
    # on each of 4 ranks, which must fit this 24 GiB machine
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=1280)
    parser.add_argument("--heads", type=int, default=10)
    parser.add_argument("--mlp-width", type=int, default=3456)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.overrides, args.folder, args.out)
        return 0
    model = [f"model.n_layers={args.layers}", f"model.d_model={args.d_model}", f"model.n_heads={args.heads}",
             f"model.mlp_width={args.mlp_width}", f"model.vocab_size={args.vocab}", "model.seq_len=128",
             "model.taper.multiple=64", "train.device=cpu", "train.precision=fp32", "train.global_batch=4",
             "train.micro_batch=1", "parallel.microbatches=2"]
    from megatron_taper.config import load_config
    from megatron_taper.cost.flops import model_costs

    params = model_costs(load_config(None, model).model).total_params
    full_mib = params * 12 / MIB  # fp32 parameters + two AdamW moments
    report: dict = {"params": params, "full_state_mib": round(full_mib, 1), "layouts": {}}
    for name in args.layouts.split(","):
        nproc, extra = LAYOUTS[name]
        folder = tempfile.mkdtemp(prefix=f"scale_memory_{name}_")
        out = os.path.join(folder, "rows.json")
        cmd = [sys.executable, "-m", "megatron_taper.torchrun", "--standalone", "--nproc-per-node", str(nproc),
               os.path.abspath(__file__), "--worker", "--folder", folder, "--out", out, *model, *extra,
               *args.overrides]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            report["layouts"][name] = {"error": proc.stderr[-2000:]}
        else:
            with open(out) as f:
                rows = json.load(f)
            phases = ("new_build", "new_save", "new_resume", "old_build", "old_save", "old_resume")
            entry = {p: round(max(r[p] for r in rows), 1) for p in phases}
            entry.update(world=nproc, base_mib=round(max(r["base"] for r in rows), 1),
                         shard_mib=round(max(r["shard"] for r in rows), 1),
                         full_over_world_mib=round(full_mib / nproc, 1),
                         resume_read_mib=round(max(r["new_resume_bytes_read"] for r in rows), 1))
            report["layouts"][name] = entry
        shutil.rmtree(folder, ignore_errors=True)
        print(json.dumps({name: report["layouts"][name]}), file=sys.stderr, flush=True)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
