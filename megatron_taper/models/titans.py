"""Titans (Behrouz et al. 2024, arXiv 2501.00663): attention plus a neural long-term memory.

Neural memory: models/neural_memory.py (NeuralMemory, its chunked parallel form and the causal
convolution on its q, k, v; re-exported here).

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
from megatron_taper.models.neural_memory import (  # noqa: F401 (re-exported)
    ConvPast,
    Features,
    NeuralMemory,
    ReadMix,
    State,
    causal_conv,
    memory_dims,
    mlp_read,
)
from megatron_taper.models.spec import FamilySpec
from megatron_taper.models.transformer import Transformer, TransformerBlock, tp_plan_transformer_block
from megatron_taper.validation import ConfigError

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig, ParallelConfig
    from megatron_taper.parallel.tp_plan import TPBuilder


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
    """Projections, chunked writes and reads of `tokens` tokens, output projection included. A
    trailing partial chunk is padded to C tokens (neural_memory.py) and, when there is one, every
    chunk computes the last row of P Q over its real tokens apart (2 C^2)."""
    d, h, e, t = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.titans
    dims = memory_dims(e, t.memory_depth, t.memory_expansion)
    io = [i * o for i, o in zip(dims[:-1], dims[1:])]
    total = tokens * 2 * (4 * d * h * e + 3 * d * h + 3 * h * e * t.conv_kernel)  # wq, wk, wv, wo, gates, convs
    c = min(t.chunk_size, tokens)
    count = -(-tokens // c) if tokens else 0
    per_head = 2 * c * (sum(io) + sum(io[1:]))  # forward on keys, backward of deltas
    per_head += 2 * c**3 + 2 * c**2  # coefficients P Q, P E
    per_head += sum(2 * c * (3 * x) + 2 * c * c * (i + o) for x, i, o in zip(io, dims[:-1], dims[1:]))  # reads
    per_head += sum(2 * c * 2 * x for x in io)  # new weights and surprise
    per_head += 2 * c**2 if count * c > tokens else 0  # the last row of P Q over the real tokens
    return total + h * count * per_head


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


def scan_act_per_row(cfg: ModelConfig, rows: int, size: int | None = None) -> float:
    """Elements one head of the neural memory keeps for backward per row of one scan of `rows`
    rows in chunks of `size` (default model.titans.chunk_size; one chunk of all rows when fewer):
    the memory weights and surprise each chunk starts from and writes, the starting state, and per
    padded row its keys, queries, values, gates, step norms, per-layer activations and deltas and
    the chunk's [C, C] decay / momentum / coefficient products. Counted from torch's saved tensors
    (the constants 4.0 and 0.9 of the state terms, 9.2, 14.2, -46.6 and 5 * depth are fitted to what
    NeuralMemory.scan_features saves: the write loop's hand-written backward keeps per hidden unit
    its pre-activation, delta' W^T product and input)."""
    t, e = cfg.titans, cfg.head_dim
    dims = memory_dims(e, t.memory_depth, t.memory_expansion)
    state = sum(i * o for i, o in zip(dims[:-1], dims[1:]))
    size = min(size or t.chunk_size, rows)
    chunks = -(-rows // size)
    per_padded_row = 9.2 * sum(dims[1:-1]) + 14.2 * e - 46.6 + 5.0 * t.memory_depth * size
    return (4.0 * state * chunks + 0.9 * state + per_padded_row * chunks * size) / rows


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
