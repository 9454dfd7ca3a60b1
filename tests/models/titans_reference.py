"""Titans' neural memory as the paper writes it: the token-by-token recurrence with autograd
gradients (torch.func). The oracle the chunked form in megatron_taper/models/titans.py is tested
against; test code only."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_taper.models.titans import NeuralMemory, State


def reference_scan(memory: NeuralMemory, x_kv: torch.Tensor, x_q: torch.Tensor,
                   state: State) -> tuple[torch.Tensor, State]:
    """Token-by-token recurrence with autograd gradients (torch.func), for tests: ([B, H, T, E], state)."""
    from torch.func import grad, vmap

    def mlp(ws: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        for layer, w in enumerate(ws):
            x = x @ w
            x = F.silu(x) if layer < len(ws) - 1 else x
        return x

    def loss(ws: list[torch.Tensor], key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return ((mlp(ws, key) - value) ** 2).sum()

    per_head_grad, per_head_read = vmap(vmap(grad(loss))), vmap(vmap(mlp))
    k, v, q, theta, log_eta, log_keep = memory.project(x_kv, x_q)
    weights, surprise = list(state[0]), list(state[1])
    reads = []
    for t in range(k.shape[2]):
        grads = per_head_grad(weights, k[:, :, t], v[:, :, t])
        eta, keep, lr = (z[:, :, t, None, None] for z in (log_eta.exp(), log_keep.exp(), theta))
        surprise = [eta * s - lr * g for s, g in zip(surprise, grads)]
        weights = [keep * w + s for w, s in zip(weights, surprise)]
        reads.append(per_head_read(weights, q[:, :, t]))
    return torch.stack(reads, dim=2), (weights, surprise)


