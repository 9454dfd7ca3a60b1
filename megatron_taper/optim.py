"""The optimizer every engine starts from: AdamW with decoupled weight decay on matrices only."""
from __future__ import annotations

import torch
from torch import nn

from megatron_taper.config import Config


def build_optimizer(module: nn.Module, cfg: Config, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices and embeddings, not on norms and biases."""
    decay = [p for p in module.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.train.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    t = cfg.train
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                             fused=device.type in ("cuda", "cpu"))
