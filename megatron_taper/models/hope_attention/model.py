"""Hope-attention (Nested Learning, arXiv 2512.24695): attention followed by a Continuum Memory
System (CMS), a chain of MLP levels whose parameters change at different frequencies.

    x = x + attn(norm(x))
    for level l = 0 .. L_cms - 1:
        x = x + M_l(norm_l(x))          M(n) = w2 (silu(w1 n) * w3 n), hidden width w of this block

Online CMS (`model.hope.online=true`, the default). Each level's whole MLP theta = (w1, w3, w2)
also learns inside the sequence, per sequence, at its own frequency: the tokens are cut into
chunks of C_l = chunk_size * chunk_growth**l; chunk c is read with the weights theta^(c) left by
the updates of the chunks before it (so the block stays causal), and at its end, unless it is
the sequence's last chunk,

    theta^(c+1) = theta^(c) - eta_l / (C_l nu_c) sum_{t in c} grad l_t(theta^(c)),
    l_t(theta) = 1/2 ||M_theta(n_t) - n_t||^2          (auto-associative local objective)
    nu_c = mean_{t in c} (||h_t||^2 + 2 ||n_t||^2),   h_t = silu(w1 n_t) * w3 n_t

with n_t = norm_l(x)_t. Step size: eta_l = softplus(raw_step), a learnable scalar per level
initialised at `online_lr`; nu_c, the squared norm of what the three matrices read (h for w2, n
for w1 and w3), makes it a normalised-LMS step whose effect does not depend on the scale of the
activations (which differs by orders of magnitude between model sizes and early training).
The gradient is written in closed form from the chunk's activations (e = (y - n) / C_l,
grad w2 = e^T h, dh = e w2, grad w1 = (dh * w3 n * silu'(w1 n))^T n, grad w3 =
(dh * silu(w1 n))^T n); the updates are differentiable functions of the parameters, so the outer
gradient flows through them. Every update is low rank (C_l rows), so the level runs as one scan
(hope_attention/online.py): chunk c reads w13^(c) as the w13 materialised at the start of its group
of chunks plus products against the earlier chunks' factors (computed for all chunks at once where
they do not depend on the recurrence), w2 is updated in place, and a hand-written backward keeps
n and 3 W + D factor values per updated token, never a [2W, D] or [D, W] fast weight per update.
tests/helpers/hope_reference.py holds the definition (chunked_reference_level: one loop iteration
per chunk on materialised [B, ...] fast weights) and a token-by-token autograd reference.

`model.hope.online=false` is the ablation: a plain chain of residual SwiGLUs that change only
with the outer optimizer. The taper applies to the CMS widths: every level of block i has width
w_i, so tapered and uniform twins have equal parameter counts and FLOPs.

Documents (`doc_start` [B, S], True where a new document begins; context parallelism: cp.py):
attention sees the tokens of the query's own document (layers.py document_mask; RoPE and ALiBi
depend on distances only, so positions need no restart), and every online level runs each
document as a sequence of its own: the documents are folded into the batch (titans/documents.py
`fold_documents`: one row per document, as long as the longest, padded at its end), so each
starts from the level's parameters with its chunks counted from its first token. Folding costs
the padding: R rows of the longest document's length for R documents (at most B documents per
row times the batch). Offline levels (no updates) run unfolded.

Cost terms: hope_attention/cost.py; tensor-parallel plan: hope_attention/parallel.py; context
parallelism: hope_attention/cp.py.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taper.models.decoding import kv_decoder
from megatron_taper.models.hope_attention import cp as hope_cp
from megatron_taper.models.hope_attention.cost import level_period
from megatron_taper.models.hope_attention.fast_weights import LevelComm, SwiGLUActivations, Weights, identity
from megatron_taper.models.hope_attention.online import STEP_EPS, online_scan
from megatron_taper.models.init import RESIDUAL_OUT, init_tensor
from megatron_taper.models.layers import RMSNorm, document_mask
from megatron_taper.models.titans.documents import fold_documents, starts_inside
from megatron_taper.models.transformer.model import Transformer, TransformerBlock

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig


def inner_step(weights: Weights, n: torch.Tensor, acts: SwiGLUActivations, y: torch.Tensor,
               h_sq: torch.Tensor, step: torch.Tensor) -> Weights:
    """The weights after one update on a chunk: closed-form gradients of the local loss
    mean_t 1/2 ||y_t - n_t||^2 (manual backprop through the SwiGLU), the step eta divided by the
    chunk's mean of ||h_t||^2 + 2 ||n_t||^2 (what w2, w1 and w3 read). n, y: [B, C, D]; h_sq:
    ||h_t||^2 [B, C]; step: [1]. Returns [B, ...] weights."""
    w13, w2 = weights
    inputs_sq = (h_sq + 2 * n.square().sum(-1)).mean(1)  # [B]
    scale = step / (n.shape[1] * (inputs_sq + STEP_EPS))  # [B]: the step per unit of summed gradient
    descent = (n - y) * scale[:, None, None]  # minus the step times d loss / d y, [B, C, D]
    dh = descent @ w2  # [B, C, W]
    delta_w2 = descent.transpose(1, 2) @ acts.h  # [B, D, W]
    delta_w13 = torch.cat((dh * acts.dh_da, dh * acts.s), dim=-1).transpose(1, 2) @ n  # [B, 2W, D]
    return w13 + delta_w13, w2 + delta_w2  # (an add: its backward needs no weight-sized negation)


class ContinuumLevel(nn.Module):
    """One CMS level M(n) = w2 (silu(w1 n) * w3 n) of hidden width W, its matrices bare parameters
    (w1, w3 [W, D], w2 [D, W]) so that every engine gathers them with the level. With a `period`
    its weights also learn inside the sequence (module docstring); without, a plain SwiGLU."""

    def __init__(self, d_model: int, width: int, period: int | None):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(width, d_model))
        self.w3 = nn.Parameter(torch.empty(width, d_model))
        self.w2 = nn.Parameter(torch.empty(d_model, width))
        self.period = period
        # eta = softplus(raw_step): the learnable step size of the online updates
        self.raw_step = nn.Parameter(torch.empty(1)) if period else None
        self.comm = LevelComm()
        self.context = None  # a contiguous context-parallel split (hope_attention/cp.py), or None

    def forward(self, n: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        """n: the level's normalised input [B, S, D] -> its output [B, S, D]. `offsets` [B, S]: each
        token's offset in its document, under context parallelism with documents (hope_attention/cp.py)."""
        n = self.comm.enter(n)
        if self.period is None:
            return self.comm.leave_partial(F.linear(F.silu(F.linear(n, self.w1)) * F.linear(n, self.w3), self.w2))
        if offsets is not None and hope_cp.chained(self, n):
            return hope_cp.online_documents(self, n, offsets)
        return self.comm.leave(self.online(n, (torch.cat((self.w1, self.w3)), self.w2)))

    def online(self, n: torch.Tensor, weights: Weights) -> torch.Tensor:
        """Chunk by chunk: read with the weights at the chunk's start, then update them. Under
        context parallelism the slice starts from the weights the slice before it ended with."""
        step = self.comm.reenter(F.softplus(self.raw_step))
        split = self.context
        chained = hope_cp.chained(self, n)
        if chained and split.rank > 0:  # the fast weights of rank r - 1's end: [B, 2W, D], [B, D, W]
            weights = hope_cp.receive_weights(self, weights, n.shape[0])
        # the sequence's last chunk makes no update (nothing reads it); a slice before the last ends with one
        last_updates = chained and split.rank < split.cp - 1
        if n.shape[1] <= self.period and not last_updates:  # one chunk, no update
            acts = SwiGLUActivations.of(n, weights[0])
            out = self.comm.sum_partial(acts.h @ weights[1].transpose(-1, -2))  # partial sums over width shards
            return out + 0.0 * step  # eta still joins the graph for a (zero) gradient, as DDP needs
        sum_partial = None if self.comm.sum_partial is identity else self.comm.sum_partial
        out = online_scan(n, *weights, step, self.period, sum_partial, last_updates)
        if last_updates:  # rank r + 1 starts from these weights (parallel/cp/state.py's chain)
            return hope_cp.send_weights(self, out)
        return out


