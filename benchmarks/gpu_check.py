"""One prepared check for a single CUDA GPU (target: an H200), in under 8 minutes.

1. Parity: configs/tiny_taper.yaml on byte tokens of real text, fp32, 10 steps of the Trainer on
   the CPU and on the GPU from the same weights and batches; the largest loss difference
   (tolerance PARITY_TOL: fp32 reduction orders of the two devices differ by ~1e-6 per step; a
   wrong kernel or a lost gradient moves the loss by 1e-3 or more).
2. Throughput: a ~1.3B tapered Transformer (configs/transformer_1.3b_taper.yaml with pp=1) in
   bf16 with parallel.zero=fsdp2 at dp=1 (one process: nothing to shard, so the model runs as is
   under bf16 autocast), train.activation_checkpointing none / selective / full, each with and
   without train.compile: step time, tokens/s, MFU (the taper-exact FLOPs of flops.model_costs,
   6 x forward per token, against the device's dense bf16 peak), peak allocated and reserved GPU
   memory. Steps are the Trainer's own (`train_step`) on random tokens. Variants still to run when
   the time budget (--budget-s) is nearly spent are reported as skipped, not estimated.

Prints one JSON object (and writes it to --out). `--smoke` runs both parts at toy sizes (2 steps,
two variants without compile) on whatever device there is, so that tests/launch/test_gpu_check.py keeps
this script working on machines without a GPU.

    bash benchmarks/gpu_check.sh            # writes benchmarks/results/gpu_check.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from megatron_taper.config import load_config
from megatron_taper.cost.flops import mfu, model_costs, peak_flops
from megatron_taper.data.corpus import embedded_files
from megatron_taper.trainer import Trainer

PARITY_TOL = 1e-4
VARIANTS = [("none", False), ("selective", False), ("full", False), ("none", True), ("selective", True),
            ("full", True)]


def byte_tokens(folder: str) -> str:
    data = b"".join(Path(p).read_bytes() for p in embedded_files(1_500_000))
    path = Path(folder) / "bytes.npy"
    np.save(path, np.frombuffer(data, dtype=np.uint8).astype(np.uint16))
    return str(path)


def random_tokens(folder: str, vocab: int, n: int) -> str:
    path = Path(folder) / "random.npy"
    np.save(path, np.random.default_rng(0).integers(0, vocab, n, dtype=np.int64).astype(np.uint16 if vocab <= 65535
                                                                                             else np.uint32))
    return str(path)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def losses(overrides: list[str], steps: int) -> list[float]:
    trainer = Trainer(load_config("configs/tiny_taper.yaml", overrides))
    out = [float(trainer.train_step()["loss"]) for _ in range(steps)]
    trainer.metrics.close()
    return out


def parity(folder: str, device: str, steps: int) -> dict:
    common = ["model.vocab_size=256", f"data.path={byte_tokens(folder)}", "run.tensorboard=false",
              "train.precision=fp32", "train.log_interval=1000"]
    cpu = losses([*common, "train.device=cpu", f"run.dir={folder}/parity_cpu"], steps)
    dev = losses([*common, f"train.device={device}", f"run.dir={folder}/parity_dev"], steps)
    diff = max(abs(a - b) for a, b in zip(cpu, dev))
    return {"steps": steps, "cpu_losses": cpu, "device_losses": dev, "max_abs_diff": diff, "tolerance": PARITY_TOL,
            "ok": diff < PARITY_TOL}


def throughput(shape: list[str], folder: str, ac: str, compiled: bool, steps: int, warmup: int) -> dict:
    cfg = load_config("configs/transformer_1.3b_taper.yaml", [
        *shape, f"run.dir={folder}/tp_{ac}_{int(compiled)}", "run.tensorboard=false", "parallel.pp=1",
        "parallel.microbatches=0", "parallel.zero=fsdp2", f"train.activation_checkpointing={ac}",
        f"train.compile={str(compiled).lower()}", "train.log_interval=1000", "train.eval_batches=1"])
    trainer = Trainer(cfg)
    device = trainer.ctx.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(warmup):  # compiles, DDP/FSDP lazy init, allocator warm-up
        trainer.train_step()
    sync(device)
    warm_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    sync(device)
    step_s = (time.perf_counter() - start) / steps
    tokens = cfg.train.global_batch * cfg.model.seq_len
    flops_per_token = model_costs(cfg.model).total_flops
    result = {"activation_checkpointing": ac, "compile": compiled, "step_s": step_s, "tokens_per_s": tokens / step_s,
              "warmup_s": warm_s, "mfu": mfu(tokens / step_s, flops_per_token, peak_flops(device, trainer.bf16)),
              "bf16": trainer.bf16, "params": model_costs(cfg.model).total_params}
    if device.type == "cuda":
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    trainer.metrics.close()
    del trainer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/gpu_check.json")
    parser.add_argument("--budget-s", type=float, default=450.0, help="stop starting variants after this")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="toy sizes on any device (a CPU check of the script)")
    args = parser.parse_args()
    began = time.perf_counter()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("error: no CUDA device (use --smoke to exercise the script on the CPU)", file=sys.stderr)
        return 2
    device = "cuda" if cuda else "cpu"
    report: dict = {"benchmark": "gpu_check", "device": torch.cuda.get_device_name() if cuda else "cpu",
                    "torch": torch.__version__, "cuda": torch.version.cuda, "smoke": args.smoke}
    if args.smoke:  # a 2-layer toy of the same recipe, 2 steps
        shape = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.mlp_width=128",
                 "model.vocab_size=512", "model.seq_len=32", "train.global_batch=2", "train.micro_batch=2"]
        steps, warmup, parity_steps = 2, 1, 2
        variants = [("none", False), ("full", False)]  # compile is covered by tests/parallel/test_step_engines.py
    else:  # global batch 8 x 2048 tokens as 2 micro-batches of 4
        shape = ["train.global_batch=8", "train.micro_batch=4"]
        steps, warmup, parity_steps = args.steps, 3, 10
        variants = VARIANTS
    with tempfile.TemporaryDirectory() as folder:
        report["parity"] = parity(folder, device, parity_steps)
        vocab = load_config("configs/transformer_1.3b_taper.yaml", shape).model.vocab_size
        shape = [*shape, f"data.path={random_tokens(folder, vocab, 4_000_000)}", f"train.device={device}",
                 "train.precision=bf16" if cuda else "train.precision=fp32"]
        report["throughput"] = []
        for ac, compiled in variants:
            if time.perf_counter() - began > args.budget_s:
                report["throughput"].append({"activation_checkpointing": ac, "compile": compiled,
                                             "skipped": f"time budget of {args.budget_s:.0f} s spent"})
                continue
            report["throughput"].append(throughput(shape, folder, ac, compiled, steps, warmup))
            print(json.dumps(report["throughput"][-1]), file=sys.stderr, flush=True)
    report["elapsed_s"] = time.perf_counter() - began
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    json.dump(report, sys.stdout)
    print()
    return 0 if report["parity"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
