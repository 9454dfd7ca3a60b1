"""The optimizer every engine starts from (AdamW, decoupled weight decay on matrices only) and
its learning-rate schedule (linear warmup, then cosine decay)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from megatron_taper.config import TrainConfig


def build_optimizer(module: nn.Module, train: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices and embeddings, not on norms and biases. Each group holds
    one kind of tensor, plain or DTensor of one mesh (a fused step takes one kind at a time; expert
    parallelism under fsdp2 keeps experts plain or sharded over another mesh: parallel/ep.py)."""
    by_kind: dict[tuple[bool, int], list[nn.Parameter]] = {}
    for p in module.parameters():
        if p.requires_grad:
            by_kind.setdefault((p.dim() < 2, id(getattr(p, "device_mesh", None))), []).append(p)
    groups = [{"params": params, "weight_decay": 0.0 if no_decay else train.weight_decay}
              for (no_decay, _), params in sorted(by_kind.items(), key=lambda item: item[0][0])]
    return torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps,
                             fused=device.type in ("cuda", "cpu"))


def lr_at(step: int, train: TrainConfig) -> float:
    """Learning rate of (0-based) step: linear warmup, then cosine decay to lr * min_lr_ratio."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    span = max(1, train.steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / span)
    return train.lr * (train.min_lr_ratio + (1 - train.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
