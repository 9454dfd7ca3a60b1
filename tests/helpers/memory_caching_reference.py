"""Memory Caching written token by token, as the paper states it: the base recurrence one token at
a time (the linear memory's S_t = a_t S_{t-1} + b_t k_t v_t^T; the deep memory's Titans update with
autograd gradients through torch.func), the state cached at every segment end, and each token's
read combined from the online and cached states by the variant's rule, with the soup's memories
mixed as parameters. The oracle of models/memory_caching.py's chunked form; test code only."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_taper.models.memory_caching import MemoryCachingMixer
from megatron_taper.models.titans import NeuralMemory
from tests.helpers.titans_reference import reference_features, reference_heads


def mlp_read(weights: list[torch.Tensor], q: torch.Tensor) -> torch.Tensor:
    """Per-(batch, head) memory weights [B, H, i, o] (depth layers, SiLU between) read at q [B, H, E]."""
    r = q
    for layer, w in enumerate(weights):
        r = (r.unsqueeze(-2) @ w).squeeze(-2)
        r = F.silu(r) if layer < len(weights) - 1 else r
    return r


def deep_step(weights, surprise, initial, k, v, theta, eta, keep):
    """One Titans write at one token (k, v [B, H, E]; gates [B, H]; `initial` the memory's M_0 [H, i, o]):
    the residual memory k + f(k), the step normalised by its layers' summed squared input norms, the
    forgetting toward M_0 (models/titans.py)."""
    from torch.func import grad, vmap

    def loss(ws, key, value):
        return ((key + mlp_read([w[None, None] for w in ws], key[None, None]) - value) ** 2).sum()

    grads = vmap(vmap(grad(loss)))(weights, k, v)
    nu, h = k.square().sum(-1), k
    for w in weights[:-1]:
        h = F.silu((h.unsqueeze(-2) @ w).squeeze(-2))
        nu = nu + h.square().sum(-1)
    eta, keep, theta = (z[:, :, None, None] for z in (eta, keep, theta / nu))
    surprise = [eta * s - theta * g for s, g in zip(surprise, grads)]
    return [w0 + keep * (w - w0) + s for w0, w, s in zip(initial, weights, surprise)], surprise


def reference_reads(mixer: MemoryCachingMixer, x: torch.Tensor) -> torch.Tensor:
    """The mixer's per-head reads [B, H, T, E] for x [B, T, D], token by token."""
    memory, batch = mixer.memory, x.shape[0]
    deep = isinstance(memory, NeuralMemory)
    if deep:
        k, v, q, theta, eta, keep = reference_features(memory, x, x)
    else:
        k, v, q = (reference_heads(memory, proj, conv, x) for proj, conv in
                   ((memory.wk, memory.conv_k), (memory.wv, memory.conv_v), (memory.wq, memory.conv_q)))
        g = memory.gates(x).unflatten(-1, (-1, 2)).transpose(1, 2)  # [B, H, T, 2]
        decay, strength = torch.sigmoid(g[..., 0] + memory.decay_offset), torch.sigmoid(g[..., 1])
    heads, seq, e = k.shape[1], k.shape[2], k.shape[3]
    u = None if mixer.wu is None else mixer.wu(x).unflatten(-1, (-1, e)).transpose(1, 2)

    def read(weights, qt):  # the deep memory reads q + f(q), the linear one q S
        return qt + mlp_read(weights, qt) if deep else mlp_read(weights, qt)

    def initial():
        if deep:
            weights = [w.unsqueeze(0).expand(batch, -1, -1, -1) for w in memory.mem_w]
            return weights, [torch.zeros_like(w) for w in weights]
        return [x.new_zeros(batch, heads, e, e)], []

    segment = seq if mixer.variant == "none" else mixer.segment
    (weights, surprise), cached, cached_keys, seg_keys, reads = initial(), [], [], [], []
    for t in range(seq):
        if t and t % segment == 0:
            cached.append(weights)
            cached_keys.append(torch.stack(seg_keys).mean(0))
            seg_keys = []
            if mixer.independent:
                weights, surprise = initial()
        seg_keys.append(k[:, :, t])
        if deep:
            weights, surprise = deep_step(weights, surprise, list(memory.mem_w), k[:, :, t], v[:, :, t],
                                          theta[:, :, t], eta[:, :, t], keep[:, :, t])
        else:
            outer = k[:, :, t, :, None] * v[:, :, t, None, :]
            weights = [decay[:, :, t, None, None] * weights[0] + strength[:, :, t, None, None] * outer]
        qt = q[:, :, t]
        if mixer.variant == "none":
            reads.append(read(weights, qt))
            continue
        if mixer.variant == "residual":
            reads.append(read(weights, qt) + sum(read(c, qt) for c in cached))
            continue
        ut = u[:, :, t]
        online_score = (ut * torch.stack(seg_keys).mean(0)).sum(-1)  # [B, H]
        scores = [(ut * kbar).sum(-1) for kbar in cached_keys]
        if mixer.variant == "ssc" and len(scores) > mixer.top_k:
            stacked = torch.stack(scores, -1)
            chosen = stacked.topk(mixer.top_k, dim=-1).indices
            keep_mask = torch.zeros_like(stacked, dtype=torch.bool).scatter_(-1, chosen, True)
            scores = list(stacked.masked_fill(~keep_mask, float("-inf")).unbind(-1))
        gamma = torch.softmax(torch.stack([online_score, *scores], -1), -1)  # [B, H, 1 + N]
        memories = [weights, *cached]
        if mixer.variant == "soup":
            mixed = [sum(gamma[:, :, i, None, None] * m[layer] for i, m in enumerate(memories))
                     for layer in range(len(weights))]
            reads.append(read(mixed, qt))
        else:
            reads.append(sum(gamma[:, :, i, None] * read(m, qt) for i, m in enumerate(memories)))
    return torch.stack(reads, dim=2)
