"""Measure this CPU's entries of megatron_taper/cost/devices.json: dense fp32 matmul FLOP/s on the
threads torch uses, memory copy bandwidth, and gloo's collectives between 2 local processes of 1
thread each (what tp / dp / pp / cp traffic runs over on one CPU machine):

- the bus bandwidth of all-reduce, all-gather (`all_gather_into_tensor`, what FSDP2 and DeepSpeed
  gather with) and reduce-scatter (`reduce_scatter_tensor`) of a `--mib` tensor (the gathered
  output / the scattered input), median of 5; devices.json keeps the all-reduce figure as the link
  and the other two as its `all_gather_efficiency` / `reduce_scatter_efficiency`;
- `collective_latency_us`: what one small (4 KiB) all-reduce adds to a loop whose ranks compute
  between collectives (a matmul of about 5 ms), as tp's and FSDP's collectives do in a training
  step: the loop's time per iteration with the collective less without it (median of 3 rounds of
  50). On an idle pair of processes a 4 KiB all-reduce is also reported alone
  (`idle_allreduce_4kib_us`); the loop's figure is larger: a collective makes the ranks wait for
  each other, and gloo's threads need the cores the ranks compute on;
- `op_overhead_us`: the host time of one eager operator (op_overhead: many tiny operators).

    OMP_NUM_THREADS=1 python benchmarks/cpu_profile.py [--size 2048] [--mib 64]

Prints one JSON object. The collectives' numbers depend on the machine's load: measure it quiet.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def best_of(fn, repeats: int = 5, median: bool = False, before=lambda: None) -> float:
    """Seconds of `fn` after one warm-up call: the fastest of `repeats`, or their median;
    `before` runs ahead of each timed call, untimed (a barrier, so ranks start together)."""
    fn()
    times = []
    for _ in range(repeats):
        before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] if median else min(times)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BLOCK_TOKENS, BLOCK_D, BLOCK_F = 512, 512, 1536
BLOCK_FLOPS = 3 * 2 * 2 * BLOCK_TOKENS * BLOCK_D * BLOCK_F  # two matmuls, forward + backward (3x)


def mlp_block():
    """A transformer MLP's forward and backward on one thread: [512, 512] -> 1536 -> 512, SiLU,
    residual and layer norm (BLOCK_FLOPS in its matmuls, the rest elementwise, as in a step)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(BLOCK_TOKENS, BLOCK_D, generator=gen, requires_grad=True)
    w1 = torch.randn(BLOCK_D, BLOCK_F, generator=gen, requires_grad=True)
    w2 = torch.randn(BLOCK_F, BLOCK_D, generator=gen, requires_grad=True)

    def run() -> None:
        out = torch.nn.functional.layer_norm(torch.nn.functional.silu(x @ w1) @ w2 + x, (BLOCK_D,))
        out.square().mean().backward()
    return run


def op_overhead() -> tuple[float, int]:
    """Seconds per eager operator: a narrowed 2-block tiny Titans (cost/op_count.py's widths, 128
    tokens: ~12k operators of little arithmetic each) forward and backward, best of 7, over its
    operator count; an upper bound, as its arithmetic is counted in."""
    from megatron_taper.config import load_config
    from megatron_taper.cost.op_count import dispatched_ops, narrowed
    from megatron_taper.models import build_model

    cfg = narrowed(load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "tiny_titans.yaml"),
                              []).model, 2, 128)
    _, ops = dispatched_ops(cfg)
    model, tokens = build_model(cfg), torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))
    return best_of(lambda: model(tokens).float().mean().backward(), repeats=7) / ops, ops


def median_of(fn, repeats: int = 5) -> float:
    """The median seconds of a collective `fn`, every rank starting together."""
    return best_of(fn, repeats, median=True, before=dist.barrier)


def _collectives(rank: int, world: int, port: int, numel: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    block = mlp_block()
    dist.barrier()
    seconds = {"block": best_of(block)}  # every process at once: the cores' shared rate
    whole, shard = torch.ones(numel), torch.ones(numel // world)
    seconds |= {"all_reduce": median_of(lambda: dist.all_reduce(whole)),
               "all_gather": median_of(lambda: dist.all_gather_into_tensor(whole, shard)),
               "reduce_scatter": median_of(lambda: dist.reduce_scatter_tensor(shard, whole))}
    small = torch.ones(1024)
    seconds["idle_small"] = median_of(lambda: dist.all_reduce(small), 21)
    a, b = torch.randn(256, 1024), torch.randn(1024, 1024)  # ~0.5 GFLOP: a few ms on one core

    def loop(collective: bool, iterations: int = 50) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            a @ b
            if collective:
                dist.all_reduce(small)
        return (time.perf_counter() - start) / iterations

    loop(True, 5)
    rounds = [(loop(False), loop(True)) for _ in range(3)]
    seconds["compute_step"] = sorted(r[0] for r in rounds)[1]
    seconds["in_loop_small"] = sorted(r[1] - r[0] for r in rounds)[1]
    if rank == 0:
        out.put(seconds)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=2048, help="square matmul size")
    parser.add_argument("--mib", type=int, default=64, help="all-reduce / copy size in MiB")
    args = parser.parse_args()
    n = args.size
    a, b = torch.randn(n, n), torch.randn(n, n)
    matmul_s = best_of(lambda: a @ b)
    block_s = best_of(mlp_block())
    per_op_s, ops = op_overhead()
    numel = args.mib * 2**20 // 4
    src = torch.ones(numel)
    dst = torch.empty_like(src)
    copy_s = best_of(lambda: dst.copy_(src))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_collectives, args=(r, 2, port, numel, queue)) for r in range(2)]
    for p in procs:
        p.start()
    coll = queue.get(timeout=600)
    for p in procs:
        p.join()
    nbytes = 4 * numel
    # bus bandwidth of 2 ranks: ring all-reduce moves 2 (n - 1) / n x bytes, all-gather and
    # reduce-scatter (n - 1) / n x the whole tensor's bytes
    moved = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5}
    bus = {k: f * nbytes / coll[k] / 1e9 for k, f in moved.items()}
    print(json.dumps({
        "threads": torch.get_num_threads(),
        "fp32_matmul_tflops": 2 * n**3 / matmul_s / 1e12,
        "block_tflops": BLOCK_FLOPS / block_s / 1e12,
        "block_tflops_concurrent": BLOCK_FLOPS / coll["block"] / 1e12,
        "copy_gb_per_s": 2 * nbytes / copy_s / 1e9,  # read + write
        "gloo_allreduce_bus_gb_per_s": bus["all_reduce"],
        "gloo_allgather_bus_gb_per_s": bus["all_gather"],
        "gloo_reducescatter_bus_gb_per_s": bus["reduce_scatter"],
        "all_gather_efficiency": bus["all_gather"] / bus["all_reduce"],
        "reduce_scatter_efficiency": bus["reduce_scatter"] / bus["all_reduce"],
        "idle_allreduce_4kib_us": 1e6 * coll["idle_small"],
        "loop_compute_ms": 1e3 * coll["compute_step"],
        "collective_latency_us": 1e6 * coll["in_loop_small"],
        "concurrent_efficiency": block_s / coll["block"],
        "op_overhead_us": 1e6 * per_op_s, "op_overhead_ops": ops,
        "cpu": (open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(" \t:")
                if os.path.exists("/proc/cpuinfo") else ""),
    }))


if __name__ == "__main__":
    main()
