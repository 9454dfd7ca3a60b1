"""Documents inside a packed window (data.document_mask): where they start, and attention kept
inside them with FlexAttention.

A training window is cut from a stream of documents, each one's tokens followed by the
tokenizer's end-of-document id (tools/preprocess_data.py appends EOS to every document and
records its id as `eos_id` in stats.json). So a document begins right after each EOS the window
holds: `document_starts` marks those positions, from the input tokens alone, on their device (no
extra pass over the data, the same under every layout and after any resume). Position 0 is never
marked: the token before the window is not in it, and what precedes position 0 counts as
position 0's document (for attention inside the window it makes no difference).

    doc_start [B, S] bool  ->  document_ids: cumulative count of starts [B, S]
    query i may see key j  <=>  j <= i and ids[i] == ids[j]                 (layers.document_mask)

FlexAttention (CUDA): `document_block_mask` builds the block-sparse mask from the ids directly
(O(B x (S / 128)^2) block flags, never a [B, S, S] mask): a kv block is visited when it holds a
key of a query's document at or before it, and `full` (no mask applied) when every key lies before
every query of the block and all of them are in one document; only the blocks a document
boundary or the diagonal cuts apply the mask_mod.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import torch

from megatron_taper.models.local_attention import FLEX_BLOCK, compiled_flex_attention

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


def document_starts(inputs: torch.Tensor, end_id: int) -> torch.Tensor:
    """inputs [B, S] token ids -> doc_start [B, S] bool: True at position i >= 1 where token i - 1
    is `end_id` (a document ends there); position 0 is False."""
    first = torch.zeros_like(inputs[:, :1], dtype=torch.bool)
    return torch.cat((first, inputs[:, :-1] == end_id), dim=1)


def same_document_causal(ids: torch.Tensor) -> Callable:
    """FlexAttention mask_mod of causal attention inside documents with ids [B, S]."""
    def visible(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (ids[b, q_idx] == ids[b, kv_idx])
    return visible


def document_block_mask(ids: torch.Tensor, block: int = FLEX_BLOCK) -> BlockMask:
    """FlexAttention BlockMask [B, 1, S, S] of causal attention inside the documents of ids [B, S]
    (non-decreasing along S), from the blocks' first and last ids (module doc)."""
    from torch.nn.attention.flex_attention import BlockMask

    seq = ids.shape[1]
    first = torch.arange(math.ceil(seq / block), device=ids.device) * block  # [n]
    last = (first + block).clamp(max=seq) - 1
    id_first, id_last = ids[:, first], ids[:, last]  # [B, n]
    # [B, q block, kv block]: some key at or before some query of its document / every pair visible
    visited = (first[None, None, :] <= last[None, :, None]) & (id_last[:, None, :] >= id_first[:, :, None])
    full = (last[None, None, :] <= first[None, :, None]) & (id_first[:, None, :] == id_last[:, :, None])
    partial = visited & ~full

    def indices(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True)  # listed blocks first, ascending
        return blocks.sum(-1).to(torch.int32)[:, None], order.to(torch.int32)[:, None]

    return BlockMask.from_kv_blocks(*indices(partial), *indices(full), BLOCK_SIZE=block,
                                    mask_mod=same_document_causal(ids), seq_lengths=(seq, seq))


def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor,
                            compiled: bool = True, block: int = FLEX_BLOCK) -> torch.Tensor:
    """Causal attention inside documents through FlexAttention: q [B, H, S, E], k, v [B, K, S, E],
    ids [B, S] -> [B, H, S, E], in sparse blocks of `block` tokens. `compiled=False` runs
    flex_attention eagerly (its unfused reference: what tests use on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    attend = compiled_flex_attention() if compiled else flex_attention
    return attend(q, k, v, block_mask=document_block_mask(ids, block), enable_gqa=q.shape[1] != k.shape[1])
