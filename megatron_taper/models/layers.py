"""Building blocks shared by every family: RMSNorm, RoPE, ALiBi, causal attention (optionally
restricted to the documents of a packed window), SwiGLU MLP.

Shapes: B batch, S sequence, D d_model, H query heads (local to this rank when tensor-parallel
plans replace the projections), K key/value heads, E head_dim, W MLP width.
Modules read their local head counts from tensor shapes, so tensor-parallel plans can swap the
projections for sharded ones without touching this code.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taper.models.documents import flex_document_attention
from megatron_taper.models.local_attention import flex_attention_available


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [S, E/2] in float32, at positions 0..S-1."""
    return rope_tables_at(torch.arange(seq_len, device=device), head_dim, theta)


def rope_tables_at(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [S, E/2] in float32 at the given token positions [S]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = torch.outer(positions.to(torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, S, H, E]; rotates (even, odd) pairs of the head dimension."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # [B, S, H, E/2] each
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


def alibi_slopes(n_heads: int, first: int, count: int, device: torch.device) -> torch.Tensor:
    """ALiBi slopes 2^(-8h/H) of the global heads h = first+1 .. first+count of H = n_heads: [count] float32."""
    heads = torch.arange(first + 1, first + count + 1, device=device, dtype=torch.float32)
    return torch.exp2(-8.0 * heads / n_heads)


def alibi_bias(slopes: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Additive causal bias [H, S, S] in float32: -slope_h * (i - j) for keys j <= query i, -inf for j > i."""
    pos = torch.arange(seq_len, device=slopes.device)
    return causal_mask_at(pos, pos, slopes)


def causal_mask_at(q_pos: torch.Tensor, k_pos: torch.Tensor, slopes: torch.Tensor | None = None) -> torch.Tensor:
    """The causal mask of queries at positions q_pos [Sq] over keys at k_pos [Sk] (any order):
    boolean [Sq, Sk] (True = may attend: k_pos <= q_pos), or with ALiBi `slopes` [H] the additive
    bias [H, Sq, Sk] in float32 (-slope_h * distance, -inf where it may not attend)."""
    distance = (q_pos[:, None] - k_pos[None, :]).to(torch.float32)  # [Sq, Sk]: i - j
    if slopes is None:
        return distance >= 0
    return (-slopes[:, None, None] * distance).masked_fill(distance < 0, float("-inf"))


def document_ids(doc_start: torch.Tensor) -> torch.Tensor:
    """doc_start [B, S] bool (True where a document begins) -> [B, S] int32: each token's document
    index in the window (cumulative count of starts; 0 before the first start). Tokens with equal
    ids are one document; what precedes position 0 counts as position 0's document."""
    return doc_start.cumsum(1, dtype=torch.int32)


def same_document(q_ids: torch.Tensor, k_ids: torch.Tensor) -> torch.Tensor:
    """Boolean [B, 1, Sq, Sk] (True = the same document) of queries with document ids q_ids [B, Sq]
    over keys with ids k_ids [B, Sk]; broadcasts over the heads."""
    return (q_ids[:, :, None] == k_ids[:, None, :])[:, None]


def within_documents(mask: torch.Tensor, ids: torch.Tensor | None, q_pos: torch.Tensor,
                     k_pos: torch.Tensor) -> torch.Tensor:
    """`mask` (boolean [Sq, Sk] or ALiBi's additive [H, Sq, Sk], causal_mask_at) of queries at q_pos
    over keys at k_pos, restricted to pairs in one document when `ids` [B, S] (document_ids, position
    order) is given: [B, 1 or H, Sq, Sk]."""
    if ids is None:
        return mask
    same = same_document(ids[:, q_pos], ids[:, k_pos])  # [B, 1, Sq, Sk]
    return mask & same if mask.dtype == torch.bool else mask.masked_fill(~same, float("-inf"))


def document_mask(doc_start: torch.Tensor) -> torch.Tensor:
    """The causal mask restricted to documents: boolean [B, 1, S, S] (True = may attend: key j <=
    query i and both in one document) of doc_start [B, S]."""
    ids = document_ids(doc_start)
    pos = torch.arange(doc_start.shape[1], device=doc_start.device)
    return same_document(ids, ids) & causal_mask_at(pos, pos)


class Attention(nn.Module):
    """Causal self-attention through SDPA, with grouped-query attention when K < H.

    `position`: rope (q and k rotated by the cos/sin tables forward receives) or alibi (no
    rotation; an additive bias -slope_h * distance per head, slopes of the *global* head index:
    a tensor-parallel plan sets `first_head` to the first head this rank holds).
    `context`: None, or the sequence split of context parallelism (parallel/cp/split.py
    sets it): this rank holds a slice of the sequence at the positions the split names, and the
    split's `attend(q, k, v, slopes, doc_start)` attends over the whole sequence.
    `doc_start` (data.document_mask; [B, S] bool, True where a document begins): each query sees
    only the keys of its own document (document_ids). RoPE on CUDA with FlexAttention: a block
    mask built from the document ids (models/documents.py), so fully masked key blocks are
    skipped; otherwise SDPA under the boolean mask [B, 1, S, S] (document_mask), ALiBi's bias
    masked alike. doc_start=None is the plain causal path, unchanged.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, position: str = "rope"):
        super().__init__()
        assert position in ("rope", "alibi"), position
        self.head_dim = head_dim
        self.position = position
        self.total_heads = n_heads  # the model's query heads, whatever this rank holds
        self.first_head = 0
        self.context = None
        self.wq = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, d_model, bias=False)

    def attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None,
               doc_start: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Per-head outputs before the output projection: [B, S, H, E]. Causal, or under a boolean
        mask [S, S] or [B, 1, S, S] (True = may attend) when one is given; with doc_start [B, S] also
        only within each query's document. Under context parallelism `doc_ids` [B, S] (the whole
        sequence's document ids, from a caller that gathered its starts already) replaces doc_start."""
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.position == "rope":
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H|K, S, E]
        if self.context is not None:
            assert mask is None, "context parallelism splits causal attention only"
            slopes = (alibi_slopes(self.total_heads, self.first_head, q.shape[1], x.device)
                      if self.position == "alibi" else None)
            return self.context.attend(q, k, v, slopes, doc_start, doc_ids).transpose(1, 2)
        if doc_start is not None:
            if mask is None and self.position == "rope" and q.is_cuda and flex_attention_available():
                return flex_document_attention(q, k, v, document_ids(doc_start)).transpose(1, 2)
            if mask is None:
                mask = document_mask(doc_start)  # [B, 1, S, S]
            else:
                ids = document_ids(doc_start)
                mask = same_document(ids, ids) & mask
        if self.position == "alibi":
            bias = alibi_bias(alibi_slopes(self.total_heads, self.first_head, q.shape[1], x.device), seq)
            if mask is not None:
                bias = bias.masked_fill(~mask, float("-inf"))
            mask = bias.to(q.dtype)  # [H, S, S] (or [B, H, S, S] with documents), broadcast over the batch
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=q.shape[1] != k.shape[1])
        return y.transpose(1, 2)

    def project_out(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The output projection of the per-head outputs y [B, S, H, E] of the block input x [B, S, D]."""
        return self.wo(y.flatten(2))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc_start: torch.Tensor | None = None) -> torch.Tensor:
        return self.project_out(self.attend(x, cos, sin, doc_start=doc_start), x)


def sdpa_backend(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, alibi: bool = False) -> str:
    """The kernel torch's scaled_dot_product_attention picks for Attention's call on q [batch, heads,
    seq, head_dim] and k, v [batch, kv_heads, seq, head_dim] in `dtype` on `device` (causal, or under
    an additive [heads, seq, seq] bias with `alibi`): flash_attention, efficient_attention,
    cudnn_attention, math, ... (torch.nn.attention.SDPBackend's name, lower case)."""
    from torch.nn.attention import SDPBackend

    q = torch.empty(batch, heads, seq, head_dim, dtype=dtype, device=device)
    kv = torch.empty(batch, kv_heads, seq, head_dim, dtype=dtype, device=device)
    mask = torch.empty(heads, seq, seq, dtype=dtype, device=device) if alibi else None
    choice = torch._fused_sdp_choice(q, kv, kv, mask, 0.0, not alibi, enable_gqa=kv_heads != heads)
    return SDPBackend(choice).name.lower()


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x) with hidden width W (this layer's tapered width).

    `fused` (model.fused_swiglu): the gate and up projections as one [2W, D] weight `w13` (one
    GEMM), its rows interleaved per hidden unit: rows 2i and 2i + 1 are w1's and w3's row i
    (fuse_gate_up). So any contiguous range of hidden units is a contiguous range of rows, and a
    tensor-parallel rank's slice holds the gate and up rows of the same units at every tp size.
    """

    def __init__(self, d_model: int, width: int, fused: bool = False):
        super().__init__()
        if fused:
            self.w13 = nn.Linear(d_model, 2 * width, bias=False)
        else:
            self.w1 = nn.Linear(d_model, width, bias=False)
            self.w3 = nn.Linear(d_model, width, bias=False)
        self.w2 = nn.Linear(width, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "w13"):
            gate, up = self.w13(x).unflatten(-1, (-1, 2)).unbind(-1)  # [..., 2W] -> 2 x [..., W]
            return self.w2(F.silu(gate) * up)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


FUSED_GATE_UP = "w13.weight"  # SwiGLU's fused weight; its unfused pair is GATE_UP
GATE_UP = ("w1.weight", "w3.weight")


def fuse_gate_up(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """[W, ...] gate and up rows -> the fused [2W, ...] weight (rows interleaved: w1[i], w3[i])."""
    return torch.stack((w1, w3), dim=1).flatten(0, 1)


def split_gate_up(w13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of fuse_gate_up: (w1, w3), each [W, ...]."""
    w1, w3 = w13.unflatten(0, (-1, 2)).unbind(1)
    return w1.contiguous(), w3.contiguous()


IGNORE_INDEX = -100  # a target with this id adds no loss and no gradient (F.cross_entropy's default)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss in float32 over the targets != IGNORE_INDEX (NaN when there are none);
    logits [B, S, V], targets [B, S]."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), ignore_index=IGNORE_INDEX)
