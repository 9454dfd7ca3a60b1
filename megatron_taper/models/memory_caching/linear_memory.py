"""A linear recurrent memory (gated linear attention with a data-dependent scalar decay per head),
the linear base of Memory Caching (memory_caching/model.py; its cost terms in memory_caching/cost.py).

Per head (H heads of size E), for tokens t = 1..T, with the state S_t [E, E] (S = M^T of the
paper's notation M_t = a_t M_{t-1} + b_t v_t k_t^T, y_t = M_t q_t):
    k_t = l2norm(silu(conv_k(W_k x)_t)), likewise v_t and q_t     (as Titans' neural memory)
    a_t = sigmoid(w_a x_t + logit(decay_init)),  b_t = sigmoid(w_b x_t)   (one linear x_t -> [H, 2])
    S_t = a_t S_{t-1} + b_t k_t v_t^T,     y_t = q_t S_t                  (read after writing)
S_0 = 0. Chunked form (`chunk_size` C): with l_t = sum_{j<=t} log a_j inside the chunk and S the
chunk's starting state,
    y_t = exp(l_t) q_t S + sum_{j<=t} exp(l_t - l_j) b_j (q_t . k_j) v_j
    S'  = exp(l_C) S + sum_j exp(l_C - l_j) b_j k_j v_j^T,
exact for every C (no approximation, unlike the deep memory's chunked gradients). All chunks run
at once (`chunked_scan`): the intra-chunk [C, C] products batched over chunks, each chunk's writes
from a zero state, and the states between chunks from one segment-sum product
(models/kernels/state_passing.py; a Triton kernel on CUDA); no Python loop, so the operator count
does not grow with the sequence.

The module shares Titans' NeuralMemory's interface (project / init_state / scan_features / read
/ output), so Memory Caching runs over either base (each also has a `scan_segments` of its own);
its projections and read are NeuralMemory's own methods; the read-out is wo(y * gains)
(per-channel gains, no normalisation).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taper.models.kernels.state_passing import chunk_states
from megatron_taper.models.titans.neural_memory import ALL_HEADS, ConvPast, NeuralMemory, ReadMix, State, mlp_read

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig

# k, v, q [B, H, T, E]; log a, b [B, H, T]
LinearFeatures = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class LinearMemory(nn.Module):
    """Gated linear attention memory (module docstring); options in model.memory_caching."""

    heads = NeuralMemory.heads
    conv_heads = NeuralMemory.conv_heads

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

    def project(self, x_kv: torch.Tensor, x_q: torch.Tensor, past: ConvPast = None,
                positions: torch.Tensor | None = None) -> tuple[LinearFeatures, None]:
        """k, v, q, log a, b of x_kv / x_q [B, T, D], which continue the sequences whose convolution
        inputs `past` holds (None = they start here); `positions` as NeuralMemory.project's."""
        pk, pv, pq = past or (None, None, None)
        k = self.heads(self.wk, self.conv_k, x_kv, pk, positions)[0]
        v = self.heads(self.wv, self.conv_v, x_kv, pv, positions)[0]
        q = self.heads(self.wq, self.conv_q, x_q, pq, positions)[0]
        return (k, v, q, *self.gate_features(self.gates(x_kv))), None

    def gate_features(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gate pre-activations g [B, T, 2 n] (head-major: per head decay, strength) -> log a, b [B, n, T]."""
        g = g.unflatten(-1, (-1, 2)).permute(3, 0, 2, 1)  # [2, B, n, T]
        return F.logsigmoid(g[0] + self.decay_offset), torch.sigmoid(g[1])

    def init_state(self, batch: int, heads: slice = ALL_HEADS) -> State:
        """The zero state of `batch` sequences for the memory's heads `heads` (default all)."""
        h = len(range(self.wq.weight.shape[0] // self.head_dim)[heads])  # local heads under tensor parallelism
        w = self.wq.weight
        return [torch.zeros(batch, h, self.head_dim, self.head_dim, device=w.device, dtype=w.dtype)], []

    def scan_features(self, features: LinearFeatures, state: State, chunk_size: int | None = None,
                      mix: ReadMix | None = None) -> tuple[torch.Tensor, State]:
        """Write and read every token, all chunks at once: ([B, H, T, E], state). `mix(0, q, read,
        positions=slice(0, T))`, when given, replaces the read (NeuralMemory.scan_features)."""
        reads, states = chunked_scan(features, state[0][0], chunk_size or self.chunk_size)
        q = features[2]
        return reads if mix is None else mix(0, q, reads, positions=slice(0, q.shape[2])), ([states[:, :, -1]], [])

    def scan_segments(self, features: LinearFeatures, start: torch.Tensor, length: int,
                      continues: bool, resets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Memory Caching's segments of `length` tokens (the last may be shorter) in one scan: the
        online reads [B, H, T, E] and every segment's end state [B, H, n, E, E]. `continues`: a
        segment starts from the previous one's end state (the first from `start` [B, H, E, E]);
        else each starts from zero, folded into the batch. Each segment is padded to whole chunks
        with tokens that neither write (b = 0) nor decay (log a = 0), so its end is a chunk's end.
        `resets` [B, T] (packed documents, titans/documents.py; True only at chunk starts of the
        padded segments): the chunk starting there starts from zero (chunked_scan's `carry`)."""
        total = features[0].shape[2]
        n = -(-total // length)
        size = min(self.chunk_size, length)
        padded = -(-length // size) * size
        blocks = [time_blocks(f, length) for f in features]  # [B, H, n, L, ...]
        blocks = [pad_time(f, padded, dim=3) for f in blocks]  # [B, H, n, L', ...]
        if continues:
            flat = tuple(f.flatten(2, 3) for f in blocks)
            carry = None
            if resets is not None:  # per chunk of the flat padded segments: the next one continues
                starts = pad_time(time_blocks(resets[:, None], length), padded, dim=3).flatten(2, 3)[:, 0, size::size]
                carry = torch.cat((~starts, starts.new_ones(starts.shape[0], 1)), dim=1)  # [B, N]
            reads, states = chunked_scan(flat, start, size, carry)
            ends = states[:, :, padded // size::padded // size]  # [B, H, n, E, E]
            reads = reads.unflatten(2, (n, padded))
        else:
            batch, heads = start.shape[:2]
            folded = tuple(f.movedim(2, 1).flatten(0, 1) for f in blocks)  # [B * n, H, L', ...]
            initial = torch.cat((start.unsqueeze(1), start.new_zeros(batch, n - 1, *start.shape[1:])), dim=1)
            reads, states = chunked_scan(folded, initial.flatten(0, 1), size)
            ends = states[:, :, -1].unflatten(0, (batch, n)).movedim(1, 2)
            reads = reads.unflatten(0, (batch, n)).movedim(1, 2)
        return reads[:, :, :, :length].flatten(2, 3)[:, :, :total], ends


def pad_time(t: torch.Tensor, size: int, dim: int = 2) -> torch.Tensor:
    """t padded with zeros at the end of dimension `dim` to `size`."""
    extra = size - t.shape[dim]
    if not extra:
        return t
    return torch.cat((t, t.new_zeros(*t.shape[:dim], extra, *t.shape[dim + 1:])), dim=dim)


def time_blocks(t: torch.Tensor, length: int) -> torch.Tensor:
    """t [B, H, T, ...] as blocks of `length` along time, the last padded with zeros: [B, H, n, L, ...]."""
    n = -(-t.shape[2] // length)
    return pad_time(t, n * length).unflatten(2, (n, length))


def chunk_writes(k: torch.Tensor, v: torch.Tensor, log_a: torch.Tensor,
                 b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of C tokens (k, v [..., C, E]; log a, b [..., C]): the log decays summed within
    the block l [..., C] and its writes from a zero state U = sum_j exp(l_C - l_j) b_j k_j v_j^T
    [..., E, E]."""
    lb = log_a.cumsum(-1)
    weight = (b * (lb[..., -1:] - lb).exp())[..., None]  # [..., C, 1]
    return lb, (k * weight).transpose(-1, -2) @ v


def chunked_scan(features: LinearFeatures, initial: torch.Tensor, size: int,
                 carry: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form of the module docstring for every chunk at once: reads [B, H, T, E] and
    the states before every chunk and after the last [B, H, N + 1, E, E], from `initial`
    [B, H, E, E]. T is padded to whole chunks of `size` (tokens that neither write nor decay).
    `carry` [B, N] bool: False where a chunk hands on zero (the next starts a document): its
    writes are dropped and its decay is exp(-inf) = 0."""
    k, v, q, log_a, b = features
    total = k.shape[2]
    k, v, q, log_a, b = (time_blocks(t, size) for t in (k, v, q, log_a, b))  # [B, H, N, C, E]; [B, H, N, C]
    lb, updates = chunk_writes(k, v, log_a, b)  # [B, H, N, C]; [B, H, N, E, E]
    causal = torch.ones(size, size, dtype=torch.bool, device=k.device).tril()
    decay = (lb[..., :, None] - lb[..., None, :]).masked_fill(~causal, -math.inf).exp()  # [B, H, N, C, C]
    scores = (q @ k.transpose(-1, -2)) * decay * b[..., None, :]
    decays = lb[..., -1]  # [B, H, N]
    if carry is not None:
        updates = updates * carry[:, None, :, None, None]
        decays = decays.masked_fill(~carry[:, None], -math.inf)
    states = chunk_states(updates, decays, initial, documents=carry is not None)  # [B, H, N + 1, E, E]
    reads = scores @ v + lb.exp()[..., None] * (q @ states[:, :, :-1])
    return reads.flatten(2, 3)[:, :, :total], states
