"""Training throughput of each family's tiny recipe, one process, side by side; prints JSON.

    python benchmarks/arch_throughput.py [--steps 10] [--warmup 2] [--threads N] [--device cpu]
        [--config configs/tiny_titans.yaml ...] [key=value ...]

Each step is forward + backward + AdamW on one micro-batch (`train.micro_batch` x
`model.seq_len` random tokens) of the recipe; tokens/s is the median over the timed steps.
`model_tflops` is 3 x the cost model's forward FLOPs per token x tokens/s.

    python benchmarks/arch_throughput.py --titans-window [--seqs 512,2048] [--window 64] [--steps 6]
        [--device cpu] [key=value ...]

Titans' sliding-window attention before and after the banded kernels (configs/tiny_titans.yaml,
micro-batch 2 unless overridden, model.titans.window=W): `dense` runs every block's attention
under one [S, P + S] mask (the path of before, kept here as a benchmark-local reference), `banded`
the kernel the model runs (models/local_attention.py: blockwise on CPU, FlexAttention on CUDA).
Tokens/s: both variants built from the same weights in one process, their steps alternating,
median per variant; `attention_only`: forward + backward of the attention alone, alternating
the same way. Peak memory: a fresh process per variant (MALLOC_MMAP_THRESHOLD_=65536 so freed
tensors go back to the system) runs one step, then resets the high-water mark (`echo 5 >
/proc/self/clear_refs`) and runs another: `peak_mib` is VmHWM then, `step_mib` that minus the
resident memory before the step; on CUDA torch.cuda.max_memory_allocated around the step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from megatron_taper.config import load_config
from megatron_taper.cost.flops import model_costs
from megatron_taper.models import build_model
from megatron_taper.models.layers import cross_entropy

TITANS_RECIPE = "configs/tiny_titans.yaml"
MIB = 2**20


def tiny_recipes() -> list[str]:
    """Every registered family's tiny recipe (gpu_families.family_recipes), in the registry's order."""
    from megatron_taper.models import cards

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_families import family_recipes

    tiny = family_recipes("configs", tiny=True)  # relative to the working directory, as --config is
    return [f"configs/{tiny[arch]}.yaml" for arch in cards() if arch in tiny]


def train_step(model, opt, tokens: torch.Tensor) -> None:
    cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(path: str, overrides: list[str], steps: int, warmup: int, device: torch.device) -> dict:
    cfg = load_config(path, overrides)
    m, mb = cfg.model, cfg.train.micro_batch
    model = build_model(m).to(device)
    model.init_weights(cfg.train.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, m.vocab_size, (mb, m.seq_len + 1), generator=gen).to(device)
    times = []
    for step in range(warmup + steps):
        elapsed = timed_step(model, opt, tokens, device)
        if step >= warmup:
            times.append(elapsed)
    step_s = statistics.median(times)
    tokens_per_s = mb * m.seq_len / step_s
    flops = model_costs(m).total_flops
    return {"arch": m.arch, "recipe": path, "params": sum(p.numel() for p in model.parameters()),
            "fwd_flops_per_token": flops, "step_s": round(step_s, 4), "tokens_per_s": round(tokens_per_s, 1),
            "model_tflops": round(3 * flops * tokens_per_s / 1e12, 4)}


def dense_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
                           window: int) -> torch.Tensor:
    """The attention of before: one dense [S, P + S] mask, O(S^2) work and memory."""
    i = torch.arange(q.shape[2], device=q.device)[:, None]
    j = torch.arange(k.shape[2], device=q.device)[None, :] - prefix
    mask = (j < 0) | ((i - j >= 0) & (i - j < window))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def titans_setup(seq: int, window: int, overrides: list[str], kernel: str, device: torch.device):
    """(model, optimizer, tokens, cfg) of the tiny Titans recipe at `seq` with `kernel` attention."""
    cfg = load_config(TITANS_RECIPE, ["train.micro_batch=2", *overrides, f"model.seq_len={seq}",
                                      f"model.titans.window={window}"])
    model = build_model(cfg.model).to(device)
    model.init_weights(cfg.train.seed)
    if kernel == "dense":
        for block in model.layers.values():
            block.window_kernel = dense_window_attention
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, seq + 1), generator=gen).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), tokens, cfg


def timed_step(model, opt, tokens: torch.Tensor, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    train_step(model, opt, tokens)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def titans_throughput(seq: int, window: int, overrides: list[str], steps: int, device: torch.device) -> dict:
    """Median step time of the dense and banded variants, their steps alternating in this process."""
    runs = {kernel: titans_setup(seq, window, overrides, kernel, device) for kernel in ("dense", "banded")}
    times: dict[str, list[float]] = {kernel: [] for kernel in runs}
    for step in range(steps + 1):  # the first step of each is a warm-up
        for kernel, (model, opt, tokens, _) in runs.items():
            elapsed = timed_step(model, opt, tokens, device)
            if step:
                times[kernel].append(elapsed)
    cfg = runs["banded"][3]
    tokens_per_step = cfg.train.micro_batch * seq
    return {kernel: {"step_s": round(statistics.median(t), 4),
                     "tokens_per_s": round(tokens_per_step / statistics.median(t), 1)} for kernel, t in times.items()}


def proc_status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024 / MIB
    raise RuntimeError(f"no {key} in /proc/self/status")


def peak_worker(seq: int, window: int, overrides: list[str], kernel: str, device: torch.device) -> dict:
    """One warm-up step, then the peak memory of the next step (see the module docstring)."""
    model, opt, tokens, _ = titans_setup(seq, window, overrides, kernel, device)
    train_step(model, opt, tokens)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) / MIB
        train_step(model, opt, tokens)
        peak = torch.cuda.max_memory_allocated(device) / MIB
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = proc_status_mib("VmRSS")
        train_step(model, opt, tokens)
        peak = proc_status_mib("VmHWM")
    return {"peak_mib": round(peak, 1), "step_mib": round(peak - before, 1)}


def titans_peak(seq: int, window: int, overrides: list[str], kernel: str, device: torch.device) -> dict:
    """peak_worker in a fresh process."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, __file__, "--peak-worker", kernel, "--seqs", str(seq), "--window", str(window),
           "--device", str(device), "--threads", str(torch.get_num_threads()), *overrides]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def attention_timing(seq: int, window: int, overrides: list[str], device: torch.device, reps: int = 5) -> dict:
    """Forward + backward of the attention alone at the recipe's shapes (micro-batch, heads,
    head_dim, persistent tokens), dense and banded alternating: median ms."""
    from megatron_taper.models.local_attention import sliding_window_attention

    cfg = load_config(TITANS_RECIPE, ["train.micro_batch=2", *overrides])
    m, batch, gen = cfg.model, cfg.train.micro_batch, torch.Generator().manual_seed(0)
    prefix = m.titans.persistent_tokens
    q = torch.randn(batch, m.n_heads, seq, m.head_dim, generator=gen).to(device).requires_grad_()
    k, v = (torch.randn(batch, m.kv_heads, prefix + seq, m.head_dim, generator=gen).to(device).requires_grad_()
            for _ in range(2))
    kernels = {"dense": dense_window_attention, "banded": sliding_window_attention}
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for rep in range(reps + 1):  # the first of each is a warm-up
        for name, kernel in kernels.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            kernel(q, k, v, prefix, window).sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if rep:
                times[name].append(time.perf_counter() - start)
    return {name: round(1e3 * statistics.median(t), 2) for name, t in times.items()}


