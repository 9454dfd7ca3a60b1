"""A linear recurrent memory (gated linear attention with a data-dependent scalar decay per head),
the linear base of Memory Caching (models/memory_caching.py).

Per head (H heads of size E), for tokens t = 1..T, with the state S_t [E, E] (S = M^T of the
paper's notation M_t = a_t M_{t-1} + b_t v_t k_t^T, y_t = M_t q_t):
    k_t = l2norm(silu(conv_k(W_k x)_t)), likewise v_t and q_t     (as Titans' neural memory)
    a_t = sigmoid(w_a x_t + logit(decay_init)),  b_t = sigmoid(w_b x_t)   (one linear x_t -> [H, 2])
    S_t = a_t S_{t-1} + b_t k_t v_t^T,     y_t = q_t S_t                  (read after writing)
S_0 = 0. Chunked form (`chunk_size` C): with l_t = sum_{j<=t} log a_j inside the chunk and S the
chunk's starting state,
    y_t = exp(l_t) q_t S + sum_{j<=t} exp(l_t - l_j) b_j (q_t . k_j) v_j
    S'  = exp(l_C) S + sum_j exp(l_C - l_j) b_j k_j v_j^T,
exact for every C (no approximation, unlike the deep memory's chunked gradients).

The module shares Titans' NeuralMemory's interface (project / init_state / scan_features / read
/ output), so Memory Caching runs over either base unchanged; its projections and read are
NeuralMemory's own methods; the read-out is wo(y * gains) (per-channel gains, no normalisation).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taper.models.titans import ConvPast, NeuralMemory, ReadMix, State, mlp_read

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig

# k, v, q [B, H, T, E]; log a, b [B, H, T]
LinearFeatures = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class LinearMemory(nn.Module):
    """Gated linear attention memory (module docstring); options in model.memory_caching."""

    heads = NeuralMemory.heads

    @staticmethod
    def read(q: torch.Tensor, state: State) -> torch.Tensor:
        """q S of queries q [B, H, T, E] with the state frozen at `state` (no residual, unlike the deep memory)."""
        return mlp_read(q, state)

    def output(self, reads: torch.Tensor) -> torch.Tensor:
        """reads [B, H, T, E] -> wo(reads * gains) [B, T, D]. Not RMS-normalised per head as the deep
        memory's: a read near zero (q_t nearly orthogonal to every key written) would be scaled to
        unit size, its sign following q_t . k_j: a discontinuity that tiny rounding differences
        (another tp or pp layout) turn into different training runs."""
        return self.wo((reads.transpose(1, 2) * self.out_norm_weight.view(-1, self.head_dim)).flatten(2))

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        mc, d, h, e = cfg.memory_caching, cfg.d_model, cfg.n_heads, cfg.head_dim
        self.head_dim, self.chunk_size = e, mc.linear_chunk
        self.decay_offset = math.log(mc.linear_decay_init / (1 - mc.linear_decay_init))
        self.wq = nn.Linear(d, h * e, bias=False)
        self.wk = nn.Linear(d, h * e, bias=False)
        self.wv = nn.Linear(d, h * e, bias=False)
        for name in ("conv_q", "conv_k", "conv_v"):  # depthwise taps [H*E, K], oldest first
            kernel = mc.linear_conv_kernel
            self.register_parameter(name, nn.Parameter(torch.empty(h * e, kernel)) if kernel else None)
        self.gates = nn.Linear(d, h * 2, bias=True)  # head-major [H, (decay, strength)]
        self.out_norm_weight = nn.Parameter(torch.ones(h * e))
        self.wo = nn.Linear(h * e, d, bias=False)

    def project(self, x_kv: torch.Tensor, x_q: torch.Tensor, past: ConvPast = None) -> tuple[LinearFeatures, None]:
        """k, v, q, log a, b of x_kv / x_q [B, T, D], which continue the sequences whose convolution
        inputs `past` holds (None = they start here)."""
        pk, pv, pq = past or (None, None, None)
        k = self.heads(self.wk, self.conv_k, x_kv, pk)[0]
        v = self.heads(self.wv, self.conv_v, x_kv, pv)[0]
        q = self.heads(self.wq, self.conv_q, x_q, pq)[0]
        g = self.gates(x_kv).unflatten(-1, (-1, 2)).permute(3, 0, 2, 1)  # [2, B, H, T]
        return (k, v, q, F.logsigmoid(g[0] + self.decay_offset), torch.sigmoid(g[1])), None

    def init_state(self, batch: int) -> State:
        h = self.wq.weight.shape[0] // self.head_dim  # local heads under tensor parallelism
        w = self.wq.weight
        return [torch.zeros(batch, h, self.head_dim, self.head_dim, device=w.device, dtype=w.dtype)], []

    def scan_features(self, features: LinearFeatures, state: State, chunk_size: int | None = None,
                      mix: ReadMix | None = None) -> tuple[torch.Tensor, State]:
        """Write and read every token, chunk by chunk: ([B, H, T, E], state). `mix(0, q, read,
        positions=...)`, when given, replaces each chunk's read (NeuralMemory.scan_features)."""
        k, v, q, log_a, b = features
        size = chunk_size or self.chunk_size
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


def linear_memory_params(cfg: ModelConfig) -> int:
    d, h, e, kernel = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.memory_caching.linear_conv_kernel
    return 4 * d * h * e + 2 * d * h + 2 * h + h * e + 3 * h * e * kernel


def linear_scan_flops(cfg: ModelConfig, tokens: int) -> float:
    """Chunked writes and reads of `tokens` tokens starting from a state (projections excluded):
    per chunk of c tokens and head, q k^T and scores v (2 c^2 E each), q S and the state update
    (2 c E^2 each)."""
    h, e, size = cfg.n_heads, cfg.head_dim, cfg.memory_caching.linear_chunk
    total = 0.0
    for s in range(0, tokens, size):
        c = min(size, tokens - s)
        total += h * (4 * c * c * e + 4 * c * e * e)
    return total


def linear_projection_flops(cfg: ModelConfig) -> float:
    """Per token: wq, wk, wv, wo, the gates and the convolutions."""
    d, h, e, kernel = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.memory_caching.linear_conv_kernel
    return 2 * (4 * d * h * e + 2 * d * h + 3 * h * e * kernel)
