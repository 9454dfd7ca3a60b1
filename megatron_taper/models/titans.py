"""Titans (Behrouz et al. 2024, arXiv 2501.00663): attention plus a neural long-term memory.

Neural memory, per head (H heads of size E), for tokens t = 1..T:
    k_t = l2norm(silu(conv_k(W_k x)_t)), likewise v_t (conv_v, W_v) and q_t (conv_q, W_q)
    conv(z)_t = sum_{j<K} w[:, K-1-j] * z_{t-j}     (depthwise causal, K = `conv_kernel` taps)
    theta_t = max_lr * sigmoid(.), eta_t = sigmoid(. + logit(momentum_init)),
    alpha_t = sigmoid(. + logit(forget_init))                  (one linear map x_t -> [H, 3])
    M(x) = x + f_W(x)                                          (residual memory, f an MLP)
    nu_t = sum_l ||a_l(k_t)||^2   (squared norms of every layer's input at k_t, M_{t-1}; >= ||k_t||^2 = 1)
    S_t = eta_t S_{t-1} - (theta_t / nu_t) grad_W ||M_{t-1}(k_t) - v_t||^2    (surprise, momentum)
    W_t = W_0 + (1 - alpha_t)(W_{t-1} - W_0) + S_t                           (forgetting toward W_0)
    y_t = M_t(q_t)                                                          (read after writing)
f is an MLP E -> (expansion * E) -> ... -> E of `memory_depth` weight matrices with SiLU between
them, its initial weights W_0 are parameters; S_0 = 0. Departures from eq. 13-14 of the paper,
for long sequences (docs/architectures.md): the residual path keeps the read's scale whatever W
holds; forgetting pulls W back to the learned W_0 instead of to 0 (with decay toward 0 a depth-2
memory's read shrank like (1 - alpha)^(2t): 2e-18 of its start at token 2047); the normalised
(NLMS-like) step makes theta_t the fraction of the error a lone write corrects, independent of
the activations' scale.

Chunked parallel form (`chunk_size` C): inside a chunk every gradient is taken at the chunk's
starting state W, grad_i = a_i delta_i^T per memory layer (a_i the layer input, delta_i the
backpropagated error), and nu_i too. The two linear recurrences then unroll to
    W_t = W_0 + B_t (W - W_0) + (sum_j P_tj E_j) S - sum_i c_ti a_i delta_i^T,   c_ti = (theta_i / nu_i) (P Q)_ti,
with P_tj = prod_{j<l<=t} (1 - alpha_l), Q_ji = prod_{i<l<=j} eta_l (from log-space cumsums),
B_t = prod_{l<=t} (1 - alpha_l), E_j = prod_{l<=j} eta_l. Reading f_t(q_t) layer by layer is
then attention-like: r W_t = r W_0 + B_t (r (W - W_0)) + D_t (r S) - ((c * r a^T) delta), never
materialising per-token weights. C = 1 is the exact token-by-token recurrence (tests compare both
with a torch.func reference).

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

Cost model (`titans_layer_cost`): FLOPs count every pair the attention kernels compute, masked or
not, the same with `causal` or without: the blockwise band (P + 2W keys per query, P + W in the
first block, padded rows included; `blockwise_pairs`) for MAG / MAL and L x (P + 2L) per MAC
segment. That is what runs on CPU and what torch's FLOP counter sees; FlexAttention on CUDA
computes the 128-wide kv blocks that meet the window or hold persistent tokens, about W + 128 to
W + 256 keys per query plus the persistent tokens' block: fewer than the band when W is large
(W = 512: ~0.8x), more when it is small (W = 64: ~3x).

Context parallelism (`context` set on each block): models/titans_cp.py.
"""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taper.cost.block import Cost, Split, attention_cost, norm_act, swiglu_cost
from megatron_taper.models import titans_cp
from megatron_taper.models.cards import TITANS
from megatron_taper.models.init import init_tensor
from megatron_taper.models.layers import Attention, RMSNorm, apply_rope, rope_tables, rope_tables_at
from megatron_taper.models.local_attention import blockwise_pairs, sliding_window_attention
from megatron_taper.models.spec import FamilySpec
from megatron_taper.models.transformer import Transformer, TransformerBlock, tp_plan_transformer_block
from megatron_taper.validation import ConfigError

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig, ParallelConfig
    from megatron_taper.parallel.tp_plan import TPBuilder


