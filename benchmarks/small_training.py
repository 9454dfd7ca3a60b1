"""The training loop the in-process benchmarks share (benchmarks/recall.py, titans_memory_use.py):
AdamW without weight decay, linear warmup then cosine to 0 over `steps`, gradient clipping at 1."""
from __future__ import annotations

import json
import math
import sys
import time
from typing import Callable

import torch


def train_small(model: torch.nn.Module, lr: float, steps: int, warmup: int, next_loss: Callable[[int], torch.Tensor],
                log_every: int = 0, should_stop: Callable[[int, list[float]], bool] | None = None) -> list[float]:
    """Trains `model` for `steps` steps on next_loss(step) (one batch's loss), or until
    should_stop(step, losses so far) after a step says so; the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    start, losses = time.perf_counter(), []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        loss = next_loss(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if log_every and step % log_every == 0:
            print(json.dumps({"step": step, "loss": round(losses[-1], 4), "s": round(time.perf_counter() - start)}),
                  file=sys.stderr, flush=True)
        if should_stop is not None and should_stop(step, losses):
            break
    return losses
