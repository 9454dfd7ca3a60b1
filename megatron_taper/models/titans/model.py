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

Documents (`doc_start` [B, S], True where a new document begins): every block behaves on each
document as on a sequence of its own. The memory scans the documents packed (titans/documents.py):
each one moved to a chunk boundary behind its own copy of the P persistent tokens (MAG / MAL) or to a
segment boundary (MAC), its first chunk starting from M_0 with zero surprise, its convolutions
seeing nothing before it; the chunk before it hands on M_0 (neural_memory.py reset_terms). The
sliding window sees P and the tokens of its own document, RoPE positions restarting at P for each
document's first token. MAC's segments follow the packed layout, so its retrieval, attention and
writes restart at each document too. Without context parallelism a doc_start with no start after
a row's first token runs the code without documents. Under context parallelism MAG / MAL take the
document path whenever doc_start is given (every rank must send the same message) and hand the
state of the open chunk of the last document along the cp chain (titans/cp.py, Documents); under
parallel.cp_attention=ulysses each rank runs this one-process path on the whole sequence for its
share of the heads (titans/cp.py); MAC refuses a document start under context parallelism.

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
from megatron_taper.models.titans.documents import (
    Packing,
    document_ids,
    document_positions,
    pack_documents,
    starts_inside,
)
from megatron_taper.models.titans.neural_memory import ConvPast, NeuralMemory, State, reset_state
from megatron_taper.models.transformer.model import Transformer, TransformerBlock

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig


class RowAttention(Attention):
    """Attention whose queries are the rows start.. of x and whose keys and values are all its rows,
    through a kernel (q [B, H, S - start, E], k, v [B, K, S, E]) -> [B, H, S - start, E]."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int,
                kernel: Callable[..., torch.Tensor]) -> torch.Tensor:
        """x [B, S, D] -> [B, S - start, D]; cos, sin: RoPE tables of all S rows ([S, E/2], or
        [B, S, E/2] with positions per batch row)."""
        bsz, seq, _ = x.shape
        rotate = apply_rope if cos.dim() == 2 else rope_per_row
        q = rotate(self.wq(x[:, start:]).view(bsz, seq - start, -1, self.head_dim), cos[..., start:, :],
                   sin[..., start:, :])
        k = rotate(self.wk(x).view(bsz, seq, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        y = kernel(*(t.transpose(1, 2) for t in (q, k, v)))  # [B, H, S - start, E]
        return self.wo(y.transpose(1, 2).flatten(2))


def rope_per_row(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope with tables per batch row: x [B, S, H, E], cos, sin [B, S, E/2]."""
    return apply_rope(x.flatten(0, 1)[None], cos.flatten(0, 1), sin.flatten(0, 1)).view_as(x)


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

    def window_attention(self, xp: torch.Tensor, halo: int = 0, first: int = 0,
                         doc_start: torch.Tensor | None = None) -> torch.Tensor:
        """Sliding-window attention over [P, x] ([B, P + S, D]); outputs of x only: [B, S, D].
        Under context parallelism x is [the `halo` tokens before the slice, the slice], whose
        first token is token `first` of the sequence; outputs of the slice only: [B, S - halo, D].
        With `doc_start` [B, S] (no context parallelism) each token sees P and its own document,
        the document's tokens at RoPE positions P, P + 1, ..."""
        if doc_start is not None:
            return self.document_window(xp, document_positions(doc_start), document_ids(doc_start))
        prefix = self.persistent.shape[0]
        tokens = torch.arange(first - halo, first - halo + xp.shape[1] - prefix, device=xp.device)
        positions = torch.cat((torch.arange(prefix, device=xp.device), prefix + tokens))
        cos, sin = rope_tables_at(positions, self.head_dim, self.rope_theta)
        kernel = functools.partial(self.window_kernel, prefix=prefix, window=self.window)
        return self.attn(xp, cos, sin, prefix, kernel)[:, halo:]

    def document_window(self, xp: torch.Tensor, offsets: torch.Tensor, ids: torch.Tensor,
                        halo: int = 0) -> torch.Tensor:
        """Sliding-window attention over [P, x] ([B, P + S, D]) within documents: token offsets in
        their documents and document ids [B, S] (rows of different ids do not see each other; RoPE
        positions P + offset). Outputs of x but its first `halo` rows: [B, S - halo, D]."""
        prefix = self.persistent.shape[0]
        positions = torch.cat((torch.arange(prefix, device=xp.device).expand(xp.shape[0], -1), prefix + offsets), 1)
        cos, sin = rope_tables_at(positions.flatten(), self.head_dim, self.rope_theta)
        cos, sin = (t.view(*positions.shape, -1) for t in (cos, sin))  # [B, P + S, E/2]
        kernel = functools.partial(self.window_kernel, prefix=prefix, window=self.window, doc_ids=ids)
        return self.attn(xp, cos, sin, prefix, kernel)[:, halo:]

    def memory_reads(self, xn: torch.Tensor, doc_start: torch.Tensor | None) -> torch.Tensor:
        """The memory's reads of the tokens of xn [B, S, D] scanned behind the persistent tokens (per
        document when doc_start is given): [B, H, S, E]."""
        prefix = self.persistent.shape[0]
        if doc_start is None:
            xp = self.with_prefix(xn)
            return self.memory.scan(xp, xp, self.memory.init_state(xn.shape[0]))[0][:, :, prefix:]
        packing = pack_documents(doc_start, self.memory.chunk_size, prefix)
        return packing.unpack(self.memory.scan_packed(packing.pack(xn, self.persistent), packing), dim=2)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc_start: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.mix(self.attn_norm(x), doc_start)
        return x + self.mlp(self.mlp_norm(x))