State = tuple[list[torch.Tensor], list[torch.Tensor]]  # (memory weights, surprise), each [B, H, i, o]
# k, v, q [B, H, T, E]; theta, log eta, log (1 - alpha) [B, H, T]
Features = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
ConvPast = tuple[torch.Tensor, ...] | None  # per convolved projection (k, v, q) its last K-1 inputs [B, K-1, H*E]
# (layer, that layer's input r [B, H, C, i], its read r M_t [B, H, C, o], positions=slice of the C tokens in
# the scan) -> the pre-activation that continues the read; Memory Caching's soup mixes cached memories in here
ReadMix = Callable[..., torch.Tensor]


def memory_dims(head_dim: int, depth: int, expansion: int) -> list[int]:
    return [head_dim] + [expansion * head_dim] * (depth - 1) + [head_dim]


def mlp_read(q: torch.Tensor, state: State) -> torch.Tensor:
    """f(q), the memory MLP with the weights of `state` (SiLU between layers) at q [B, H, T, E]."""
    r = q
    for layer, w in enumerate(state[0]):
        r = r @ w
        r = F.silu(r) if layer < len(state[0]) - 1 else r
    return r


def silu_grad(z: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


def causal_conv(x: torch.Tensor, weight: torch.Tensor | None,
                past: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal convolution along time, y_t = sum_j weight[:, j] x_{t-K+1+j}: x [B, T, C],
    weight [C, K] (None = identity), past [B, K-1, C] the inputs before x (zeros when None).
    Returns y [B, T, C] and the last K-1 inputs, the next call's past."""
    if weight is None:
        return x, None
    taps = weight.shape[1]
    if past is None:
        past = x.new_zeros(x.shape[0], taps - 1, x.shape[2])
    padded = torch.cat((past, x), dim=1)  # [B, K-1+T, C]
    y = F.conv1d(padded.transpose(1, 2), weight.to(x.dtype).unsqueeze(1), groups=weight.shape[0])
    return y.transpose(1, 2), padded[:, padded.shape[1] - (taps - 1):]


class NeuralMemory(nn.Module):
    """Per-head MLP memory written and read inside the forward pass (see the module docstring)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        t, d, h, e = cfg.titans, cfg.d_model, cfg.n_heads, cfg.head_dim
        self.head_dim, self.chunk_size, self.max_lr = e, t.chunk_size, t.max_lr
        self.eta_offset = math.log(t.momentum_init / (1 - t.momentum_init))
        self.alpha_offset = math.log(t.forget_init / (1 - t.forget_init))
        self.wq = nn.Linear(d, h * e, bias=False)
        self.wk = nn.Linear(d, h * e, bias=False)
        self.wv = nn.Linear(d, h * e, bias=False)
        for name in ("conv_q", "conv_k", "conv_v"):  # depthwise taps [H*E, K], oldest first
            self.register_parameter(name, nn.Parameter(torch.empty(h * e, t.conv_kernel)) if t.conv_kernel else None)
        self.gates = nn.Linear(d, h * 3, bias=True)  # head-major [H, (theta, eta, alpha)]
        dims = memory_dims(e, t.memory_depth, t.memory_expansion)
        self.mem_w = nn.ParameterList(nn.Parameter(torch.empty(h, i, o)) for i, o in zip(dims[:-1], dims[1:]))
        self.out_norm_weight = nn.Parameter(torch.ones(h * e))  # RMSNorm of each head's read, per-head gains
        self.wo = nn.Linear(h * e, d, bias=False)
        self.eps = cfg.norm_eps

    def heads(self, proj: nn.Linear, conv: torch.Tensor | None, x: torch.Tensor,
              past: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, T, D] -> l2norm(silu(conv(proj x))) as [B, H, T, E], and the convolution's past."""
        z, past = causal_conv(proj(x), conv, past)
        return F.normalize(F.silu(z).unflatten(-1, (-1, self.head_dim)).transpose(1, 2), dim=-1), past

    def project(self, x_kv: torch.Tensor, x_q: torch.Tensor, past: ConvPast = None) -> tuple[Features, ConvPast]:
        """k, v, q, theta, log eta, log (1 - alpha) of x_kv / x_q [B, T, D], which continue the
        sequences whose convolution inputs `past` holds (None = they start here); and the new past."""
        pk, pv, pq = past or (None, None, None)
        k, pk = self.heads(self.wk, self.conv_k, x_kv, pk)
        v, pv = self.heads(self.wv, self.conv_v, x_kv, pv)
        q, pq = self.heads(self.wq, self.conv_q, x_q, pq)
        g = self.gates(x_kv).unflatten(-1, (-1, 3)).permute(3, 0, 2, 1)  # [3, B, H, T]
        theta = self.max_lr * torch.sigmoid(g[0])
        log_eta = F.logsigmoid(g[1] + self.eta_offset)
        log_keep = F.logsigmoid(-(g[2] + self.alpha_offset))
        return (k, v, q, theta, log_eta, log_keep), (None if pk is None else (pk, pv, pq))

    def init_state(self, batch: int) -> State:
        weights = [w.unsqueeze(0).expand(batch, -1, -1, -1) for w in self.mem_w]
        return weights, [torch.zeros_like(w) for w in weights]

    def output(self, reads: torch.Tensor) -> torch.Tensor:
        """reads [B, H, T, E] -> [B, T, D]."""
        r = F.rms_norm(reads.transpose(1, 2), (self.head_dim,), eps=self.eps)  # [B, T, H, E]
        return self.wo((r * self.out_norm_weight.view(-1, self.head_dim)).flatten(2))

    def read(self, q: torch.Tensor, state: State) -> torch.Tensor:
        """M(q) = q + f(q) of queries q [B, H, T, E] with the memory frozen at `state` (no writes)."""
        return q + mlp_read(q, state)

    def scan(self, x_kv: torch.Tensor, x_q: torch.Tensor, state: State,
             chunk_size: int | None = None) -> tuple[torch.Tensor, State]:
        """Write k_t, v_t and read M_t(q_t) for every token of x_kv / x_q [B, T, D] (sequences that
        start here), chunk by chunk: ([B, H, T, E], state)."""
        return self.scan_features(self.project(x_kv, x_q)[0], state, chunk_size)

    def scan_features(self, features: Features, state: State, chunk_size: int | None = None,
                      mix: ReadMix | None = None, whole_chunks: bool = False) -> tuple[torch.Tensor, State]:
        """`scan` from projected features (`project`): ([B, H, T, E], state). `mix`, when given,
        replaces each memory layer's pre-activation read (see ReadMix). `whole_chunks`: the state
        returned is the one after the last whole chunk (a trailing partial chunk is read, not written)."""
        k, v, q, theta, log_eta, log_keep = features
        size, total = chunk_size or self.chunk_size, k.shape[2]
        reads = []
        for s in range(0, total, size):
            c = slice(s, s + size)
            read, written = self.chunk(state, k[:, :, c], v[:, :, c], q[:, :, c], theta[..., c], log_eta[..., c],
                                       log_keep[..., c], None if mix is None else functools.partial(mix, positions=c))
            state = state if whole_chunks and s + size > total else written
            reads.append(read)
        return torch.cat(reads, dim=2), state

    def chunk(self, state: State, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, theta: torch.Tensor,
              log_eta: torch.Tensor, log_keep: torch.Tensor,
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
            a, d, init = acts[layer], deltas[layer], self.mem_w[layer].to(r.dtype)
            read = (r @ init + keep_w * (r @ (weights[layer] - init)) + keep_s * (r @ surprise[layer])
                    - (coef * (r @ a.transpose(-1, -2))) @ d)
            r = read if mix is None else mix(layer, r, read)
            r = F.silu(r) if layer < n - 1 else r

        last = coef[..., -1, :, None]  # [B, H, C, 1]
        s_coef = (theta * (le[..., -1:] - le).exp())[..., None]
        new_w, new_s = [], []
        for layer in range(n):
            a_t, d, init = acts[layer].transpose(-1, -2), deltas[layer], self.mem_w[layer].to(q.dtype)
            new_w.append(init + keep_w[..., -1:, :] * (weights[layer] - init) + keep_s[..., -1:, :] * surprise[layer]
                         - a_t @ (last * d))
            new_s.append(le[..., -1:, None].exp() * surprise[layer] - a_t @ (s_coef * d))
        return q + r, (new_w, new_s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.scan(x, x, self.init_state(x.shape[0]))[0])


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
        self.context = None  # a contiguous context-parallel split (models/titans_cp.py), or None

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


# ---------------------------------------------------------------------------------------------
# Cost model: counts exactly the matmuls above (FLOPs per real token, 2 per multiply-add).


def memory_params(cfg: ModelConfig) -> int:
    d, h, e, t = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.titans
    dims = memory_dims(e, t.memory_depth, t.memory_expansion)
    return (4 * d * h * e + 3 * d * h + 3 * h + h * sum(i * o for i, o in zip(dims[:-1], dims[1:])) + h * e
            + 3 * h * e * t.conv_kernel)


def scan_flops(cfg: ModelConfig, tokens: int) -> float:
    """Projections, chunked writes and reads of `tokens` tokens, output projection included."""
    d, h, e, t = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.titans
    dims = memory_dims(e, t.memory_depth, t.memory_expansion)
    io = [i * o for i, o in zip(dims[:-1], dims[1:])]
    total = tokens * 2 * (4 * d * h * e + 3 * d * h + 3 * h * e * t.conv_kernel)  # wq, wk, wv, wo, gates, convs
    for s in range(0, tokens, t.chunk_size):
        c = min(t.chunk_size, tokens - s)
        per_head = 2 * c * (sum(io) + sum(io[1:]))  # forward on keys, backward of deltas
        per_head += 2 * c**3 + 2 * c**2  # coefficients P Q, P E
        per_head += sum(2 * c * (3 * x) + 2 * c * c * (i + o) for x, i, o in zip(io, dims[:-1], dims[1:]))  # reads
        per_head += sum(2 * c * 2 * x for x in io)  # new weights and surprise
        total += h * per_head
    return total


def row_attention_flops(cfg: ModelConfig, q_rows: int, kv_rows: int, pairs: float) -> float:
    """RowAttention: wq and wo on `q_rows` rows, wk and wv on `kv_rows` rows, scores and values
    of `pairs` (query, key) pairs per head."""
    d, h, k, e = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    return 4 * q_rows * d * h * e + 4 * kv_rows * d * k * e + 4 * h * e * pairs


def titans_layer_cost(cfg: ModelConfig, width: int, causal: bool = True) -> Cost:
    d, h, k, e, t, s = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.titans, cfg.seq_len
    p = t.persistent_tokens
    attn_params = d * h * e + 2 * d * k * e + h * e * d
    params = attn_params + memory_params(cfg) + p * d + 2 * d + (d if t.variant == "mal" else 0)
    # attention: every pair its kernel computes, masked or not, whether `causal` or not (the
    # blockwise band for MAG / MAL, the [L, P + 2L] rows of each MAC segment)
    if t.variant in ("mag", "mal"):
        rows = p + s
        flops = row_attention_flops(cfg, s, rows, blockwise_pairs(s, p, t.window)) + scan_flops(cfg, rows)
        flops -= 2 * p * h * e * d  # the memory's output projection runs on the real tokens only
    else:
        flops = 0.0
        for start in range(0, s, t.window):
            seg = min(t.window, s - start)
            dims = memory_dims(e, t.memory_depth, t.memory_expansion)
            read = seg * (2 * d * h * e + 2 * h * e * t.conv_kernel + 2 * h * e * d  # queries, wo
                          + h * sum(2 * i * o for i, o in zip(dims[:-1], dims[1:])))
            flops += row_attention_flops(cfg, seg, p + 2 * seg, seg * (p + 2 * seg)) + read + scan_flops(cfg, seg)
    mlp = swiglu_cost(cfg, width)
    tp_params = Split(whole=params - attn_params - memory_params(cfg) - d, heads=memory_params(cfg) + 2 * d * h * e,
                      kv=2 * d * k * e) + mlp.params_split
    backward = attention_cost(cfg).backward + mlp.backward
    return Cost(params + width * 3 * d, flops / s + mlp.flops, tp_params=tp_params,
                act=titans_mixer_act(cfg) + mlp.act, backward=backward)


def scan_act_per_row(cfg: ModelConfig, rows: int) -> float:
    """Elements one head of the neural memory keeps for backward per row it scans (`rows` rows):
    the memory weights and surprise of every chunk but the first one's weights (views of M_0), the
    weights' differences from M_0 (read and update), and per row its keys, queries, values, gates,
    step norms and per-layer activations and deltas, and the chunk's [C, C] decay / momentum /
    coefficient products. Counted from torch's saved tensors (the constants 4.9 and 2.2 of the
    state terms, 14, 17 and 4.5 + 2 * depth are fitted to what NeuralMemory.scan saves)."""
    t, e = cfg.titans, cfg.head_dim
    dims = memory_dims(e, t.memory_depth, t.memory_expansion)
    state = sum(i * o for i, o in zip(dims[:-1], dims[1:]))
    return (4.9 * state / t.chunk_size + 2.2 * state / rows + 14 * (sum(dims[1:-1]) + e) + 17
            + (4.5 + 2 * t.memory_depth) * t.chunk_size)


def titans_mixer_act(cfg: ModelConfig) -> Split:
    """Elements per real token the mixer (norms, persistent prefix, memory, attention, gate) keeps
    for backward. The memory scan is counted as above; the rest (attention over the prefixed rows,
    the memory's read-out norm and gate) as c * d + k * H * (hidden memory widths), with (c, k)
    (17.2, 2.25) for MAG, (18.2, 2.25) for MAL and (31, 4.5) for MAC, matched to torch's saved
    tensors (tests/cost/test_memory_model.py checks the whole block within 10%)."""
    t, d, h, s = cfg.titans, cfg.d_model, cfg.n_heads, cfg.seq_len
    hidden = h * sum(memory_dims(cfg.head_dim, t.memory_depth, t.memory_expansion)[1:-1])
    if t.variant == "mac":
        rows, scan = s, h * scan_act_per_row(cfg, min(t.window, s))  # the memory writes y, segment by segment
        rest = 31 * d + 4.5 * hidden
    else:
        rows = s + t.persistent_tokens
        scan = h * scan_act_per_row(cfg, rows) * rows / s
        rest = (17.2 + (t.variant == "mal")) * d + 2.25 * hidden
    norm = norm_act(d)
    prefixed = d * rows / s  # [P, norm(x)] (the input of every projection)
    return norm + Split(whole=prefixed, heads=scan + rest - norm.total - prefixed)


# ---------------------------------------------------------------------------------------------
# Tensor parallelism: attention and MLP as in the Transformer; the neural memory is split by head
# (each rank runs the memories of its heads: wq/wk/wv/gates column-parallel, each entering the tp
# region itself, M_0 and the per-head read-norm gains sliced along the head dimension, wo
# row-parallel). Persistent tokens are replicated.


def tp_plan_titans_block(block: TitansBlock, prefix: str, cfg: ModelConfig, tp: TPBuilder) -> None:
    tp_plan_transformer_block(block, prefix, cfg, tp)
    if isinstance(block, MALBlock):
        tp.replicated(block.mem_norm, f"{prefix}.mem_norm")
    tp_plan_memory(block.memory, f"{prefix}.memory", cfg, tp)


def tp_plan_memory(memory: nn.Module, mp: str, cfg: ModelConfig, tp: TPBuilder) -> None:
    """A per-head memory with wq/wk/wv/gates (head-major rows), wo, out_norm_weight, optional
    mem_w and conv taps (NeuralMemory, and memory_caching.LinearMemory), split by head."""
    e, heads = cfg.head_dim, cfg.n_heads
    rows = tp.head_rows(heads, e)
    for attr in ("wq", "wk", "wv"):
        tp.column(memory, attr, mp, rows, input_mode="copy")
    tp.column(memory, "gates", mp, tp.head_rows(heads, memory.gates.out_features // heads), input_mode="copy")
    tp.row(memory, "wo", mp, tp.head_columns(heads, e))
    for i in range(len(getattr(memory, "mem_w", ()))):
        tp.shard_parameter(memory.mem_w, str(i), f"{mp}.mem_w", tp.head_rows(heads, 1))
    tp.shard_parameter(memory, "out_norm_weight", mp, rows)
    for attr in ("conv_q", "conv_k", "conv_v"):
        if getattr(memory, attr) is not None:  # depthwise: each rank keeps its heads' channels
            tp.shard_parameter(memory, attr, mp, rows)


def check_titans_layout(mcfg: ModelConfig, pcfg: ParallelConfig) -> None:
    if pcfg.tp > 1 and pcfg.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel is not supported for model.arch='titans' (the memory "
                          "and the persistent tokens need the whole sequence); set it to false")
    titans_cp.check_cp_layout(mcfg, pcfg)


SPECS = (FamilySpec(card=TITANS, build=Titans, layer_cost=titans_layer_cost, tp_block_plan=tp_plan_titans_block,
                    check_layout=check_titans_layout, context_parallel=True, cp_balanced=False,
                    cp_messages=titans_cp.cp_messages),)
