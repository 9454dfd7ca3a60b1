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
- `op_overhead_us`: the host time of one eager operator (op_overhead: many tiny operators);
- `oversubscribed_efficiency`: the host's total rate with twice as many one-thread processes as
  cores over one per core (what time-slicing costs; the 4-rank layouts on 2 cores);
- `op_checkpoint_overhead_us`: what op-level checkpointing adds per forward operator of a block.

    OMP_NUM_THREADS=1 python benchmarks/cpu_profile.py [--size 2048] [--mib 64] [--write FILE]

Prints one JSON object. The collectives' numbers depend on the machine's load: measure it quiet.
`--write FILE` also writes them as a measured profile of the planner's cpu entry (cost/devices.py
`profiles(measured=...)`; `megatron-taper-plan --measured-profile FILE`, `parallel.layout_profile`),
each number with its source; `mfu` is the MLP block's rate over the matmul peak.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from megatron_taper.parallel.spawn import run_distributed


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


BLOCK_TOKENS, BLOCK_D, BLOCK_F = 512, 512, 1536
BLOCK_FLOPS = 3 * 2 * 2 * BLOCK_TOKENS * BLOCK_D * BLOCK_F  # two matmuls, forward + backward (3x)


def mlp_block():
    """A transformer MLP's forward and backward on one thread: [512, 512] -> 1536 -> 512, SiLU,
    residual and layer norm (BLOCK_FLOPS in its matmuls, the rest elementwise, as in a step). The
    weights are scaled by 1 / sqrt(fan-in) as a model's are: unscaled, the backward's gradients
    fall to denormal floats, which made it 2.6x slower on an Intel Xeon."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(BLOCK_TOKENS, BLOCK_D, generator=gen, requires_grad=True)
    w1 = (torch.randn(BLOCK_D, BLOCK_F, generator=gen) / BLOCK_D**0.5).requires_grad_()
    w2 = (torch.randn(BLOCK_F, BLOCK_D, generator=gen) / BLOCK_F**0.5).requires_grad_()

    def run() -> None:
        out = torch.nn.functional.layer_norm(torch.nn.functional.silu(x @ w1) @ w2 + x, (BLOCK_D,))
        out.square().mean().backward()
    return run


def recipe_model(name: str):
    """The model section of configs/`name`.yaml."""
    from megatron_taper.config import load_config

    return load_config(os.path.join(os.path.dirname(__file__), "..", "configs", f"{name}.yaml"), []).model


def forward_backward_seconds(cfg, checkpointing: str, repeats: int) -> float:
    """Best of `repeats`: one forward and backward of model `cfg` on one sequence, its blocks under
    train.activation_checkpointing=`checkpointing` (parallel/block_options.py)."""
    from megatron_taper.models import build_model
    from megatron_taper.parallel.block_options import apply_block_options

    torch.manual_seed(0)
    model, tokens = build_model(cfg), torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))
    apply_block_options(model, checkpointing, 1, False)
    return best_of(lambda: model(tokens).float().mean().backward(), repeats=repeats)


def op_overhead() -> tuple[float, int]:
    """Seconds per eager operator: a narrowed 2-block tiny Titans (cost/op_count.py's widths, 128
    tokens: ~12k operators of little arithmetic each) forward and backward, best of 7, over its
    operator count; an upper bound, as its arithmetic is counted in."""
    from megatron_taper.cost.op_count import dispatched_ops, narrowed

    cfg = narrowed(recipe_model("tiny_titans"), 2, 128)
    _, ops = dispatched_ops(cfg)
    return forward_backward_seconds(cfg, "none", 7) / ops, ops


def _blocks(n: int) -> float:
    """Seconds of `n` MLP blocks on this rank's one thread, every rank starting together."""
    block = mlp_block()
    block()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        block()
    return time.perf_counter() - start


def oversubscribed_efficiency(cores: int, n: int = 40) -> float:
    """The host's total MLP-block rate with 2 x `cores` one-thread processes over its rate with
    `cores` of them: what the cores lose to switching between more ranks than they have (the
    step-time model's host bound divides by it)."""
    rates = []
    for processes in (cores, 2 * cores):
        slowest = max(run_distributed(_blocks, processes, n, timeout=600, device="cpu"))
        rates.append(processes * n / slowest)
    return rates[1] / rates[0]


def op_checkpoint_overhead() -> float:
    """Seconds per forward operator that activation_checkpointing=op adds to a block: a narrowed
    tiny Transformer (cost/op_count.py's widths, 128 tokens) at 2 and 4 blocks, forward and
    backward with op-level checkpointing less without, best of 9 each, per block over its forward
    operators (the arithmetic is small at these widths: what remains is the policy's and the
    recompute's host time)."""
    from megatron_taper.cost.op_count import count_ops, narrowed

    base = recipe_model("tiny_taper")
    added = {}
    for blocks in (2, 4):
        cfg = narrowed(base, blocks, 128)
        added[blocks] = forward_backward_seconds(cfg, "op", 9) - forward_backward_seconds(cfg, "none", 9)
    return (added[4] - added[2]) / 2 / count_ops(base, 128).block_forward


