"""Tokens/s of the Trainer's step against a bare PyTorch loop over the same model and batches.

Both run in this process, alternating in rounds so that machine noise hits both alike; prints
one JSON object with the median tokens/s of each and their ratio (target >= 0.97).

    python benchmarks/trainer_overhead.py [--steps 20] [--rounds 3] [key=value ...]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from megatron_taper.config import load_config
from megatron_taper.data.corpus import embedded_files
from megatron_taper.models import build_model
from megatron_taper.models.layers import cross_entropy
from megatron_taper.optim import build_optimizer
from megatron_taper.trainer import Trainer


def token_file(folder: str) -> str:
    data = b"".join(Path(p).read_bytes() for p in embedded_files(1_500_000))
    path = Path(folder) / "tokens.npy"
    np.save(path, np.frombuffer(data, dtype=np.uint8).astype(np.uint16))
    return str(path)


def bare_loop(cfg, batches: list[list[torch.Tensor]]) -> float:
    model = build_model(cfg.model)
    model.init_weights(cfg.train.seed)
    optimizer = build_optimizer(model, cfg.train, torch.device("cpu"))
    start = time.perf_counter()
    for micro_batches in batches:
        for tokens in micro_batches:
            loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
            (loss / len(micro_batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def trainer_loop(cfg, steps: int) -> float:
    trainer = Trainer(cfg)
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    elapsed = time.perf_counter() - start
    trainer.metrics.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        overrides = ["model.vocab_size=256", f"data.path={token_file(tmp)}", f"run.dir={tmp}/run",
                     "run.tensorboard=false", "train.device=cpu", "train.precision=fp32", *args.overrides]
        cfg = load_config("configs/tiny_taper.yaml", overrides)
        probe = Trainer(cfg)
        batches = [[probe.train_source.next_batch() for _ in range(probe.accum)] for _ in range(args.steps)]
        probe.metrics.close()
        tokens = args.steps * cfg.train.global_batch * cfg.model.seq_len
        bare_loop(cfg, batches[:2])  # warm-up
        bare, ours = [], []
        for _ in range(args.rounds):
            bare.append(tokens / bare_loop(cfg, batches))
            ours.append(tokens / trainer_loop(cfg, args.steps))
    result = {
        "benchmark": "trainer_overhead",
        "config": "configs/tiny_taper.yaml",
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "bare_tokens_per_s": statistics.median(bare),
        "trainer_tokens_per_s": statistics.median(ours),
        "ratio": statistics.median(ours) / statistics.median(bare),
        "target_ratio": 0.97,
    }
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