class MAGBlock(TitansBlock):
    def mix(self, xn: torch.Tensor, doc_start: torch.Tensor | None = None) -> torch.Tensor:
        if self.context is not None:
            return titans_cp.mag_mix(self, xn) if doc_start is None else titans_cp.mag_documents(self, xn, doc_start)
        doc_start = starts_inside(doc_start)
        if doc_start is not None:
            return self.window_attention(self.with_prefix(xn), doc_start=doc_start) * torch.sigmoid(
                self.memory.output(self.memory_reads(xn, doc_start)))
        xp, prefix = self.with_prefix(xn), self.persistent.shape[0]
        reads, _ = self.memory.scan(xp, xp, self.memory.init_state(xn.shape[0]))
        return self.window_attention(xp) * torch.sigmoid(self.memory.output(reads[:, :, prefix:]))


class MALBlock(TitansBlock):
    def __init__(self, cfg: ModelConfig, mlp_width: int):
        super().__init__(cfg, mlp_width)
        self.mem_norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc_start: torch.Tensor | None = None) -> torch.Tensor:
        if self.context is not None and doc_start is not None:
            return titans_cp.mal_documents(self, x, doc_start)
        if self.context is not None:
            return titans_cp.mal_forward(self, x)
        doc_start = starts_inside(doc_start)
        x = x + self.memory.output(self.memory_reads(self.mem_norm(x), doc_start))
        x = x + self.window_attention(self.with_prefix(self.attn_norm(x)), doc_start=doc_start)
        return x + self.mlp(self.mlp_norm(x))


class MACBlock(TitansBlock):
    def mix(self, xn: torch.Tensor, doc_start: torch.Tensor | None = None) -> torch.Tensor:
        doc_start = starts_inside(doc_start, self.context, "Titans MAC")
        if doc_start is not None:
            packing = pack_documents(doc_start, self.window)
            out = self.segments(packing.pack(xn), self.memory.init_state(xn.shape[0]), packing=packing)[0]
            return packing.unpack(out)
        if self.context is not None:
            return titans_cp.mac_mix(self, xn)
        return self.segments(xn, self.memory.init_state(xn.shape[0]))[0]

    def segments(self, xn: torch.Tensor, state: State, query_past: torch.Tensor | None = None,
                 past: ConvPast = None, packing: Packing | None = None
                 ) -> tuple[torch.Tensor, State, torch.Tensor | None, ConvPast]:
        """The segments of xn [B, S, D] (which start at a segment boundary), from the memory's
        `state` and the convolutions' pasts (None = the sequence starts here): the retrieval
        queries' (`query_past`, last K-1 rows of wq(xn)) and the writes' (`past`, of the y rows).
        `packing`: xn is packed documents, each starting a segment (titans/documents.py); a segment
        that starts one starts from the initial state, and the convolutions restart there.
        Returns the output [B, S, D] and the state and pasts after the last segment."""
        prefix, memory, outs = self.persistent.shape[0], self.memory, []
        positions = None if packing is None else packing.positions
        queries, query_past = memory.heads(memory.wq, memory.conv_q, xn, query_past, positions)  # [B, H, S, E]
        for s in range(0, xn.shape[1], self.window):
            seg = xn[:, s:s + self.window]  # [B, L, D]
            size = seg.shape[1]
            rows = slice(s, s + size)
            if packing is not None:
                state = reset_state(memory.init_state(xn.shape[0]), state, packing.resets[:, s])
            h = memory.output(memory.read(queries[:, :, s:s + size], state))  # retrieval with M_{s-1}
            ctx = self.with_prefix(torch.cat((h, seg), dim=1))  # [B, P + 2L, D]
            cos, sin = rope_tables(ctx.shape[1], self.head_dim, self.rope_theta, xn.device)
            kernel = functools.partial(masked_attention, mask=context_rows_mask(prefix, size, xn.device))
            y = self.attn(ctx, cos, sin, prefix + size, kernel)  # [B, L, D]
            if packing is None:
                features, past = memory.project(y, y, past)  # y continues the previous segments' y
                reads, state = memory.scan_features(features, state)
            else:
                features, past = memory.project(y, y, past, packing.positions[:, rows])
                reads, state = memory.scan_features(features, state,
                                                    documents=(packing.valid[:, rows], packing.resets[:, rows]))
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