def median_of(fn, repeats: int = 5) -> float:
    """The median seconds of a collective `fn`, every rank starting together."""
    return best_of(fn, repeats, median=True, before=dist.barrier)


def _collectives(numel: int) -> dict[str, float]:
    """On each of the gloo processes (one thread each): seconds of the MLP block and of each collective."""
    world = dist.get_world_size()
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
    dist.barrier()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=2048, help="square matmul size")
    parser.add_argument("--mib", type=int, default=64, help="all-reduce / copy size in MiB")
    parser.add_argument("--write", default="", metavar="FILE",
                        help="also write the figures the planner takes as a measured profile of the cpu "
                             "entry (megatron-taper-plan --measured-profile, parallel.layout_profile)")
    args = parser.parse_args()
    n = args.size
    a, b = torch.randn(n, n), torch.randn(n, n)
    matmul_s = best_of(lambda: a @ b)
    block_s = best_of(mlp_block())
    per_op_s, ops = op_overhead()
    op_checkpoint_s = op_checkpoint_overhead()
    cores = os.cpu_count() or 1
    numel = args.mib * 2**20 // 4
    src = torch.ones(numel)
    dst = torch.empty_like(src)
    copy_s = best_of(lambda: dst.copy_(src))
    coll = run_distributed(_collectives, 2, numel, timeout=600, device="cpu")[0]  # rank 0's figures
    nbytes = 4 * numel
    # bus bandwidth of 2 ranks: ring all-reduce moves 2 (n - 1) / n x bytes, all-gather and
    # reduce-scatter (n - 1) / n x the whole tensor's bytes
    moved = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5}
    bus = {k: f * nbytes / coll[k] / 1e9 for k, f in moved.items()}
    figures = {
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
        "cores": cores, "oversubscribed_efficiency": oversubscribed_efficiency(cores),
        "op_overhead_us": 1e6 * per_op_s, "op_overhead_ops": ops, "op_checkpoint_overhead_us": 1e6 * op_checkpoint_s,
        "cpu": (open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(" \t:")
                if os.path.exists("/proc/cpuinfo") else ""),
    }
    print(json.dumps(figures))
    if args.write:
        write_profile(args.write, figures, args.size, args.mib)


def write_profile(path: str, m: dict, size: int, mib: int) -> None:
    """The measured-profile file of the cpu entry (cost/devices.py profiles' `measured`): each
    number with where and how it was measured. `mfu` is the MLP block's rate over the matmul peak:
    the matmul-sized work of a small model's step, not a fit to any run."""
    where = f"measured with benchmarks/cpu_profile.py on {m['cpu'] or 'this CPU'}, {time.strftime('%Y-%m-%d %H:%M')}"
    entry = {
        "fp32_tflops": m["fp32_matmul_tflops"], "mfu": min(1.0, m["block_tflops"] / m["fp32_matmul_tflops"]),
        "memory_tb_per_s": m["copy_gb_per_s"] / 1e3,
        "intra_node_gb_per_s": m["gloo_allreduce_bus_gb_per_s"],
        "inter_node_gb_per_s": m["gloo_allreduce_bus_gb_per_s"],
        "all_gather_efficiency": m["all_gather_efficiency"],
        "reduce_scatter_efficiency": m["reduce_scatter_efficiency"],
        "collective_latency_us": m["collective_latency_us"],
        "concurrent_efficiency": min(1.0, m["concurrent_efficiency"]),
        "oversubscribed_efficiency": min(1.0, m["oversubscribed_efficiency"]),
        "op_overhead_us": m["op_overhead_us"], "op_checkpoint_overhead_us": m["op_checkpoint_overhead_us"],
        "sources": {
            "flops": f"{where}: a {size}^2 fp32 matmul on {m['threads']} thread(s), best of 5",
            "mfu": f"{where}: the MLP block ([{BLOCK_TOKENS}, {BLOCK_D}] -> {BLOCK_F}, forward and backward, SiLU, "
                   "layer norm) over the matmul peak",
            "memory": f"{where}: a {mib} MiB copy (read + write), best of 5",
            "links": f"{where}: gloo all-reduce of {mib} MiB between 2 local processes, ring bus bandwidth, "
                     "median of 5",
            "collectives": f"{where}: all-gather / reduce-scatter bus bandwidth over the all-reduce's ({mib} MiB, "
                           "median of 5); latency: what a 4 KiB all-reduce adds to a loop of ~5 ms matmuls",
            "concurrent_efficiency": f"{where}: the MLP block's rate in 2 one-thread processes at once over alone",
            "oversubscribed_efficiency": f"{where}: the MLP block's total rate in {2 * m['cores']} one-thread "
                                         f"processes over {m['cores']} ({m['cores']} cores)",
            "op_overhead": f"{where}: a narrowed 2-block tiny Titans' forward and backward over its operators",
            "op_checkpoint_overhead": f"{where}: a narrowed tiny Transformer's forward and backward with op-level "
                                      "checkpointing less without, per block forward operator (2 and 4 blocks)"}}
    with open(path + ".tmp", "w") as f:
        json.dump({"devices": {"cpu": entry}}, f, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
