"""Tokens/s of the Trainer's step against a bare PyTorch loop over the same model and batches,
and the Trainer's step before / after removing its per-step host syncs, side by side.

All run in this process, alternating in rounds so that machine noise hits all alike; prints one
JSON object with the median tokens/s of each, their ratio (target >= 0.97), and host reads of
device values per step (Tensor.item / float / int / bool, counted by wrapping them: each one is a
device sync on CUDA). "before" is the Trainer with the loop of the previous version restored
(`SyncingTrainer`: float(loss) and float(norm) every step, the stop flag read every step, batches
drawn on the training thread); "after" is the Trainer as it is (reads at log intervals only,
batches prefetched by a background thread).

    python benchmarks/trainer_overhead.py [--steps 20] [--rounds 3] [--data-delay-ms 0] [key=value ...]

--data-delay-ms D makes every batch of the training source take D ms more to draw (a slow
filesystem or object store standing in: `SlowSource`), for both Trainers (the bare loop's
batches are drawn before it is timed); with the prefetch thread, a step no longer waits for it
once the delay per step is below the step's compute.
"""
from __future__ import annotations

import argparse
import json
import math
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
from megatron_taper.training.held_out import dp_mean
from megatron_taper.training.optim import build_optimizer, lr_at
from megatron_taper.training.trainer import Trainer


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


class SyncingTrainer(Trainer):
    """The step as it was before: batches drawn inline, loss, norm and the stop flag read on the
    host every step."""

    def train_step(self) -> dict:
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, self.cfg.train)
        micro_batches = [self.train_source.next_batch() for _ in range(self.accum)]
        loss = dp_mean(self.ctx, self.pm.forward_backward(micro_batches, self.autocast))
        loss_value = float(loss)
        grad_norm, stepped = self.pm.optimizer_step(self.optimizer, self.cfg.train.grad_clip,
                                                    math.isfinite(loss_value))
        norm_value = float(grad_norm)
        self.recovery.health.update(stepped, self.step + 1, self.cfg.train.max_nonfinite)
        self.recovery.health.breach_step()
        self.state.advance(self.cfg.train.global_batch * self.cfg.model.seq_len)
        bool(torch.tensor([1.0 if self.stop.received else 0.0]).item())  # the stop flag, read every step
        return {"loss": loss_value, "grad_norm": norm_value}


class SlowSource:
    """A training source whose every batch takes `delay_s` more (a slow remote source)."""

    def __init__(self, source, delay_s: float):
        self.source, self.delay_s = source, delay_s

    def next_batch(self):
        time.sleep(self.delay_s)
        return self.source.next_batch()

    def __getattr__(self, name):
        return getattr(self.source, name)


class HostReads:
    """Counts host reads of tensor values (Tensor.item / __float__ / __int__ / __bool__)."""

    NAMES = ("item", "__float__", "__int__", "__bool__")

    def __init__(self):
        self.count = 0

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}
        for name, fn in self.saved.items():
            setattr(torch.Tensor, name, self._counting(fn))
        return self

    def _counting(self, fn):
        def wrapper(t, *a, **k):
            self.count += 1
            return fn(t, *a, **k)
        return wrapper

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(torch.Tensor, name, fn)


def trainer_loop(cfg, steps: int, cls=Trainer, delay_s: float = 0.0) -> tuple[float, float]:
    """Seconds for `steps` steps as fit() runs them (a log read every train.log_interval), and
    host reads per step."""
    trainer = cls(cfg)
    if delay_s:
        trainer.train_source = SlowSource(trainer.train_source, delay_s)
    trainer.train_step()  # warm-up (and the prefetch thread started)
    start = time.perf_counter()
    with HostReads() as reads:
        for _ in range(steps):
            record = trainer.train_step()
            trainer.stop_vote.at_step_end(trainer.step)
            if trainer.step % cfg.train.log_interval == 0:
                trainer.recovery.check_health()
                _ = {k: float(v) for k, v in record.items() if isinstance(v, (torch.Tensor, float))}
    elapsed = time.perf_counter() - start
    trainer.close()
    return elapsed, reads.count / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data-delay-ms", type=float, default=0.0)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        overrides = ["model.vocab_size=256", f"data.path={token_file(tmp)}", f"run.dir={tmp}/run",
                     "run.tensorboard=false", "train.device=cpu", "train.precision=fp32", *args.overrides]
        cfg = load_config("configs/tiny_taper.yaml", overrides)
        probe = Trainer(cfg)
        batches = [[probe.train_source.next_batch() for _ in range(probe.accum)] for _ in range(args.steps)]
        probe.close()  # (fit closes it; these Trainers never fit)
        tokens = args.steps * cfg.train.global_batch * cfg.model.seq_len
        bare_loop(cfg, batches[:2])  # warm-up
        bare, ours, before = [], [], []
        for _ in range(args.rounds):
            bare.append(tokens / bare_loop(cfg, batches))
            delay = args.data_delay_ms / 1000
            seconds, reads_before = trainer_loop(cfg, args.steps, SyncingTrainer, delay)
            before.append(tokens / seconds)
            seconds, reads_after = trainer_loop(cfg, args.steps, Trainer, delay)
            ours.append(tokens / seconds)
    result = {
        "benchmark": "trainer_overhead",
        "config": "configs/tiny_taper.yaml",
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "bare_tokens_per_s": statistics.median(bare),
        "trainer_tokens_per_s": statistics.median(ours),
        "ratio": statistics.median(ours) / statistics.median(bare),
        "before_syncing_trainer_tokens_per_s": statistics.median(before),
        "before_ratio": statistics.median(before) / statistics.median(bare),
        "log_interval": cfg.train.log_interval,
        "data_delay_ms_per_batch": args.data_delay_ms,
        "batches_per_step": cfg.train.global_batch // cfg.train.micro_batch,
        "host_reads_per_step_before": reads_before,
        "host_reads_per_step_after": reads_after,
        "target_ratio": 0.97,
    }
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
