"""Tensor-parallel communication per training step: counted on a real run vs the Megatron formula.

    python benchmarks/tp_comm.py [--tp 2] [--steps 5] [--config configs/tiny_taper.yaml] [key=value ...]

Re-launches itself under torchrun with `--tp` processes (gloo on CPU, NCCL on GPUs), builds the
recipe's model with parallel.tp (train.precision=fp32 unless overridden, e.g.
train.precision=bf16), and runs one optimizer step's forward_backward (train.global_batch /
train.micro_batch micro-batches of random tokens) + reduce_gradients + clip_gradients under a
dispatch mode that records every c10d collective. Then `--steps` more such steps (no optimizer
update) timed and measured for peak memory. Prints one JSON object (rank 0):

  measured[op] = {"calls", "bytes", "bytes_by_dtype"}: bytes of the full-size buffer of each
      call (all-reduce: the reduced tensor; all-gather: the gathered output; reduce-scatter:
      the input), also split by the dtype the collective moved
  analytic: the same per-step counts from the shapes, after Megatron (Shoeybi et al. 2019;
      Korthikanti et al. 2022): per layer and micro-batch 4 all-reduces of B x S x D activations
      (2 forward: after attention and after the MLP; 2 backward: their inputs), plus one for the
      vocab-parallel embedding (forward) and one for the LM head input (backward), plus the
      vocab-parallel loss statistics (3 x B x S fp32) and the clipping norm (one fp32 scalar).
      With sequence parallelism each all-reduce becomes a reduce-scatter + an all-gather of the
      same size, and the norm weights' gradients are summed once per step. Activations move in
      the compute dtype (bf16 under autocast: the matmuls' outputs and inputs, docs/precision.md)
      except the embedding's (fp32, forward; and its gradient's all-gather under SP).
  ring_bytes_per_rank: what a ring algorithm sends per rank (all-reduce 2 (tp-1)/tp x bytes,
      all-gather / reduce-scatter (tp-1)/tp x bytes).
  step_seconds (and _min): median (fastest) wall time of the timed steps (forward_backward + reduce_gradients +
      clip_gradients; every rank waits at a barrier before each), and each step's time;
      step_cpu_seconds: the median CPU time rank 0's process spent in a step (all its threads,
      gloo's included), steadier than wall time on a loaded machine.
  peak_bytes: rank 0's peak memory over the timed steps minus the memory in use before them
      (benchmarks/activation_memory.py's PeakMeter: host RSS high-water mark on CPU, with
      MALLOC_MMAP_THRESHOLD_=65536 so that freed tensors return to the OS; max_memory_allocated
      on CUDA).
  region_seconds: {"f", "g"} (and "f_min", "g_min"): median (fastest) seconds of forward +
      backward of the tp region ops alone on one micro-batch's activations (`region_seconds`),
      20 x --steps repetitions each.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_taper.config import load_config
from megatron_taper.cost.preflight import preflight
from megatron_taper.parallel.context import init_parallel, shutdown, world_size
from megatron_taper.taper import layer_widths
from megatron_taper.training.build import build_run

KINDS = {  # c10d dispatcher op -> (kind, index of the full-size tensor argument)
    "allreduce_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "alltoall_base_": ("all_to_all", 0),
}


class CollectiveCounter(TorchDispatchMode):
    """Counts calls and buffer bytes of c10d collectives issued while active."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.by_dtype: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func._schema.name.split("::")[-1]
            if name in KINDS:
                kind, idx = KINDS[name]
                self.calls[kind] += 1
                self.bytes[kind] += _nbytes(args[idx])
                self.by_dtype[kind][_dtype(args[idx])] += _nbytes(args[idx])
            elif name not in ("barrier", "monitored_barrier_"):
                self.calls[f"other:{name}"] += 1
        return func(*args, **(kwargs or {}))


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(t) for t in x)  # lists (of lists) of tensors


def _dtype(x) -> str:
    return str(x.dtype).removeprefix("torch.") if isinstance(x, torch.Tensor) else _dtype(x[0])


def analytic(cfg, micro_batches: int, act_bytes: int) -> dict:
    """Per-step counts from the shapes (module doc); `act_bytes` per activation element in the
    compute dtype, the embedding's output 4 (fp32)."""
    m, p = cfg.model, cfg.parallel
    b, s, d, n = cfg.train.micro_batch, m.seq_len, m.d_model, m.n_layers
    act = b * s * d
    embedding = act * 4
    loss_stats = 3 * b * s * 4  # max [B*S] + (sum-exp, target logit) [2, B*S], fp32
    if not p.sequence_parallel:
        # 4 per layer + LM-head input (bwd) in the compute dtype, the embedding's output (fwd) fp32
        per_micro = (4 * n + 1) * act * act_bytes + embedding
        return {"all_reduce": {"calls": micro_batches * (4 * n + 2 + 2) + 1,
                               "bytes": micro_batches * (per_micro + loss_stats) + 4}}
    # each direction: 2 per layer + the LM-head input (gather fwd / reduce-scatter bwd) or the
    # embedding (reduce-scatter fwd / gather of its gradient bwd, fp32)
    per_micro = (4 * n + 1) * act * act_bytes + embedding
    norm_grads = (2 * n + 1) * d * 4  # attn_norm, mlp_norm per layer, final norm (fp32 weights)
    return {
        "all_gather": {"calls": micro_batches * (4 * n + 2), "bytes": micro_batches * per_micro},
        "reduce_scatter": {"calls": micro_batches * (4 * n + 2), "bytes": micro_batches * per_micro},
        "all_reduce": {"calls": micro_batches * 2 + 2, "bytes": micro_batches * loss_stats + norm_grads + 4},
    }


