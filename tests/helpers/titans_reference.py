"""Titans' neural memory as the paper writes it: the token-by-token recurrence with autograd
gradients (torch.func), its inputs projected token by token (the depthwise causal convolution as
an explicit sum over each token's last K projected inputs), and sliding-window attention under a
dense [S, P + S] mask. The oracles the chunked memory and the banded attention kernels in
megatron_taper/models/ are tested against; test code only.

`reference_chunked_scan` is the chunked parallel form as NeuralMemory ran it one chunk at a time
before its chunk loop was batched (issue 39): the definition of the chunked math the batched
NeuralMemory.scan_features must reproduce (tests/models/test_titans_scan.py)."""
from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taper.models.titans.neural_memory import ALL_HEADS, Features, NeuralMemory, ReadMix, State


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


def reference_chunked_scan(memory: NeuralMemory, features: Features, state: State, chunk_size: int | None = None,
                           mix: ReadMix | None = None, whole_chunks: bool = False,
                           heads: slice = ALL_HEADS) -> tuple[torch.Tensor, State]:
    """NeuralMemory.scan_features as it ran chunk by chunk (the definition of the chunked math):
    ([B, H, T, E], state). `mix`, when given, replaces each memory layer's pre-activation read
    (ReadMix). `whole_chunks`: the state returned is the one after the last whole chunk (a trailing
    partial chunk is read, not written). Of every head only (`heads`: as scan_features' signature)."""
    assert heads == ALL_HEADS, heads
    k, v, q, theta, log_eta, log_keep = features
    size, total = chunk_size or memory.chunk_size, k.shape[2]
    reads = []
    for s in range(0, total, size):
        c = slice(s, s + size)
        read, written = reference_chunk(memory, state, k[:, :, c], v[:, :, c], q[:, :, c], theta[..., c],
                                        log_eta[..., c], log_keep[..., c],
                                        None if mix is None else functools.partial(mix, positions=c))
        state = state if whole_chunks and s + size > total else written
        reads.append(read)
    return torch.cat(reads, dim=2), state


def silu_grad(z: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


def reference_chunk(memory: NeuralMemory, state: State, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor,
                    theta: torch.Tensor, log_eta: torch.Tensor, log_keep: torch.Tensor,
                    mix: Callable[..., torch.Tensor] | None = None) -> tuple[torch.Tensor, State]:
    """One chunk of C tokens; k, v, q [B, H, C, E]; theta, log_eta, log_keep [B, H, C]."""
    weights, surprise = state
    n = len(weights)
    acts, pre, h = [], [], k  # forward of W (the chunk's starting state) on the keys
    for layer, w in enumerate(weights):
        acts.append(h)
        h = h @ w
        if layer < n - 1:
            pre.append(h)
            h = F.silu(h)
    delta = 2.0 * (k + h - v)  # d ||k + f(k) - v||^2 / d f(k)
    theta = theta / sum(a.square().sum(-1) for a in acts)  # normalised step theta_t / nu_t, [B, H, C]
    deltas = [delta] * n
    for layer in range(n - 1, 0, -1):
        delta = (delta @ weights[layer].transpose(-1, -2)) * silu_grad(pre[layer - 1])
        deltas[layer - 1] = delta

    size = k.shape[2]
    causal = torch.ones(size, size, dtype=torch.bool, device=k.device).tril()
    lb, le = log_keep.cumsum(-1), log_eta.cumsum(-1)  # [B, H, C]
    decay = (lb[..., :, None] - lb[..., None, :]).masked_fill(~causal, -math.inf).exp()  # P [B, H, C, C]
    momentum = (le[..., :, None] - le[..., None, :]).masked_fill(~causal, -math.inf).exp()  # Q
    coef = (decay @ momentum) * theta[..., None, :]  # c_ti
    keep_w = lb.exp()[..., None]  # B_t [B, H, C, 1]
    keep_s = decay @ le.exp()[..., None]  # sum_j P_tj E_j [B, H, C, 1]

    r = q
    for layer in range(n):
        a, d, init = acts[layer], deltas[layer], memory.mem_w[layer].to(r.dtype)
        read = (r @ init + keep_w * (r @ (weights[layer] - init)) + keep_s * (r @ surprise[layer])
                - (coef * (r @ a.transpose(-1, -2))) @ d)
        r = read if mix is None else mix(layer, r, read)
        r = F.silu(r) if layer < n - 1 else r

    last = coef[..., -1, :, None]  # [B, H, C, 1]
    s_coef = (theta * (le[..., -1:] - le).exp())[..., None]
    new_w, new_s = [], []
    for layer in range(n):
        a_t, d, init = acts[layer].transpose(-1, -2), deltas[layer], memory.mem_w[layer].to(q.dtype)
        new_w.append(init + keep_w[..., -1:, :] * (weights[layer] - init) + keep_s[..., -1:, :] * surprise[layer]
                     - a_t @ (last * d))
        new_s.append(le[..., -1:, None].exp() * surprise[layer] - a_t @ (s_coef * d))
    return q + r, (new_w, new_s)