class HopeAttentionBlock(TransformerBlock):
    def __init__(self, cfg: ModelConfig, mlp_width: int):
        super().__init__(cfg, mlp_width)
        del self.mlp_norm, self.mlp
        hope = cfg.hope
        self.cms_norms = nn.ModuleList(RMSNorm(cfg.d_model, cfg.norm_eps) for _ in range(hope.levels))
        self.cms = nn.ModuleList(
            ContinuumLevel(cfg.d_model, mlp_width, level_period(hope, level) if hope.online else None)
            for level in range(hope.levels))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc_start: torch.Tensor | None = None) -> torch.Tensor:
        if doc_start is not None and self.attn.context is not None and self.attn.context.cp > 1:
            return hope_cp.block_documents(self, x, cos, sin, doc_start)
        doc_start = starts_inside(doc_start)
        if doc_start is None:
            x = x + self.attn(self.attn_norm(x), cos, sin)
            for norm, level in zip(self.cms_norms, self.cms):
                x = x + level(norm(x))
            return x
        xn = self.attn_norm(x)
        x = x + self.attn.project_out(self.attn.attend(xn, cos, sin, document_mask(doc_start)), xn)
        fold = fold_documents(doc_start)  # every document a row of its own
        for norm, level in zip(self.cms_norms, self.cms):
            x = x + (fold.unrows(level(fold.rows(norm(x)))) if level.period else level(norm(x)))
        return x