def ring(kind: str, nbytes: int, tp: int) -> float:
    return nbytes * (2 if kind == "all_reduce" else 1) * (tp - 1) / tp


def region_seconds(ctx, cfg, autocast, dtype: torch.dtype, reps: int) -> dict:
    """Median seconds of forward + backward of the region ops alone, on one micro-batch's
    [b, S, d] activations: f (`enter_tp_region` of the fp32 norm output: identity / all-gather
    forward, all-reduce / reduce-scatter of its gradient) and g (sum of a partial output in the
    compute dtype: all-reduce / reduce-scatter forward, identity / all-gather backward)."""
    from megatron_taper.parallel.tp import layers as tensor

    sp, group = cfg.parallel.sequence_parallel, ctx.tp_group
    b, s, d = cfg.train.micro_batch, cfg.model.seq_len, cfg.model.d_model
    x = torch.randn(b, s // ctx.tp if sp else s, d, device=ctx.device, requires_grad=True)
    exit_op = tensor.reduce_scatter_to_seq_region if sp else tensor.reduce_from_tp_region

    def enter():
        with autocast():
            y = tensor.enter_tp_region(x, group, sp)
        y.backward(torch.ones_like(y))

    def leave():
        with autocast():
            partial = torch.ones((b, s, d), device=ctx.device, dtype=dtype).requires_grad_()
            y = exit_op(partial * 1.0, group)
        y.backward(torch.ones_like(y))

    out = {}
    for name, fn in (("f", enter), ("g", leave)):
        fn()
        times = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            fn()
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        out[name], out[f"{name}_min"] = statistics.median(times), min(times)
    return out


def run(config: str, overrides: list[str], steps: int) -> dict:
    from activation_memory import PeakMeter  # benchmarks/ is the script's folder

    cfg = load_config(config, overrides)
    preflight(cfg, world_size())
    ctx = init_parallel(cfg.parallel, cfg.train.device)
    try:
        meter = PeakMeter(ctx.device)
        built = build_run(cfg, ctx)
        pm = built.model
        autocast = (lambda: torch.autocast(ctx.device.type, dtype=torch.bfloat16)) if built.bf16 \
            else contextlib.nullcontext
        micro = cfg.train.global_batch // cfg.train.micro_batch
        gen = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.model.seq_len + 1),
                                 generator=gen) for _ in range(micro)]

        def step():
            pm.forward_backward(batches, autocast)
            pm.reduce_gradients()
            pm.clip_gradients(cfg.train.grad_clip)

        counter = CollectiveCounter()
        with counter:
            step()
        before = meter.reset()
        times, cpu = [], []
        for _ in range(steps):
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            step()
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        peak = meter.peak() - before
        compute_dtype = torch.bfloat16 if built.bf16 else torch.float32
        regions = region_seconds(ctx, cfg, autocast, compute_dtype, reps=20 * steps)
        measured = {k: {"calls": counter.calls[k], "bytes": counter.bytes.get(k, 0),
                        "bytes_by_dtype": dict(counter.by_dtype.get(k, {}))} for k in sorted(counter.calls)}
        expected = analytic(cfg, micro, torch.finfo(compute_dtype).bits // 8)
        tp = ctx.tp
        total_measured = sum(v["bytes"] for v in measured.values())
        total_expected = sum(v["bytes"] for v in expected.values())
        return {
            "tp": tp,
            "sequence_parallel": cfg.parallel.sequence_parallel,
            "model": {"n_layers": cfg.model.n_layers, "d_model": cfg.model.d_model, "n_heads": cfg.model.n_heads,
                      "n_kv_heads": cfg.model.kv_heads, "vocab_size": cfg.model.vocab_size,
                      "mlp_widths": layer_widths(cfg.model)},
            "micro_batch": cfg.train.micro_batch, "seq_len": cfg.model.seq_len, "micro_batches_per_step": micro,
            "compute_dtype": str(compute_dtype).removeprefix("torch."),
            "device": str(ctx.device),
            "measured": measured,
            "analytic": expected,
            "measured_bytes_total": total_measured,
            "analytic_bytes_total": total_expected,
            "measured_over_analytic": total_measured / total_expected,
            "ring_bytes_per_rank": sum(ring(k, v["bytes"], tp) for k, v in measured.items() if k in expected),
            "step_seconds": statistics.median(times) if times else None,
            "step_seconds_min": min(times) if times else None,
            "step_seconds_each": times,
            "step_cpu_seconds": statistics.median(cpu) if cpu else None,
            "peak_bytes": peak,
            "region_seconds": regions,
        }
    finally:
        shutdown(ctx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps after the counted one")
    parser.add_argument("--config", default="configs/tiny_taper.yaml")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if "WORLD_SIZE" not in os.environ:
        from activation_memory import MMAP_THRESHOLD

        cmd = [sys.executable, "-m", "megatron_taper.torchrun", "--standalone", "--nproc-per-node", str(args.tp),
               __file__, "--tp", str(args.tp), "--steps", str(args.steps), "--config", args.config, *args.overrides]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}
        sys.exit(subprocess.run(cmd, env=env).returncode)
    result = run(args.config, [f"parallel.tp={args.tp}", "train.precision=fp32", *args.overrides], args.steps)
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
