"""Token-by-token reference of an online CMS level (megatron_taper/models/hope_attention/).

Tokens are processed one at a time, every sequence with its own copy of the level's weights
(w1, w3 [W, D], w2 [D, W]). Token t's output is read with the current weights; for every token
outside the sequence's last chunk, the gradient of its local loss 1/2 ||M(n_t) - n_t||^2 by the
weights is taken with torch.autograd (create_graph, so that an outer gradient flows through it)
and accumulated, with ||h_t||^2 + 2 ||n_t||^2 (h_t = silu(w1 n_t) * w3 n_t); at the end of each
chunk of `period` tokens the accumulated step is applied to each matrix:

    w -= eta / mean_t (||h_t||^2 + 2 ||n_t||^2) * mean_t grad_w l_t,

eta = softplus(raw_step). Only the definition (and its epsilon) is shared with the model, not
its closed-form gradients.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_taper.models.hope_attention.online import STEP_EPS


def read(weights: list[torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: x [B, D] -> (y [B, D], h [B, W]) under per-sequence weights."""
    w1, w3, w2 = weights
    h = F.silu(torch.einsum("bwd,bd->bw", w1, x)) * torch.einsum("bwd,bd->bw", w3, x)
    return torch.einsum("bdw,bw->bd", w2, h), h


def reference_level(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, raw_step: torch.Tensor,
                    n: torch.Tensor, period: int) -> torch.Tensor:
    """The level's outputs [B, S, D] for its normalised inputs n [B, S, D]."""
    bsz, seq, _ = n.shape
    eta = F.softplus(raw_step)
    weights = [w.expand(bsz, *w.shape) for w in (w1, w3, w2)]
    last_chunk_start = (seq - 1) // period * period
    outs = []
    grads, inputs_sq = [0.0, 0.0, 0.0], 0.0
    for t in range(seq):
        x = n[:, t]
        y, h = read(weights, x)
        outs.append(y)
        if t >= last_chunk_start:
            continue
        # summed over sequences: each sequence's weights receive only its own token's gradient
        loss = 0.5 * (y - x).square().sum()
        token_grads = torch.autograd.grad(loss, weights, create_graph=True)
        grads = [acc + g for acc, g in zip(grads, token_grads)]
        inputs_sq = inputs_sq + h.square().sum(-1) + 2 * x.square().sum(-1)
        if (t + 1) % period == 0:
            scale = (eta / (inputs_sq / period + STEP_EPS))[:, None, None]
            weights = [w - scale * g / period for w, g in zip(weights, grads)]
            grads, inputs_sq = [0.0, 0.0, 0.0], 0.0
    return torch.stack(outs, dim=1)


def chunked_reference_level(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, raw_step: torch.Tensor,
                            n: torch.Tensor, period: int, w13: torch.Tensor | None = None,
                            w2_start: torch.Tensor | None = None, end_update: bool = False
                            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The definition of an online level's math: ContinuumLevel.online as it was before its scan
    (models/hope_attention/online.py), one loop iteration per chunk on materialised [B, 2W, D] and [B, D, W]
    fast weights, autograd through everything. On one device (no tensor parallelism).

    Chunk c of `period` tokens n_c [B, C, D] is read with the weights theta^(c) = ([w1; w3], w2)
    that the chunks before it left; unless it is the sequence's last chunk (or `end_update`, a
    context-parallel slice that hands its end weights on), it then updates them:

        a, g = n_c w1^T, n_c w3^T;  s = silu(a);  h = s * g;  y = h w2^T
        scale = eta / (C (mean_t (||h_t||^2 + 2 ||n_t||^2) + STEP_EPS)),  eta = softplus(raw_step)
        descent = (n_c - y) * scale;  dh = descent w2
        w2 += descent^T h;  [w1; w3] += [dh * g * silu'(a), dh * s]^T n_c

    `w13`, `w2_start`: start weights other than the parameters ([B, 2W, D], [B, D, W], a slice's
    received state). Returns the outputs [B, S, D], with `end_update` also the end weights."""
    step = F.softplus(raw_step)
    w13 = torch.cat((w1, w3)) if w13 is None else w13
    w2 = w2 if w2_start is None else w2_start
    chunks = n.split(period, dim=1)
    outs, updates = [], 0
    for index, chunk in enumerate(chunks):
        a, g = (chunk @ w13.transpose(-1, -2)).chunk(2, dim=-1)
        sig = torch.sigmoid(a)
        s = a * sig
        h, dh_da = s * g, g * sig * (1 + a * (1 - sig))
        y = h @ w2.transpose(-1, -2)
        outs.append(y)
        if index == len(chunks) - 1 and not end_update:
            break
        inputs_sq = (h.square().sum(-1) + 2 * chunk.square().sum(-1)).mean(1)  # [B]
        scale = step / (chunk.shape[1] * (inputs_sq + STEP_EPS))
        descent = (chunk - y) * scale[:, None, None]
        dh = descent @ w2
        w2 = w2 + descent.transpose(1, 2) @ h
        w13 = w13 + torch.cat((dh * dh_da, dh * s), dim=-1).transpose(1, 2) @ chunk
        updates += 1
    out = torch.cat(outs, dim=1)
    out = out if updates else out + 0.0 * step
    return (out, w13, w2) if end_update else out