class HopeAttention(Transformer):
    block_class = HopeAttentionBlock

    def init_value(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """models/init.py's rule (each level's w2 writes into the residual stream), and every online
        level's raw_step at softplus^-1(online_lr)."""
        if name.endswith(".raw_step"):
            eta = self.cfg.hope.online_lr
            return torch.full(shape, eta + math.log(-math.expm1(-eta)))  # log(exp(eta) - 1), stably
        return init_tensor(name, shape, seed, self.cfg.init_std, self.cfg.n_layers, RESIDUAL_OUT + (".w2",))


@dataclass
class OnlineLevelState:
    """One online CMS level while decoding: theta^(c), the weights that read the current chunk
    (w13 [2W, D] and w2 [D, W] until the first update, [B, ...] after), and what that chunk's
    positions so far read: inputs n, activations and outputs y, kept for the update at its end,
    computed with `inner_step` on materialised weights: the weights a full forward's scan reads
    through its low-rank factors, up to rounding (same chunk boundaries: positions are counted from
    the start of the sequence)."""

    weights: Weights
    chunk: list[tuple[torch.Tensor, SwiGLUActivations, torch.Tensor]] = field(default_factory=list)
    filled: int = 0

    def read(self, level: ContinuumLevel, n: torch.Tensor) -> torch.Tensor:
        """The level's output for inputs n [B, T, D] at the next T positions; completes chunks."""
        outs = []
        while n.shape[1]:
            take = min(level.period - self.filled, n.shape[1])
            part, n = n[:, :take], n[:, take:]
            acts = SwiGLUActivations.of(part, self.weights[0])
            y = acts.h @ self.weights[1].transpose(-1, -2)  # [B, take, D]
            outs.append(y)
            self.chunk.append((part, acts, y))
            self.filled += take
            if self.filled == level.period:  # the update the full forward makes at this chunk's end
                parts, pieces, ys = zip(*self.chunk)
                acts = SwiGLUActivations(*(torch.cat(t, dim=1) for t in
                                           zip(*((a.s, a.h, a.dh_da) for a in pieces))))  # [B, C, W] each
                self.weights = inner_step(self.weights, torch.cat(parts, dim=1), acts, torch.cat(ys, dim=1),
                                          acts.h.square().sum(-1), F.softplus(level.raw_step))
                self.chunk, self.filled = [], 0
        return torch.cat(outs, dim=1)


def online_level_states(block: HopeAttentionBlock) -> list[OnlineLevelState | None]:
    """Decoding state of a block's CMS levels (None for a level without updates)."""
    return [OnlineLevelState((torch.cat((level.w1, level.w3)), level.w2)) if level.period else None
            for level in block.cms]


def cms_feedforward(block: HopeAttentionBlock, h: torch.Tensor, states: list[OnlineLevelState | None]
                    ) -> torch.Tensor:
    """The block's CMS levels for the next positions h [B, T, D], online levels from their state."""
    for norm, level, state in zip(block.cms_norms, block.cms, states):
        h = h + (level(norm(h)) if state is None else state.read(level, norm(h)))
    return h


decoder = functools.partial(kv_decoder, block_class=HopeAttentionBlock, feedforward=cms_feedforward,
                            block_state=online_level_states)
