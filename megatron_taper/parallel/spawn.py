"""Run a function on N local processes joined in one process group (benchmarks, tests).

    from megatron_taper.parallel.spawn import run_distributed

    def _check(tp):            # module level, so child processes can import it
        ...                    # torch.distributed is initialised (gloo, or nccl on CUDA); RANK, WORLD_SIZE,
        return something       # LOCAL_RANK, MASTER_ADDR/PORT are set; return value is pickled

    results = run_distributed(_check, 2, 2, timeout=60)   # one result per rank

The parent owns a TCPStore on a free port (port 0: no port races), children join it. The device
of each rank is chosen as the trainer chooses it (context.choose_device: `device="auto"` takes
cuda:LOCAL_RANK when CUDA is there, else the CPU) and the backend follows the device
(context.process_group_backend: nccl on CUDA, gloo on the CPU). A rank that raises fails the run
with that rank's traceback (RankFailure); the other ranks are then killed, so a peer blocked in a
collective never hangs the caller; the whole run is bounded by `timeout`. Children come from a
forkserver that has imported torch and this package once (`preload`, read when this process first
starts the server), so a run starts in well under a second after the first; `fn` runs with
`threads` torch threads (0: torch's default). `env` is set in each child before fn runs, after
torch was imported: what a library reads at its import (glibc's malloc settings, torch's
OMP_NUM_THREADS) needs a fresh interpreter instead (torchrun).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Sequence

# imported once by the fork server, so every child starts with them: torch.optim's first optimizer
# imports torch._dynamo (seconds per process otherwise)
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "megatron_taper.parallel", "megatron_taper.models")


class RankFailure(RuntimeError):
    """A rank failed, died or timed out; the message carries its traceback."""


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                    env: dict[str, str] | None = None, device: str = "auto", threads: int = 1,
                    preload: Sequence[str] = PRELOAD) -> list[Any]:
    """Run fn(*args) on `world_size` local processes in one process group; return the per-rank
    results (rank order). `env` is set in each child before fn runs; `device` as train.device."""
    import torch.distributed as dist

    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(preload))  # takes effect when the server starts (once per process)
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    results: "mp.Queue[tuple[int, bool, Any]]" = context.Queue()
    procs = []
    for rank in range(world_size):
        child_env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                     "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(store.port), **({"OMP_NUM_THREADS": str(threads)} if threads else {}),
                     **(env or {})}
        p = context.Process(target=_child, args=(fn, args, rank, world_size, store.port, timeout, device, threads,
                                                 child_env, results), name=f"rank{rank}", daemon=True)
        p.start()
        procs.append(p)
    deadline = time.monotonic() + timeout
    out: dict[int, Any] = {}
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    _drain(results, out)
                    if len(out) < world_size:
                        raise RankFailure(
                            f"{dead[0].name} died with exit code {dead[0].exitcode} before reporting") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(out))
                    raise RankFailure(f"timed out after {timeout:.0f} s; ranks {missing} did not finish") from None
                continue
            if not ok:
                raise RankFailure(f"rank {rank} of {world_size} failed:\n{value}")
            out[rank] = pickle.loads(value)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
        del store
    return [out[r] for r in range(world_size)]


def _drain(results, out: dict[int, Any]) -> None:
    while True:
        try:
            rank, ok, value = results.get(timeout=0.5)
        except queue.Empty:
            return
        if not ok:
            raise RankFailure(f"rank {rank} failed:\n{value}")
        out[rank] = pickle.loads(value)


def _child(fn, args, rank, world_size, port, timeout, device, threads, env, results) -> None:
    os.environ.update(env)
    ok, value = True, None
    try:
        import torch
        import torch.distributed as dist

        from megatron_taper.parallel.context import choose_device, process_group_backend

        if threads:
            torch.set_num_threads(threads)
        dev = choose_device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=timedelta(seconds=timeout))
        dist.init_process_group(process_group_backend(dev), store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout), device_id=dev if dev.type == "cuda" else None)
        value = pickle.dumps(fn(*args))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        ok, value = False, traceback.format_exc()
    results.put((rank, ok, value))
    if ok:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    results.close()
    results.join_thread()
    os._exit(0)
