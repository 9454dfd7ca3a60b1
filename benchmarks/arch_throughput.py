"""Training throughput of each family's tiny recipe, one process, side by side; prints JSON.

    python benchmarks/arch_throughput.py [--steps 10] [--warmup 2] [--threads N] [--device cpu]
        [--config configs/tiny_titans.yaml ...] [key=value ...]

Each step is forward + backward + AdamW on one micro-batch (`train.micro_batch` x
`model.seq_len` random tokens) of the recipe; tokens/s is the median over the timed steps.
`model_tflops` is 3 x the cost model's forward FLOPs per token x tokens/s.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from megatron_taper.config import load_config
from megatron_taper.flops import model_costs
from megatron_taper.models import build_model
from megatron_taper.models.layers import cross_entropy

RECIPES = ["configs/tiny_taper.yaml", "configs/tiny_gated_attention.yaml", "configs/tiny_titans.yaml",
           "configs/tiny_hope_attention.yaml"]


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
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    tokens_per_s = mb * m.seq_len / step_s
    flops = model_costs(m).total_flops
    return {"arch": m.arch, "recipe": path, "params": sum(p.numel() for p in model.parameters()),
            "fwd_flops_per_token": flops, "step_s": round(step_s, 4), "tokens_per_s": round(tokens_per_s, 1),
            "model_tflops": round(3 * flops * tokens_per_s / 1e12, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", help="recipes to measure (default: the four tiny ones)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("overrides", nargs="*", help="key=value applied to every recipe")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    results = [measure(p, args.overrides, args.steps, args.warmup, device) for p in args.config or RECIPES]
    print(json.dumps({"device": str(device), "threads": torch.get_num_threads(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
