"""The causal depthwise convolution of Titans' neural memory (titans/neural_memory.py) and of the
linear memory (memory_caching/linear_memory.py).

Convolution: the paper's 1D depthwise-separable convolution after the query, key and value
projections (the projection is its pointwise part), on the neural memory's q, k, v only (the
attention's are plain), before SiLU and the l2-norm. Causal: zero-padded in front, so token t
mixes the projections of tokens t-K+1..t of the sequence the memory reads ([P, x] in MAG / MAL,
persistent tokens included; in MAC the whole x for the retrieval queries and the whole y, carried
across segments through `ConvPast`, for the writes). It acts before the memory, so the chunked
form and the recurrence see the same k, v, q and stay exactly equal at C = 1. Taps [H*E, K] per
projection, initialised to the identity (1 on the newest tap) plus N(0, init_std), so a new model
starts close to the one without convolution; split by head under tensor parallelism like wq.
`conv_kernel` = 0 removes it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(x: torch.Tensor, weight: torch.Tensor | None, past: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal convolution along time, y_t = sum_j weight[:, j] x_{t-K+1+j}: x [B, T, C],
    weight [C, K] (None = identity), past [B, K-1, C] the inputs before x (zeros when None).
    `positions` [B, T] (each row's offset in its document, titans/documents.py): tap j of row t
    only sees inputs of its own document (x_{t-K+1+j} with K-1-j <= positions_t; the others count
    as zeros, as before a sequence's start). Returns y [B, T, C] and the last K-1 inputs, the next
    call's past."""
    if weight is None:
        return x, None
    taps = weight.shape[1]
    if past is None:
        past = x.new_zeros(x.shape[0], taps - 1, x.shape[2])
    padded = torch.cat((past, x), dim=1)  # [B, K-1+T, C]
    if positions is None:
        y = F.conv1d(padded.transpose(1, 2), weight.to(x.dtype).unsqueeze(1), groups=weight.shape[0])
        y = y.transpose(1, 2)
    else:
        seq, w = x.shape[1], weight.to(x.dtype)
        y = sum(padded[:, j:j + seq] * w[:, j] * (positions >= taps - 1 - j)[..., None].to(x.dtype)
                for j in range(taps))
    return y, padded[:, padded.shape[1] - (taps - 1):]
