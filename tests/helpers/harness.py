"""Run a function on N gloo processes from inside pytest.

    from harness import run_distributed

    def _check(tp):            # module level, so child processes can import it
        ...                    # torch.distributed is initialised (gloo); RANK, WORLD_SIZE,
        return something       # LOCAL_RANK, MASTER_ADDR/PORT are set; return value is pickled

    def test_x():
        results = run_distributed(_check, 2, 2, timeout=60)   # one result per rank

The parent owns a TCPStore on a free port (no port races), children join it. A rank that raises
fails the test with that rank's traceback; the other ranks are then killed, so a peer blocked in
a collective never hangs the suite; the whole run is bounded by `timeout`. Children come from a
forkserver that has imported torch and this package once, so a run starts in well under a second after the first.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

_CTX = mp.get_context("forkserver")
# imported once by the fork server, so every child starts with them: test modules import these,
# and torch.optim's first optimizer imports torch._dynamo (seconds per process otherwise)
_CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "pytest",
                             "megatron_taper.parallel", "megatron_taper.models"])


class DistributedTestError(AssertionError):
    """A rank failed, died or timed out; the message carries its traceback."""


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                    env: dict[str, str] | None = None) -> list[Any]:
    """Run fn(*args) on `world_size` gloo processes; return the per-rank results (rank order)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    results: "mp.Queue[tuple[int, bool, Any]]" = _CTX.Queue()
    procs = []
    for rank in range(world_size):
        child_env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                     "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(store.port), "OMP_NUM_THREADS": "1", **(env or {})}
        p = _CTX.Process(target=_child, args=(fn, args, rank, world_size, store.port, timeout, child_env, results),
                         name=f"rank{rank}", daemon=True)
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
                        raise DistributedTestError(
                            f"{dead[0].name} died with exit code {dead[0].exitcode} before reporting") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(out))
                    raise DistributedTestError(
                        f"timed out after {timeout:.0f} s; ranks {missing} did not finish") from None
                continue
            if not ok:
                raise DistributedTestError(f"rank {rank} of {world_size} failed:\n{value}")
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
            raise DistributedTestError(f"rank {rank} failed:\n{value}")
        out[rank] = pickle.loads(value)


def _child(fn, args, rank, world_size, port, timeout, env, results) -> None:
    os.environ.update(env)
    ok, value = True, None
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=timedelta(seconds=timeout))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
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
