"""Measure this CPU's entries of megatron_taper/cost/devices.json: dense fp32 matmul FLOP/s on the
threads torch uses, memory copy bandwidth, and the gloo all-reduce bus bandwidth between 2 local
processes (what tp / dp / pp traffic runs over on one CPU machine).

    OMP_NUM_THREADS=2 python benchmarks/cpu_profile.py [--size 2048] [--mib 64]

Prints one JSON object.
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


def best_of(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _allreduce(rank: int, world: int, port: int, numel: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x = torch.ones(numel)
    seconds = best_of(lambda: dist.all_reduce(x), 5)
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
    numel = args.mib * 2**20 // 4
    src = torch.ones(numel)
    dst = torch.empty_like(src)
    copy_s = best_of(lambda: dst.copy_(src))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_allreduce, args=(r, 2, port, numel, queue)) for r in range(2)]
    for p in procs:
        p.start()
    ar_s = queue.get(timeout=300)
    for p in procs:
        p.join()
    nbytes = 4 * numel
    print(json.dumps({
        "threads": torch.get_num_threads(),
        "fp32_matmul_tflops": 2 * n**3 / matmul_s / 1e12,
        "copy_gb_per_s": 2 * nbytes / copy_s / 1e9,  # read + write
        # ring all-reduce bus bandwidth: 2 (n - 1) / n x bytes / time
        "gloo_allreduce_bus_gb_per_s": 2 * (2 - 1) / 2 * nbytes / ar_s / 1e9,
        "cpu": (open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(" \t:")
                if os.path.exists("/proc/cpuinfo") else ""),
    }))


if __name__ == "__main__":
    main()
