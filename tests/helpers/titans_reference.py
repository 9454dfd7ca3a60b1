"""Titans' neural memory as the paper writes it: the token-by-token recurrence with autograd
gradients (torch.func), its inputs projected token by token (the depthwise causal convolution as
an explicit sum over each token's last K projected inputs), and sliding-window attention under a
dense [S, P + S] mask. The oracles the chunked memory and the banded attention kernels in
megatron_taper/models/ are tested against; test code only."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taper.models.titans import NeuralMemory, State


def reference_heads(memory: NeuralMemory, proj: nn.Linear, conv: torch.Tensor | None,
                    x: torch.Tensor) -> torch.Tensor:
    """l2norm(silu(conv(proj x))) token by token, with z_t = sum_j conv[:, K-1-j] * (proj x)_{t-j}
    over j < K and t - j >= 0: [B, H, T, E]."""
    p = proj(x)  # [B, T, H*E]
    if conv is None:
        z = p
    else:
        taps = conv.shape[1]
        z = torch.stack([sum(conv[:, taps - 1 - j] * p[:, t - j] for j in range(min(taps, t + 1)))
                         for t in range(p.shape[1])], dim=1)
    return F.normalize(F.silu(z).unflatten(-1, (-1, memory.head_dim)).transpose(1, 2), dim=-1)


def reference_features(memory: NeuralMemory, x_kv: torch.Tensor, x_q: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """k, v, q [B, H, T, E] and theta, eta, 1 - alpha [B, H, T], written out from the parameters."""
    k = reference_heads(memory, memory.wk, memory.conv_k, x_kv)
    v = reference_heads(memory, memory.wv, memory.conv_v, x_kv)
    q = reference_heads(memory, memory.wq, memory.conv_q, x_q)
    g = memory.gates(x_kv).unflatten(-1, (-1, 3)).transpose(1, 2)  # [B, H, T, 3]
    theta = memory.max_lr * torch.sigmoid(g[..., 0])
    eta = torch.sigmoid(g[..., 1] + memory.eta_offset)
    keep = 1 - torch.sigmoid(g[..., 2] + memory.alpha_offset)
    return k, v, q, theta, eta, keep


def reference_scan(memory: NeuralMemory, x_kv: torch.Tensor, x_q: torch.Tensor,
                   state: State) -> tuple[torch.Tensor, State]:
    """Token-by-token recurrence with autograd gradients (torch.func), for tests: ([B, H, T, E], state).
    Per token: M(x) = x + f(x); g = grad ||M(k) - v||^2 at the current weights; nu = the summed
    squared norms of every layer's input; S = eta S - (theta / nu) g; W = W_0 + (1 - alpha)(W - W_0) + S;
    read M(q) with the new weights."""
    from torch.func import grad, vmap

    def mlp(ws: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        for layer, w in enumerate(ws):
            x = x @ w
            x = F.silu(x) if layer < len(ws) - 1 else x
        return x

    def layer_inputs(ws: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        total = x.square().sum()
        for w in ws[:-1]:
            x = F.silu(x @ w)
            total = total + x.square().sum()
        return total

    def loss(ws: list[torch.Tensor], key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return ((key + mlp(ws, key) - value) ** 2).sum()

    per_head_grad, per_head_read = vmap(vmap(grad(loss))), vmap(vmap(lambda ws, x: x + mlp(ws, x)))
    per_head_nu = vmap(vmap(layer_inputs))
    k, v, q, theta, eta, keep = reference_features(memory, x_kv, x_q)
    weights, surprise = list(state[0]), list(state[1])
    initial = [w.to(k.dtype) for w in memory.mem_w]
    reads = []
    for t in range(k.shape[2]):
        grads = per_head_grad(weights, k[:, :, t], v[:, :, t])
        nu = per_head_nu(weights, k[:, :, t])
        eta_t, keep_t, lr = (z[:, :, None, None] for z in (eta[:, :, t], keep[:, :, t], theta[:, :, t] / nu))
        surprise = [eta_t * s - lr * g for s, g in zip(surprise, grads)]
        weights = [w0 + keep_t * (w - w0) + s for w0, w, s in zip(initial, weights, surprise)]
        reads.append(per_head_read(weights, q[:, :, t]))
    return torch.stack(reads, dim=2), (weights, surprise)


def dense_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
                           window: int) -> torch.Tensor:
    """Sliding-window attention under one dense [S, P + S] mask (the O(S^2) form the kernels in
    megatron_taper/models/local_attention.py replace): q [B, H, S, E], k, v [B, K, P + S, E]."""
    i = torch.arange(q.shape[2], device=q.device)[:, None]
    j = torch.arange(k.shape[2], device=q.device)[None, :] - prefix
    mask = (j < 0) | ((i - j >= 0) & (i - j < window))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
