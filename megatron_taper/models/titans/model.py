"""Titans (Behrouz et al. 2024, arXiv 2501.00663): attention plus a neural long-term memory.

Neural memory: titans/neural_memory.py (NeuralMemory, its chunked parallel form and the causal
convolution on its q, k, v).

Blocks (the MLP after the mixer has this layer's tapered width, as in the Transformer):
    MAG  x~ = [P, norm(x)];  o = SWA(x~) * sigmoid(M(x~))                 (memory as a gate)
    MAL  x = x + M([P, norm(x)]);  x = x + SWA([P, norm(x)])             (memory as a layer)
    MAC  per segment s of `window` tokens: h = M_{s-1}(q(norm(x)_s)) (no write);
         y = Attn([P, h, norm(x)_s]) (causal over h and x); o = y * sigmoid(M_t(y_t)) while M
         writes y                                                          (memory as context)
P are `persistent_tokens` learnable tokens, visible to every query; SWA is causal attention over
the last `window` tokens plus P, with RoPE positions 0..P-1 for P and P.. for the tokens. Only the
real tokens' rows are queried (RowAttention): SWA through the banded kernels of local_attention.py
(blockwise SDPA on CPU, FlexAttention on CUDA; work and memory O(S x W)); each MAC segment through
SDPA under its [L, P + 2L] mask. Deviations from the paper: the convolution sits on the memory's
q, k, v only; the output combination is a plain sigmoid gate; values are l2-normalised like keys
(bounded targets keep the chunked inner optimisation of a deep memory stable); each head's read
is RMS-normalised with its own gains before wo.

Cost model: titans/cost.py. Context parallelism (`context` set on each block): titans/cp.py.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taper.models.init import init_tensor
from megatron_taper.models.layers import Attention, RMSNorm, apply_rope, rope_tables, rope_tables_at
from megatron_taper.models.local_attention import sliding_window_attention
from megatron_taper.models.titans import cp as titans_cp
from megatron_taper.models.titans.neural_memory import ConvPast, NeuralMemory, State
from megatron_taper.models.transformer.model import Transformer, TransformerBlock

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig


class RowAttention(Attention):
    """Attention whose queries are the rows start.. of x and whose keys and values are all its rows,
    through a kernel (q [B, H, S - start, E], k, v [B, K, S, E]) -> [B, H, S - start, E]."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int,
                kernel: Callable[..., torch.Tensor]) -> torch.Tensor:
        """x [B, S, D] -> [B, S - start, D]; cos, sin: RoPE tables of all S rows."""
        bsz, seq, _ = x.shape
        q = apply_rope(self.wq(x[:, start:]).view(bsz, seq - start, -1, self.head_dim), cos[start:], sin[start:])
        k = apply_rope(self.wk(x).view(bsz, seq, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        y = kernel(*(t.transpose(1, 2) for t in (q, k, v)))  # [B, H, S - start, E]
        return self.wo(y.transpose(1, 2).flatten(2))


def context_rows_mask(prefix: int, seg: int, device: torch.device) -> torch.Tensor:
    """[L, P + 2L]: the rows of x_i over [P, h, x]: x_i sees P, h_<=i and x_<=i."""
    i = torch.arange(seg, device=device)[:, None]
    j = torch.arange(prefix + 2 * seg, device=device)[None, :] - prefix
    return (j < 0) | (j % seg <= i)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA under a boolean mask [Sq, Sk] (True = may attend), GQA when K < H: [B, H, Sq, E]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


class TitansBlock(TransformerBlock):
    """Shared parts: memory, persistent tokens, row attention; the variant defines `mix`.
    `window_kernel` is the sliding-window attention kernel (local_attention.py), an attribute so
    that a benchmark can swap in a reference."""

    window_kernel = staticmethod(sliding_window_attention)

    def __init__(self, cfg: ModelConfig, mlp_width: int):
        super().__init__(cfg, mlp_width)
        self.memory = NeuralMemory(cfg)
        self.persistent = nn.Parameter(torch.empty(cfg.titans.persistent_tokens, cfg.d_model))
        self.window = cfg.titans.window
        self.head_dim, self.rope_theta = cfg.head_dim, cfg.rope_theta
        self.context = None  # a contiguous context-parallel split (titans/cp.py), or None

    def build_attention(self, cfg: ModelConfig) -> nn.Module:
        return RowAttention(cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim)

    def with_prefix(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.persistent.to(x.dtype).expand(x.shape[0], -1, -1), x), dim=1)

    def window_attention(self, xp: torch.Tensor, halo: int = 0, first: int = 0) -> torch.Tensor:
        """Sliding-window attention over [P, x] ([B, P + S, D]); outputs of x only: [B, S, D].
        Under context parallelism x is [the `halo` tokens before the slice, the slice], whose
        first token is token `first` of the sequence; outputs of the slice only: [B, S - halo, D]."""
        prefix = self.persistent.shape[0]
        tokens = torch.arange(first - halo, first - halo + xp.shape[1] - prefix, device=xp.device)
        positions = torch.cat((torch.arange(prefix, device=xp.device), prefix + tokens))
        cos, sin = rope_tables_at(positions, self.head_dim, self.rope_theta)
        kernel = functools.partial(self.window_kernel, prefix=prefix, window=self.window)
        return self.attn(xp, cos, sin, prefix, kernel)[:, halo:]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class MAGBlock(TitansBlock):
    def mix(self, xn: torch.Tensor) -> torch.Tensor:
        if self.context is not None:
            return titans_cp.mag_mix(self, xn)
        xp, prefix = self.with_prefix(xn), self.persistent.shape[0]
        reads, _ = self.memory.scan(xp, xp, self.memory.init_state(xn.shape[0]))
        return self.window_attention(xp) * torch.sigmoid(self.memory.output(reads[:, :, prefix:]))


class MALBlock(TitansBlock):
    def __init__(self, cfg: ModelConfig, mlp_width: int):
        super().__init__(cfg, mlp_width)
        self.mem_norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.context is not None:
            return titans_cp.mal_forward(self, x)
        prefix = self.persistent.shape[0]
        xp = self.with_prefix(self.mem_norm(x))
        reads, _ = self.memory.scan(xp, xp, self.memory.init_state(x.shape[0]))
        x = x + self.memory.output(reads[:, :, prefix:])
        x = x + self.window_attention(self.with_prefix(self.attn_norm(x)))
        return x + self.mlp(self.mlp_norm(x))


class MACBlock(TitansBlock):
    def mix(self, xn: torch.Tensor) -> torch.Tensor:
        if self.context is not None:
            return titans_cp.mac_mix(self, xn)
        return self.segments(xn, self.memory.init_state(xn.shape[0]))[0]

    def segments(self, xn: torch.Tensor, state: State, query_past: torch.Tensor | None = None,
                 past: ConvPast = None) -> tuple[torch.Tensor, State, torch.Tensor | None, ConvPast]:
        """The segments of xn [B, S, D] (which start at a segment boundary), from the memory's
        `state` and the convolutions' pasts (None = the sequence starts here): the retrieval
        queries' (`query_past`, last K-1 rows of wq(xn)) and the writes' (`past`, of the y rows).
        Returns the output [B, S, D] and the state and pasts after the last segment."""
        prefix, memory, outs = self.persistent.shape[0], self.memory, []
        queries, query_past = memory.heads(memory.wq, memory.conv_q, xn, query_past)  # [B, H, S, E], convolved
        for s in range(0, xn.shape[1], self.window):
            seg = xn[:, s:s + self.window]  # [B, L, D]
            size = seg.shape[1]
            h = memory.output(memory.read(queries[:, :, s:s + size], state))  # retrieval with M_{s-1}
            ctx = self.with_prefix(torch.cat((h, seg), dim=1))  # [B, P + 2L, D]
            cos, sin = rope_tables(ctx.shape[1], self.head_dim, self.rope_theta, xn.device)
            kernel = functools.partial(masked_attention, mask=context_rows_mask(prefix, size, xn.device))
            y = self.attn(ctx, cos, sin, prefix + size, kernel)  # [B, L, D]
            features, past = memory.project(y, y, past)  # y continues the previous segments' y
            reads, state = memory.scan_features(features, state)
            outs.append(y * torch.sigmoid(memory.output(reads)))
        return torch.cat(outs, dim=1), state, query_past, past


TITANS_BLOCKS = {"mac": MACBlock, "mag": MAGBlock, "mal": MALBlock}


class Titans(Transformer):
    def __init__(self, cfg: ModelConfig):
        self.block_class = TITANS_BLOCKS[cfg.titans.variant]
        super().__init__(cfg)

    def init_value(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """The common rule, except memory weights M_0 ~ N(0, 1 / fan_in) and the convolutions'
        taps [H*E, K]: the identity (1 on the newest tap) plus N(0, init_std)."""
        std = shape[-2] ** -0.5 if ".mem_w." in name else self.cfg.init_std
        value = init_tensor(name, shape, seed, std, self.cfg.n_layers)
        if name.rsplit(".", 1)[-1] in ("conv_q", "conv_k", "conv_v"):
            value[:, -1] += 1.0
        return value
