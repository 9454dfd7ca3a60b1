"""Memory Caching written token by token, as the paper states it: the base recurrence one token at
a time (the linear memory's S_t = a_t S_{t-1} + b_t k_t v_t^T; the deep memory's Titans update with
autograd gradients through torch.func), the state cached at every segment end, and each token's
read combined from the online and cached states by the variant's rule, with the soup's memories
mixed as parameters. The oracle of models/memory_caching/'s chunked form; test code only."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_taper.models.memory_caching.model import MemoryCachingMixer
from megatron_taper.models.titans.neural_memory import NeuralMemory
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
    forgetting toward M_0 (models/titans/neural_memory.py)."""
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
            if not mixer.continues:
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


# ---------------------------------------------------------------------------------------------
# The chunk and segment loops models/memory_caching/model.py and linear_memory.py ran until the
# loop-free forms replaced them (one Python iteration per chunk and per segment): the definition
# of the chunked math the loop-free forms are tested against, in float64 to 1e-10.


def loop_linear_scan(memory, features, state, chunk_size=None, mix=None):
    """LinearMemory.scan_features as a loop over chunks: ([B, H, T, E], state)."""
    import math

    k, v, q, log_a, b = features
    size = chunk_size or memory.chunk_size
    s = state[0][0]  # [B, H, E, E]
    reads = []
    for start in range(0, k.shape[2], size):
        c = slice(start, start + size)
        kc, vc, qc, bc = k[:, :, c], v[:, :, c], q[:, :, c], b[..., c]
        lb = log_a[..., c].cumsum(-1)  # [B, H, C]
        causal = torch.ones(kc.shape[2], kc.shape[2], dtype=torch.bool, device=k.device).tril()
        decay = (lb[..., :, None] - lb[..., None, :]).masked_fill(~causal, -math.inf).exp()  # [B, H, C, C]
        scores = (qc @ kc.transpose(-1, -2)) * decay * bc[..., None, :]
        read = scores @ vc + lb.exp()[..., None] * (qc @ s)
        reads.append(read if mix is None else mix(0, qc, read, positions=c))
        weight = (bc * (lb[..., -1:] - lb).exp())[..., None]  # [B, H, C, 1]
        s = lb[..., -1:, None].exp() * s + (kc * weight).transpose(-1, -2) @ vc
    return torch.cat(reads, dim=2), ([s], [])


def loop_gammas(mixer, u, k, pooled, cached):
    """MemoryCachingMixer.gammas for one segment (the loop form's per-segment weights)."""
    count = torch.arange(1, k.shape[2] + 1, device=k.device, dtype=k.dtype)[:, None]
    logits = (u * (k.cumsum(2) / count)).sum(-1, keepdim=True)
    if cached:
        scores = u @ pooled[:, :, :cached].transpose(-1, -2)
        if mixer.variant == "ssc" and cached > mixer.top_k:
            chosen = scores.topk(mixer.top_k, dim=-1).indices
            keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, chosen, True)
            scores = scores.masked_fill(~keep, float("-inf"))
        logits = torch.cat((logits, scores), dim=-1)
    return torch.softmax(logits, dim=-1)


def loop_soup_mix(gamma, finals):
    stacked = [torch.stack(layer, dim=2).flatten(3) for layer in zip(*finals)]

    def mix(layer, r, read, positions):
        g = gamma[:, :, positions]
        out = g[..., :1] * read
        if not stacked:
            return out
        mixed = (g[..., 1:] @ stacked[layer]).unflatten(-1, (r.shape[-1], -1))
        return out + (r.unsqueeze(-2) @ mixed).squeeze(-2)

    return mix


def loop_reads(mixer: MemoryCachingMixer, x: torch.Tensor) -> torch.Tensor:
    """MemoryCachingMixer.reads (one process) as a loop over segments, each scanned chunk by chunk
    (the linear memory through loop_linear_scan, the deep one through its own scan_features)."""
    from megatron_taper.models.memory_caching.cost import segment_slices

    memory, batch = mixer.memory, x.shape[0]
    deep = isinstance(memory, NeuralMemory)

    def scan(features, state, mix):
        if deep:
            return memory.scan_features(features, state, mix=mix)
        return loop_linear_scan(memory, features, state, mix=mix)

    features = memory.project(x, x)[0]
    k, q = features[0], features[2]
    segments = segment_slices(x.shape[1], mixer.segment, mixer.variant)
    u = None if mixer.wu is None else mixer.wu(x).unflatten(-1, (-1, mixer.head_dim)).transpose(1, 2)
    pooled = None if u is None else torch.stack([k[:, :, seg].mean(2) for seg in segments], dim=2)
    gammas = [None if u is None else loop_gammas(mixer, u[:, :, seg], k[:, :, seg], pooled, i)
              for i, seg in enumerate(segments)]
    state, onlines, finals = memory.init_state(batch), [], []
    for i, seg in enumerate(segments):
        mix = loop_soup_mix(gammas[i], finals) if mixer.variant == "soup" else None
        read, final = scan(tuple(f[:, :, seg] for f in features), state, mix)
        onlines.append(read)
        finals.append(final[0])
        state = final if mixer.continues else memory.init_state(batch)
    if mixer.variant in ("none", "soup"):
        return torch.cat(onlines, dim=2)
    starts = [seg.stop for seg in segments[:-1]]
    later = [memory.read(q[:, :, start:], (final, [])) for start, final in zip(starts, finals)]
    outs = []
    for i, seg in enumerate(segments):
        if not i:
            outs.append(onlines[0] if gammas[0] is None else gammas[0] * onlines[0])
            continue
        rows = [reads[:, :, seg.start - start:seg.stop - start] for reads, start in zip(later[:i], starts)]
        cached = torch.stack(rows, dim=3)  # [B, H, T, n, E]
        if mixer.variant == "residual":
            outs.append(onlines[i] + cached.sum(3))
            continue
        gamma = gammas[i]
        outs.append(gamma[..., :1] * onlines[i] + (gamma[..., None, 1:] @ cached).squeeze(-2))
    return torch.cat(outs, dim=2)
