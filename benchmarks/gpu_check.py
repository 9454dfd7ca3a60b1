"""One prepared check for a single CUDA GPU (target: an H200), in under 8 minutes.

1. Parity: configs/tiny_taper.yaml on byte tokens of real text, 10 steps of the Trainer on the CPU
   and on the GPU from the same weights and batches; the largest loss difference. In fp32
   (PARITY_TOL: fp32 reduction orders of the two devices differ by ~1e-6 per step; a wrong kernel
   or a lost gradient moves the loss by 1e-3 or more) and in bf16 autocast on both (`bf16_parity`,
   BF16_TOL: both round the same matmul outputs to bf16, u = 2^-8, but oneDNN and cuBLAS sum in
   other orders, so one rounding may land on the other side; measured 1e-4 on the H200). The
   mixture of experts the same way in bf16 (`moe_bf16_parity`: configs/tiny_moe_taper.yaml, whose
   experts run torch's grouped GEMM on the GPU and the loop over experts on the CPU; not yet run
   on a GPU).
2. Throughput: a ~1.3B tapered Transformer (configs/transformer_1.3b_taper.yaml with pp=1) in bf16
   with parallel.zero=fsdp2 at dp=1 (one process: nothing to shard, so the model runs as is under
   bf16 autocast), one variant per entry of VARIANTS, most wanted first (the baseline, float8
   linears, op-level activation checkpointing, one 32K-token sequence (LONG_CONTEXT), the chunked
   loss, whole-block checkpointing, then with train.compile, float8 with compile last but one),
   then an 8B-shaped slice (SLICE_8B: 4 blocks of Llama-3 8B's widths, tapered) compiled in bf16
   and in float8 (tensorwise, rowwise) at parallel.zero=none:
   step time, tokens/s, MFU (the taper-exact FLOPs of flops.model_costs, 6 x forward per token,
   against the device's dense bf16 peak), peak allocated and reserved GPU memory, and beside them
   the layout planner's prediction for the same run (plan.Predictor with this device's profile:
   `predicted_peak_gib`, `predicted_step_s` and the measured / predicted ratios). MFU is given in
   two labelled conventions: `mfu_causal` (attention FLOPs of the causal half, this project's FLOPs
   model) and `mfu_full_attention` (torchtitan's: attention counted as full, which reads higher).
   Steps are the Trainer's own (`train_step`) on random tokens. Variants still to run when the time
   budget (--budget-s) is spent are reported as skipped, and a variant that reaches the budget
   mid-way stops and reports the steps it timed (`truncated`). torch._dynamo.reset() runs between
   variants, so one compiled variant's caches and recompile limits never reach the next.
3. NCCL (gloo on a CPU) at world size 1: in one process started by the shared launcher
   (megatron_taper/parallel/spawn.py), every collective the trainer and checkpointer use
   (all_reduce sum/avg/max/min, all_gather, reduce_scatter, broadcast, gather_object,
   broadcast_object_list, barrier) runs once, then a Trainer takes 2 steps with the (1, 1, 1)
   mesh and writes a checkpoint.

Every part runs in its own try: a failure is recorded in the JSON (`failed`: the error) and the
next part runs; the JSON file is rewritten after each part, so a crash keeps what finished.
Prints one JSON object at the end (and writes it to --out); exit 1 when parity or any part failed.
`--smoke` runs all parts at toy sizes (2 steps; parity and the collectives' Trainer on 2 sequences
of 32 tokens a step (SMOKE_STEP); three variants, none compiled on the CPU (float8's with
train.compile=auto, eager there, and its rule set to take every linear), plus one variant made to
fail on purpose, recorded as `failed` with `expected_failure`) on whatever device there is, so
that tests/launch/test_gpu_check.py keeps this script working on machines without a GPU.

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
import traceback
from pathlib import Path

import numpy as np
import torch

from megatron_taper.config import load_config
from megatron_taper.cost.flops import mfu, model_costs, peak_flops
from megatron_taper.data.corpus import embedded_files
from megatron_taper.parallel.spawn import run_distributed
from megatron_taper.training.trainer import Trainer

PARITY_TOL = 1e-4
BF16_TOL = 2e-2
# --smoke's parity, collectives and resume runs: the tiny recipes at 64 tokens a step (2 sequences of 32)
SMOKE_STEP = ("model.seq_len=32", "train.global_batch=2", "train.micro_batch=2")
# one sequence of 32K tokens a step (global batch 1): the long-context probe of the memory model
LONG_CONTEXT = ["model.seq_len=32768", "train.global_batch=1", "train.micro_batch=1"]
SHAPE = ["train.global_batch=8", "train.micro_batch=4"]  # the throughput runs' step: 2 micro-batches of 4
# each variant: train.* overrides; activation_checkpointing and compile always named
VARIANTS = [
    {"activation_checkpointing": "none", "compile": False},
    {"activation_checkpointing": "none", "compile": False, "float8": True},
    {"activation_checkpointing": "op", "compile": False},
    {"activation_checkpointing": "op", "compile": False, "overrides": LONG_CONTEXT},
    {"activation_checkpointing": "none", "compile": False, "loss_chunk": 1024},
    {"activation_checkpointing": "full", "compile": False},
    {"activation_checkpointing": "none", "compile": True},
    {"activation_checkpointing": "none", "compile": True, "float8": True},
    {"activation_checkpointing": "selective", "compile": False},
]
# an 8B-shaped slice (Llama-3 8B's widths: d_model 4096, 32 heads of which 8 for keys and values, MLP
# 14336 tapered in units of 128; 4 blocks) that fits one GPU: where float8's rule converts every linear
# but wk / wv (1024 features), the probe of cost/speedups.json's float8 ratios, compiled in bf16 and in
# both float8 recipes
SLICE_8B = ["model.n_layers=4", "model.d_model=4096", "model.n_heads=32", "model.n_kv_heads=8",
            "model.mlp_width=14336", "model.taper.multiple=128"]
SLICE_8B_VARIANTS = [
    {"activation_checkpointing": "none", "compile": True, "overrides": SLICE_8B},
    {"activation_checkpointing": "none", "compile": True, "float8": True, "float8_recipe": "tensorwise",
     "overrides": SLICE_8B},
    {"activation_checkpointing": "none", "compile": True, "float8": True, "float8_recipe": "rowwise",
     "overrides": SLICE_8B},
]


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


def losses(overrides: list[str], steps: int, config: str = "configs/tiny_taper.yaml") -> list[float]:
    trainer = Trainer(load_config(config, overrides))
    out = [float(trainer.train_step()["loss"]) for _ in range(steps)]
    trainer.prefetch.close()
    trainer.metrics.close()
    return out


def parity(folder: str, device: str, steps: int, precision: str = "fp32",
           config: str = "configs/tiny_taper.yaml", extra: tuple[str, ...] = ()) -> dict:
    """The same `steps` Trainer steps of `config` on the CPU and on `device`, from the same weights and
    batches (byte tokens), in `precision` (bf16: autocast on both, the CPU's through oneDNN)."""
    common = ["model.vocab_size=256", f"data.path={byte_tokens(folder)}", "run.tensorboard=false",
              f"train.precision={precision}", "train.log_interval=1000", "train.compile=false", *extra]
    name = f"{Path(config).stem}_{precision}"
    cpu = losses([*common, "train.device=cpu", f"run.dir={folder}/parity_cpu_{name}"], steps, config)
    dev = losses([*common, f"train.device={device}", f"run.dir={folder}/parity_dev_{name}"], steps, config)
    diff = max(abs(a - b) for a, b in zip(cpu, dev))
    tolerance = BF16_TOL if precision == "bf16" else PARITY_TOL
    return {"config": config, "precision": precision, "steps": steps, "cpu_losses": cpu, "device_losses": dev,
            "max_abs_diff": diff, "tolerance": tolerance, "ok": diff < tolerance}


def predict(cfg, measured_step_s: float, measured_peak_bytes: float | None, profile=None) -> dict:
    """The layout planner's prediction for this one-process run (megatron_taper/cost/plan.py, the device's
    profile from cost/devices.json, or `profile`) beside the measurement: peak memory and step time,
    with ratios."""
    from megatron_taper.cost.auto_layout import local_device
    from megatron_taper.cost.memory import GIB
    from megatron_taper.cost.plan import Predictor

    if profile is None:
        profile, _, where = local_device(cfg.train.device, 1)
    else:
        where = profile.name
    predicted = Predictor(cfg, profile).predict(cfg, 1, float("inf"))
    out = {"profile": where, "predicted_step_s": predicted.step.total,
           "step_ratio": measured_step_s / predicted.step.total, "predicted_mfu": predicted.mfu,
           "predicted_peak_gib": predicted.peak / GIB}
    if measured_peak_bytes is not None:
        out["peak_ratio"] = measured_peak_bytes / predicted.peak
    return out


def run_config(config: str, shape: list[str], folder: str, variant: dict, zero: str):
    """The Config of one throughput run: `config` at pp = 1 with `shape`, `variant` and `zero`."""
    settings = {k: v for k, v in variant.items() if k != "overrides"}
    name = "_".join(f"{k}{v}" for k, v in settings.items()) + "".join(
        "_" + o.rsplit("=", 1)[-1] for o in variant.get("overrides", []))
    return load_config(config, [
        *shape, f"run.dir={folder}/tp_{Path(config).stem}_{name}", "run.tensorboard=false", "parallel.pp=1",
        "parallel.microbatches=0", f"parallel.zero={zero}", "train.log_interval=1000", "train.eval_batches=1",
        *(f"train.{k}={str(v).lower()}" for k, v in settings.items()), *variant.get("overrides", [])])


def throughput(shape: list[str], folder: str, variant: dict, steps: int, warmup: int, deadline: float,
               config: str = "configs/transformer_1.3b_taper.yaml", zero: str = "fsdp2") -> dict:
    """Steps of `config` in one process at pp = 1 (`variant`: train.* settings, `overrides`: more):
    step time, tokens/s, MFU, peak GPU memory and the planner's prediction of the last two."""
    cfg = run_config(config, shape, folder, variant, zero)
    trainer = Trainer(cfg)
    try:
        device = trainer.ctx.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        for _ in range(warmup):  # compiles, FSDP lazy init, allocator warm-up
            trainer.train_step()
        sync(device)
        warm_s = time.perf_counter() - start
        start, done = time.perf_counter(), 0
        while done < steps and (done == 0 or time.perf_counter() < deadline):
            trainer.train_step()
            done += 1
            if time.perf_counter() >= deadline:
                sync(device)
        sync(device)
        step_s = (time.perf_counter() - start) / done
        tokens = cfg.train.global_batch * cfg.model.seq_len
        peak = peak_flops(device, trainer.bf16)
        causal, full = model_costs(cfg.model), model_costs(cfg.model, causal=False)
        result = {"steps": done, "truncated": done < steps, "float8_min_dim": cfg.train.float8_min_dim,
                  "step_s": step_s, "tokens_per_s": tokens / step_s, "warmup_s": warm_s,
                  "mfu_causal": mfu(tokens / step_s, causal.total_flops, peak),
                  "mfu_full_attention": mfu(tokens / step_s, full.total_flops, peak),
                  "bf16": trainer.bf16, "params": causal.total_params}
        peak_bytes, peaks = peak_memory(device)
        return {**result, **peaks, **prediction(cfg, step_s, peak_bytes)}
    finally:
        close_trainer(trainer)
        del trainer
        release_memory()


def peak_memory(device: torch.device) -> tuple[int | None, dict]:
    """The peak allocated bytes since the last reset and the row's peak fields (GiB); none off CUDA."""
    if device.type != "cuda":
        return None, {}
    peak, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    return peak, {"peak_allocated_gib": peak / 2**30, "peak_reserved_gib": reserved / 2**30}


def prediction(cfg, step_s: float, peak_bytes: int | None) -> dict:
    """predict's fields, or why there are none (the measurement stands without them)."""
    try:
        return predict(cfg, step_s, peak_bytes)
    except Exception as e:  # noqa: BLE001
        return {"prediction_failed": f"{type(e).__name__}: {e}"}


def close_trainer(trainer) -> None:
    """Stop a benchmark Trainer's prefetch thread and metrics writers."""
    if trainer.prefetch is not None:
        trainer.prefetch.close()
    trainer.metrics.close()


def release_memory() -> None:
    """Free what the last run left (after its references are dropped): garbage, the CUDA cache,
    dynamo's compiled code."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    torch._dynamo.reset()


def collectives(folder: str, device: str, extra: tuple[str, ...] = ()) -> dict:
    """World size 1 on NCCL (gloo on the CPU), one process of the shared launcher: every collective
    once, then 2 Trainer steps (of the tiny recipe with `extra` overrides) and a save."""
    return run_distributed(_collectives_rank, 1, folder, device, extra, timeout=600, device=device, threads=0)[0]


def _collectives_rank(folder: str, device: str, extra: tuple[str, ...]) -> dict:
    import torch.distributed as dist

    backend = str(dist.get_backend())  # nccl on CUDA, gloo on the CPU (the launcher chose it from the device)
    x = torch.arange(4.0, device=device)
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN) + (
            (dist.ReduceOp.AVG,) if backend == "nccl" else ()):
        dist.all_reduce(x.clone(), op=op)
    gathered = [torch.empty_like(x)]
    dist.all_gather(gathered, x)
    out = torch.empty_like(x)
    dist.reduce_scatter_tensor(out, x)
    dist.all_gather_into_tensor(torch.empty_like(x), x)
    dist.broadcast(x, src=0)
    objs = [None]
    dist.gather_object({"a": 1}, objs, dst=0)
    box = [{"b": 2}]
    dist.broadcast_object_list(box, src=0)
    dist.barrier()
    ok = torch.equal(gathered[0], x) and torch.equal(out, x) and objs == [{"a": 1}] and box == [{"b": 2}]
    cfg = load_config("configs/tiny_taper.yaml", [
        "model.vocab_size=256", f"data.path={byte_tokens(folder)}", f"run.dir={folder}/collectives",
        "run.tensorboard=false", f"train.device={device}", "train.steps=2", "train.log_interval=1",
        "checkpoint.interval=1", "parallel.zero=fsdp2", "train.compile=false", *extra])
    code = Trainer(cfg).fit()
    saved = sorted(os.listdir(os.path.join(folder, "collectives", "checkpoints")))
    return {"backend": backend, "world_size": dist.get_world_size(), "collectives_ok": ok,
            "trainer_exit_code": code, "checkpoints": saved, "ok": ok and code == 0}


def attempt(report: dict, out: str, key: str, fn, *args, append: bool = False, **extra) -> None:
    """Run one part; record its result or its failure, then rewrite the JSON file."""
    began = time.perf_counter()
    try:
        result = {**extra, **fn(*args)}
    except Exception as e:  # noqa: BLE001 - recorded, and the next part runs
        result = {**extra, "failed": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
    result["elapsed_s"] = time.perf_counter() - began
    if append:
        report.setdefault(key, []).append(result)
    else:
        report[key] = result
    print(json.dumps({key: {k: v for k, v in result.items() if k != "traceback"}}), file=sys.stderr, flush=True)
    write(report, out)


def write(report: dict, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    Path(tmp).write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/gpu_check.json")
    parser.add_argument("--budget-s", type=float, default=450.0, help="stop starting variants after this")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="toy sizes on any device (a CPU check of the script)")
    args = parser.parse_args()
    began = time.perf_counter()
    deadline = began + args.budget_s
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("error: no CUDA device (use --smoke to exercise the script on the CPU)", file=sys.stderr)
        return 2
    device = "cuda" if cuda else "cpu"
    report: dict = {"benchmark": "gpu_check", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                    "device": torch.cuda.get_device_name() if cuda else "cpu",
                    "torch": torch.__version__, "cuda": torch.version.cuda, "smoke": args.smoke}
    if args.smoke:  # a 2-layer toy of the same recipe, 2 steps
        shape = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.mlp_width=128",
                 "model.taper.multiple=64", "model.vocab_size=512", "model.seq_len=32", "train.global_batch=2",
                 "train.micro_batch=2"]
        steps, warmup, parity_steps, small = 2, 1, 2, SMOKE_STEP
        # compile is covered by tests/parallel/test_step_engines.py; "bogus" fails on purpose
        variants = [{"activation_checkpointing": "none", "compile": False},
                    {"activation_checkpointing": "op", "compile": "auto", "float8": True, "loss_chunk": 16,
                     "float8_min_dim": 16},
                    {"activation_checkpointing": "op", "compile": False,
                     "overrides": ["model.seq_len=64", "train.global_batch=1", "train.micro_batch=1"]},
                    {"activation_checkpointing": "bogus", "compile": False}]
    else:  # global batch 8 x 2048 tokens as 2 micro-batches of 4
        shape = list(SHAPE)
        steps, warmup, parity_steps, small = args.steps, 3, 10, ()
        variants = VARIANTS + SLICE_8B_VARIANTS
    write(report, args.out)
    with tempfile.TemporaryDirectory() as folder:
        tiny = "configs/tiny_taper.yaml"
        attempt(report, args.out, "parity", parity, folder, device, parity_steps, "fp32", tiny, small)
        attempt(report, args.out, "bf16_parity", parity, folder, device, parity_steps, "bf16", tiny, small)
        attempt(report, args.out, "moe_bf16_parity", parity, folder, device, parity_steps, "bf16",
                "configs/tiny_moe_taper.yaml", small)
        attempt(report, args.out, "collectives", collectives, folder, device, small)
        vocab = load_config("configs/transformer_1.3b_taper.yaml", shape).model.vocab_size
        shape = [*shape, f"data.path={random_tokens(folder, vocab, 4_000_000)}", f"train.device={device}",
                 "train.precision=bf16" if cuda else "train.precision=fp32"]
        for variant in variants:
            label = dict(variant)
            if variant["activation_checkpointing"] == "bogus":
                label["expected_failure"] = True
            if time.perf_counter() > deadline:
                skipped = f"time budget of {args.budget_s:.0f} s spent"
                report.setdefault("throughput", []).append({**label, "skipped": skipped})
                write(report, args.out)
                continue
            attempt(report, args.out, "throughput", throughput, shape, folder, variant, steps, warmup, deadline,
                    append=True, **label)
    report["elapsed_s"] = time.perf_counter() - began
    write(report, args.out)
    json.dump(report, sys.stdout)
    print()
    failed = [r for r in report.get("throughput", []) if "failed" in r and not r.get("expected_failure")]
    ok = all(report[part].get("ok") for part in ("parity", "bf16_parity", "moe_bf16_parity", "collectives")) \
        and not failed
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
