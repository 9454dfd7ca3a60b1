"""Peak host memory per rank while a DeepSpeed ZeRO-3 checkpoint is prepared, at dp=2: before
(every parameter's fp32 weights and AdamW moments all-gathered onto every rank, then dropped by
all but rank 0: `logical_state`, what checkpoint_pieces did) and after (each rank copies its own
partitions: `checkpoint_pieces`).

    python benchmarks/deepspeed_save_memory.py [key=value ...]

Two gloo processes on the CPU; one training step first (so AdamW state exists), then each way of
collecting the pieces with a thread sampling the process's resident set size (/proc/self/statm)
every 2 ms; reported per rank: the peak over the RSS just before, in MiB, and the bytes of the
pieces the rank would write. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import tempfile
import threading
import time

from megatron_taper.parallel.spawn import run_distributed

DEFAULT = ["model.n_layers=8", "model.d_model=512", "model.n_heads=8", "model.mlp_width=1536",
           "model.vocab_size=8192", "model.seq_len=64", "model.taper.multiple=32", "train.global_batch=4",
           "train.micro_batch=2", "train.device=cpu", "train.precision=fp32", "run.tensorboard=false"]
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def peak_during(fn) -> tuple[float, object]:
    """(peak RSS over the RSS before, in MiB) while fn() runs, and fn's result."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base, peak, done = rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    result = fn()
    peak[0] = max(peak[0], rss())
    done.set()
    thread.join()
    return (peak[0] - base) / 2**20, result


def worker(folder: str, overrides: list[str]) -> dict:
    """On each of the 2 gloo processes: one step, then both ways of collecting the pieces (module doc)."""
    import torch

    from megatron_taper.config import load_config
    from megatron_taper.data.sources import build_sources
    from megatron_taper.training.build import build_run

    cfg = load_config(None, [*DEFAULT, *overrides, "parallel.zero=deepspeed", f"run.dir={folder}/run",
                             f"data.path={folder}/tokens.npy"])
    run = build_run(cfg)
    pm, optimizer = run.model, run.optimizer
    source, _ = build_sources(cfg.data, seq_len=cfg.model.seq_len, micro_batch=cfg.train.micro_batch,
                              seed=0, vocab_size=cfg.model.vocab_size, dp_rank=run.ctx.dp_rank, dp_size=run.ctx.dp)
    pm.forward_backward([source.next_batch() for _ in range(run.layout.accumulation)], contextlib.nullcontext)
    pm.optimizer_step(optimizer, cfg.train.grad_clip)

    def before():
        model_state, optim_state = pm.logical_state(optimizer)  # gathers on every rank
        if run.ctx.dp_rank or run.ctx.tp_rank:
            return 0
        return sum(t.numel() * t.element_size() for t in model_state.values()) + sum(
            v.numel() * v.element_size() for s in optim_state.values() for v in s.values())

    def after():
        return sum(p.data.numel() * p.data.element_size() for p in pm.checkpoint_pieces(optimizer))

    after_mib, after_bytes = peak_during(after)
    before_mib, before_bytes = peak_during(before)
    params = sum(int(p.ds_numel) for p in pm.module.parameters())
    torch.distributed.barrier()
    return {"params": params, "before_peak_mib": before_mib, "before_written_bytes": before_bytes,
            "after_peak_mib": after_mib, "after_written_bytes": after_bytes}


def main() -> None:
    import numpy as np

    from megatron_taper.config import load_config

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="key=value config overrides (the model: DEFAULT)")
    overrides = parser.parse_args().overrides
    with tempfile.TemporaryDirectory() as folder:
        np.save(os.path.join(folder, "tokens.npy"),
                np.random.default_rng(0).integers(0, 8192, 200_000).astype(np.uint16))
        device = load_config(None, [*DEFAULT, *overrides]).train.device
        accelerator = os.environ.get("DS_ACCELERATOR", "cpu" if device == "cpu" else "")
        ranks = run_distributed(worker, 2, folder, overrides, timeout=3600, device=device,
                                env={"DS_ACCELERATOR": accelerator} if accelerator else {})
    print(json.dumps({"benchmark": "deepspeed_save_memory", "dp": 2, "ranks": ranks}))


if __name__ == "__main__":
    main()
