"""All-to-all (Ulysses) context parallelism: sequence-sharded <-> head-sharded, for attention.

parallel.cp_attention=ulysses (DeepSpeed Ulysses, Megatron-core's a2a context parallelism). Each cp
rank holds its slice of the sequence for all heads; attention needs the whole sequence but each
head only its own, so one all-to-all hands every rank the whole sequence for its share of the heads,
attention runs there as in one process (causal, no mask over gathered keys), and a second
all-to-all returns the outputs to the ranks holding their tokens:

    q [B, s, H, E], k, v [B, s, K, E]  (s = S / cp, this rank's tokens, RoPE at their true positions)
      (where K does not divide by cp, each kv head is repeated cp / gcd(K, cp) times first, to
       K' = lcm(K, cp) heads, so that every rank gets whole kv heads for its query heads)
      -> all-to-all of [cp, B, s, (H + 2 K') / cp, E]  (piece j to cp rank j: its heads)
      -> [B, S, H / cp | K / cp, E]: every rank's slice of those heads, put back in sequence order
         (the load-balanced split's chunks r and 2 cp - 1 - r are reordered; the contiguous one is
         already in order)
    causal attention of the whole sequence for heads [r H / cp, (r + 1) H / cp) (kv heads likewise:
    grouped-query attention keeps its pairing; ALiBi takes those heads' slopes); the repeated kv
    heads' gradients sum back into their kv head
      (data.document_mask: only keys of the query's document, by the document ids of the whole
       sequence in its order, SequenceSplit.document_ids: the ranks' doc_start [B, s] all-gathered,
       uint8, B s bytes per rank; SDPA under the boolean mask [B, 1, S, S] (ALiBi: the bias set to
       -inf outside the document, [B, H / cp, S, S]), on CUDA with RoPE FlexAttention under the
       block mask of the ids, models/documents.py, as one process does)
      -> out [B, S, H / cp, E] -> back to rank order -> all-to-all of [cp, B, s, H / cp, E]
      -> [B, s, H, E] at this rank's tokens
    backward: the same two all-to-alls in reverse order on the gradients (an all-to-all of
    [cp, ...] along dim 0 is its own inverse: `_AllToAll`)

Bytes per attention layer and micro-batch, per rank: forward two all-to-alls whose buffers hold
B s (H + 2 K') E and B s H E elements, of which (cp - 1) / cp leave the rank; backward as many
(cost/cp.py ulysses_bytes). Memory: the head-sharded q, k, v and output [B, S, H / cp, E] that
attention keeps are as large as the rank's own slice of them (k, v: K' / K times where kv heads are
repeated); no K and V of the whole sequence. Under an explicit mask (ALiBi, documents) the CPU's
SDPA has no fused kernel and keeps the weights [B, H / cp, S, S] and the mask, as one process's
SDPA does (cost/memory.py counts neither). The query heads per tp rank must divide by cp
(cost/preflight.py refuses otherwise).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_taper.models.documents import flex_document_attention
from megatron_taper.models.layers import causal_mask_at, within_documents
from megatron_taper.models.local_attention import flex_attention_available

if TYPE_CHECKING:
    from megatron_taper.parallel.cp.split import SequenceSplit


class _AllToAll(torch.autograd.Function):
    """x [cp, ...] -> y [cp, ...] with y[j] = cp rank j's x[r] on rank r; backward: the same on the
    gradient (the operation is its own inverse)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.group), None


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-to-all of x [cp, ...] along dim 0 over `group` (_AllToAll)."""
    return _AllToAll.apply(x, group)


def _sequence_order(split: SequenceSplit, local_len: int, device: torch.device) -> torch.Tensor | None:
    """Where each token of the whole sequence sits in the rank-order concatenation of the cp ranks'
    slices ([S] indices), or None where that concatenation is already the sequence's order."""
    if not split.balanced:
        return None
    positions = torch.cat([split.positions_of(r, local_len, device) for r in range(split.cp)])
    return torch.argsort(positions)


def seq_to_heads(x: torch.Tensor, split: SequenceSplit, order: torch.Tensor | None) -> torch.Tensor:
    """[B, s, N, E] this rank's tokens, all N heads -> [B, S, N / cp, E]: the whole sequence (in its
    order) for this rank's heads [r N / cp, (r + 1) N / cp)."""
    b, s, n, e = x.shape
    pieces = all_to_all(x.view(b, s, split.cp, n // split.cp, e).permute(2, 0, 1, 3, 4), split.group)
    whole = pieces.permute(1, 0, 2, 3, 4).reshape(b, split.cp * s, n // split.cp, e)  # rank order
    return whole if order is None else whole.index_select(1, order)


def heads_to_seq(y: torch.Tensor, split: SequenceSplit, order: torch.Tensor | None) -> torch.Tensor:
    """The inverse of seq_to_heads: [B, S, N / cp, E] in sequence order -> [B, s, N, E]."""
    b, seq, n, e = y.shape
    if order is not None:
        y = torch.empty_like(y).index_copy(1, order, y)  # back to rank order
    pieces = all_to_all(y.view(b, split.cp, seq // split.cp, n, e).transpose(0, 1), split.group)
    return pieces.permute(1, 2, 0, 3, 4).reshape(b, seq // split.cp, split.cp * n, e)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor | None,
                      split: SequenceSplit, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the whole sequence by all-to-all (module doc): q [B, H, s, E], k, v
    [B, K, s, E] at this rank's positions; `slopes` [H]: ALiBi; `ids` [B, S]: the whole sequence's
    document ids in position order (SequenceSplit.document_ids), each query then sees only keys of
    its document. -> [B, H, s, E]."""
    b, h, s, e = q.shape
    cp = split.cp
    assert h % cp == 0, f"heads {h} must divide by cp={cp} (cost/preflight.py)"
    repeat = cp // math.gcd(k.shape[1], cp)  # kv heads to lcm(K, cp), which divides H
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    kv = k.shape[1]
    order = _sequence_order(split, s, q.device)
    # one all-to-all for q, k and v: per destination rank its heads of each, side by side
    qkv = torch.cat([t.transpose(1, 2).unflatten(2, (cp, -1)) for t in (q, k, v)], dim=3)  # [B, s, cp, n, E]
    heads = seq_to_heads(qkv.flatten(2, 3), split, order)  # [B, S, (H + 2 K) / cp, E]
    ql, kl, vl = (t.transpose(1, 2) for t in heads.split((h // cp, kv // cp, kv // cp), dim=2))  # [B, n, S, E]
    gqa = h != kv
    if ids is not None and slopes is None and q.is_cuda and flex_attention_available():
        out = flex_document_attention(ql, kl, vl, ids)  # the block mask of the whole sequence's documents
    elif ids is None and slopes is None:
        out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True, enable_gqa=gqa)
    else:
        mine = None if slopes is None else slopes[split.rank * (h // cp):(split.rank + 1) * (h // cp)]
        positions = torch.arange(ql.shape[2], device=q.device)
        # boolean [S, S] (documents: [B, 1, S, S]) or ALiBi's bias [H / cp, S, S] (documents: [B, H / cp, S, S])
        mask = within_documents(causal_mask_at(positions, positions, mine), ids, positions, positions)
        out = F.scaled_dot_product_attention(ql, kl, vl, attn_mask=mask if mine is None else mask.to(q.dtype),
                                             enable_gqa=gqa)
    return heads_to_seq(out.transpose(1, 2), split, order).transpose(1, 2)
