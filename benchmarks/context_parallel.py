"""Context parallelism: per-rank memory, step time and communication vs sequence length, beside
the memory model (cost/memory.py) and the communication theory (parallel/cp/split.py).

    python benchmarks/context_parallel.py [--seq-lens 1024,2048,4096,8192] [--cps 1,2,4]
                                          [--attentions allgather,ring,ulysses] [--steps 2]
                                          [--merge docs/results/context_parallel.json] [key=value ...]

Default shape: a narrow Transformer (2 layers, d_model 64, 4 heads over 2 kv heads, vocabulary
256, uniform MLP width 176), one sequence per micro-batch, fp32 on the CPU (gloo). For each
sequence length, cp and (cp > 1) parallel.cp_attention, `cp` fresh processes (torchrun, with MALLOC_MMAP_THRESHOLD_ as
benchmarks/activation_memory.py uses it) build the run through build_run and
  memory   after one warm-up step (gradients resident, as between micro-batches), the host-RSS peak
           of one forward+backward of one micro-batch minus the RSS before it (activation_memory's
           PeakMeter), beside memory.model_memory(...).stage(all layers).activations with
           optimizer=False (the per-rank tokens are S / cp; each layer's K and V counted at S);
  time     the median of `--steps` whole training steps (forward_backward + optimizer_step),
           after the warm-up step, on rank 0 (1 thread per rank);
  comm     the c10d collectives of one forward_backward (benchmarks/tp_comm.py's counter: the
           full-size buffer bytes of each call) beside the theory: per attention layer an
           all-gather of K and V (2 calls of [b, S, K, E] out) forward and a reduce-scatter of
           their gradients (2 calls of the same size in) backward; the ring instead sends
           point-to-point (cp - 1) blocks [2, b, K, S / cp, E] forward and (cp - 1) blocks plus
           cp gradient blocks of that size backward (`p2p_send`: the bytes this rank sends;
           theory `p2p_send`); all-reduces: per micro-batch
           two scalars (the loss share's token count, the reported loss) and DDP's gradient
           all-reduce over dp x cp (the parameters in fp32, in its buckets: their number is not
           predicted). ring bytes per rank: (cp - 1) / cp of each gather / reduce-scatter buffer.
           Ulysses (parallel/cp/ulysses.py): per attention layer two all-to-alls forward (q, k, v
           [b, S / cp, H + 2 K', E] out, K' = lcm(K, cp), the output [b, S / cp, H, E] back) and the same two
           backward (`all_to_all`: the buffer of each call), (cp - 1) / cp of each leaving the rank.
--merge FILE: print FILE's rows with those of this run put in (a row of the same seq_len, cp and
cp_attention replaced), e.g. to add one attention's rows to the recorded ones.

Prints one JSON object: {"config": ..., "results": [one per (seq_len, cp)]}.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, HERE]

SHAPE = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.mlp_width=176",
         "model.taper.schedule=uniform", "model.taper.multiple=16", "model.vocab_size=256", "train.micro_batch=1",
         "train.global_batch=1", "train.device=cpu", "train.precision=fp32", "run.tensorboard=false"]


def theory(cfg, cp: int, params: int) -> dict:
    """Collective bytes of one micro-batch's forward_backward at cp (module doc), fp32; `params`:
    the model's parameters (DDP's all-reduce)."""
    m = cfg.model
    if cp == 1:
        return {}
    kv = cfg.train.micro_batch * m.seq_len * m.kv_heads * m.head_dim * 4  # [b, S, K, E] fp32
    reduce = {"all_reduce": {"bytes": 8 + 4 * params}}
    if cfg.parallel.cp_attention == "ulysses":
        kv_heads = math.lcm(m.kv_heads, cp)  # repeated until they divide by cp
        buffers = cfg.train.micro_batch * m.seq_len // cp * (2 * m.n_heads + 2 * kv_heads) * m.head_dim * 4
        return {**reduce, "all_to_all": {"calls": 4 * m.n_layers, "bytes": 2 * m.n_layers * buffers}}
    if cfg.parallel.cp_attention == "ring":
        block = 2 * kv // cp  # K and V of one rank's slice
        return {**reduce, "p2p_send": {"calls": m.n_layers * (3 * cp - 2),
                                       "bytes": m.n_layers * block * (3 * cp - 2)}}
    per_kind = {"calls": 2 * m.n_layers, "bytes": 2 * m.n_layers * kv}
    return {"all_gather": per_kind, "reduce_scatter": dict(per_kind), **reduce}


def p2p_counter():
    """tp_comm's CollectiveCounter, also counting the tensors this rank sends point-to-point."""
    from tp_comm import CollectiveCounter, _nbytes

    class Counter(CollectiveCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d" and func._schema.name.split("::")[-1] in ("send", "recv_"):
                if func._schema.name.endswith("send"):
                    self.calls["p2p_send"] += 1
                    self.bytes["p2p_send"] += _nbytes(args[0])
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    return Counter()


def worker(overrides: list[str], steps: int) -> dict:
    import torch
    from activation_memory import PeakMeter, _tokens

    from megatron_taper.config import load_config
    from megatron_taper.cost.memory import MemorySetup, model_memory
    from megatron_taper.training.build import build_run

    cfg = load_config(None, SHAPE + overrides)
    meter = PeakMeter(torch.device("cpu"))
    run = build_run(cfg)
    pm, ctx, optimizer = run.model, run.ctx, run.optimizer
    null = contextlib.nullcontext
    batch = _tokens(cfg, cfg.train.micro_batch, cfg.model.seq_len, ctx.dp_rank)
    pm.forward_backward([batch], null)
    pm.optimizer_step(optimizer, cfg.train.grad_clip)
    pm.forward_backward([batch], null)  # gradients resident during the measured pass
    before = meter.reset()
    pm.forward_backward([batch], null)
    measured = meter.peak() - before
    optimizer.zero_grad(set_to_none=True)
    counter = p2p_counter()
    with counter:
        pm.forward_backward([batch], null)
    times = []
    for _ in range(steps):
        if ctx.mesh is not None:
            torch.distributed.barrier()
        start = time.perf_counter()
        pm.forward_backward([batch], null)
        pm.optimizer_step(optimizer, cfg.train.grad_clip)
        times.append(time.perf_counter() - start)
    setup = dataclasses.replace(MemorySetup.from_config(cfg.parallel, cfg.train, ctx.dp, run.bf16), optimizer=False)
    predicted = model_memory(cfg.model, setup).stage(range(cfg.model.n_layers)).activations
    cp = ctx.cp
    measured_comm = {k: {"calls": counter.calls[k], "bytes": counter.bytes.get(k, 0)} for k in sorted(counter.calls)}
    params = sum(p.numel() for p in pm.module.parameters())
    expected = theory(cfg, cp, params)
    return {"seq_len": cfg.model.seq_len, "cp": cp, "cp_attention": cfg.parallel.cp_attention if cp > 1 else "",
            "rank": ctx.rank, "tokens_per_rank": cfg.model.seq_len // cp,
            "measured_activation_bytes": measured, "predicted_activation_bytes": predicted,
            "activation_ratio": measured / predicted, "step_time_s": statistics.median(times),
            "comm_measured": measured_comm, "comm_theory": expected,
            "comm_ring_bytes_per_rank": sum(v["bytes"] for k, v in measured_comm.items()
                                            if k in ("all_gather", "reduce_scatter", "all_to_all")) * (cp - 1) / cp}


def launch_ranks(script: str, overrides: list[str], cp: int, steps: int) -> list[dict]:
    """One measurement of `script` (run as `script --worker --out DIR ...`) on `cp` fresh
    processes; the rows its ranks wrote as DIR/rank{r}.json, in rank order."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cp),
               script, "--worker", "--out", tmp, "--steps", str(steps), f"parallel.cp={cp}", *overrides]
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"cp={cp} {overrides} failed:\n{proc.stderr[-4000:]}")
        rows = []
        for rank in range(cp):
            path = os.path.join(tmp, f"rank{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    rows.append(json.load(f))
        return rows


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The command line launch_ranks runs a script's workers with (--worker --out DIR --steps N
    key=value ...), also the measuring side's --steps and overrides."""
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")


def launch(overrides: list[str], cp: int, steps: int) -> dict:
    """One measurement on `cp` fresh processes; rank 0's row."""
    return launch_ranks(__file__, overrides, cp, steps)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", default="1024,2048,4096,8192")
    parser.add_argument("--cps", default="1,2,4")
    parser.add_argument("--attentions", default="allgather,ring,ulysses", help="parallel.cp_attention values (cp > 1)")
    parser.add_argument("--merge", help="a JSON this benchmark printed: print it with this run's rows put in")
    add_worker_arguments(parser)
    args = parser.parse_args()
    if args.worker:
        row = worker(args.overrides, args.steps)
        import torch.distributed as dist

        if int(os.environ.get("RANK", 0)) == 0:
            with open(os.path.join(args.out, "rank0.json"), "w") as f:
                json.dump(row, f)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return
    results = []
    for seq in (int(x) for x in args.seq_lens.split(",")):
        for cp in (int(x) for x in args.cps.split(",")):
            for attention in args.attentions.split(",") if cp > 1 else ["allgather"]:
                overrides = [f"model.seq_len={seq}", f"parallel.cp_attention={attention}", *args.overrides]
                results.append(launch(overrides, cp, args.steps))
    if args.merge:
        with open(args.merge) as f:
            recorded = json.load(f)
        key = lambda r: (r["seq_len"], r["cp"], r["cp_attention"])  # noqa: E731
        new = {key(r) for r in results}
        results = sorted([r for r in recorded["results"] if key(r) not in new] + results, key=key)
    print(json.dumps({"config": SHAPE + args.overrides, "results": results}, indent=1))


if __name__ == "__main__":
    main()