def titans_window(seqs: list[int], window: int, overrides: list[str], steps: int, device: torch.device) -> dict:
    attention = [{"seq": seq, "fwd_bwd_ms": attention_timing(seq, window, overrides, device)} for seq in seqs]
    print(json.dumps(attention), file=sys.stderr, flush=True)  # progress
    results = []
    for seq in seqs:
        speed = titans_throughput(seq, window, overrides, steps, device)
        for kernel in ("dense", "banded"):
            results.append({"seq": seq, "kernel": kernel, **speed[kernel],
                            **titans_peak(seq, window, overrides, kernel, device)})
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)  # progress
    return {"recipe": TITANS_RECIPE, "window": window, "overrides": overrides, "attention_only": attention,
            "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", help="recipes to measure (default: the four tiny ones)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--titans-window", action="store_true", help="Titans' dense vs banded window attention")
    parser.add_argument("--seqs", default="512,2048", help="sequence lengths of --titans-window")
    parser.add_argument("--window", type=int, default=64, help="model.titans.window of --titans-window")
    parser.add_argument("--peak-worker", choices=["dense", "banded"], help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="key=value applied to every recipe")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    seqs = [int(s) for s in args.seqs.split(",")]
    if args.peak_worker:
        print(json.dumps(peak_worker(seqs[0], args.window, args.overrides, args.peak_worker, device)))
        return
    head = {"device": str(device), "threads": torch.get_num_threads()}
    if args.titans_window:
        print(json.dumps({**head, **titans_window(seqs, args.window, args.overrides, args.steps, device)}, indent=1))
        return
    results = [measure(p, args.overrides, args.steps, args.warmup, device) for p in args.config or tiny_recipes()]
    print(json.dumps({**head, "results": results}, indent=1))


if __name__ == "__main__":
    main()
