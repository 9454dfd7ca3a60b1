"""Sliding-window attention behind a prefix of persistent tokens, in work and memory O(S x W).

Queries are the S real tokens; keys and values are [P, x]: the P persistent tokens (key rows
0..P-1), then the S tokens (key row P + j for token j). Token i sees every persistent token and
the tokens j with i - W < j <= i. RoPE, projections and GQA are the caller's; the kernels take
q [B, H, S, E], k and v [B, K, P + S, E] and return [B, H, S, E].

Two kernels, chosen at run time from the tensors (`sliding_window_attention`):
- blockwise (CPU, or CUDA without FlexAttention): the queries in blocks of W (the last one
  zero-padded); block b > 0 attends to [P, block b-1, block b] under one [W, P + 2W] mask that
  every such block shares, all of them in one SDPA call (blocks folded into the batch, so the
  fused CPU kernel runs); block 0 to [P, block 0] under
  a [W, P + W] mask. It computes every pair of that band, masked or not: per query P + 2W pairs
  (P + W in block 0), of which P + min(i + 1, W) are visible (titans/cost.py `blockwise_pairs` counts them).
- FlexAttention (CUDA, when torch.nn.attention.flex_attention imports): the same pattern as a
  block-sparse mask built directly from the band (`band_block_mask`: O((S / 128)^2) block
  indices, never an [S, S] mask), through a compiled flex_attention; it skips the kv blocks
  outside the window and applies the mask inside the partly visible ones only.

Documents (`doc_ids` [B, S], equal ids = one document; titans/documents.py document_ids): token i
then sees the persistent tokens and the tokens j of its own document with i - W < j <= i. The
blockwise kernel adds the same-document test to each block's mask ([B (n-1), 1, W, P + 2W]); the
FlexAttention one to its mask_mod, and visits the band's blocks as partly visible (none `full`).
"""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from megatron_taper.cost.attention_memory import FLEX_BLOCK  # FlexAttention's sparse block of tokens (its default)

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask



def band_mask(prefix: int, rows: int, before: int, window: int, device: torch.device) -> torch.Tensor:
    """[rows, P + before + rows] boolean mask (True = may attend) of `rows` consecutive queries over
    [P, the `before` tokens preceding them, themselves]."""
    i = torch.arange(rows, device=device)[:, None] + before  # the query's token offset among the keys
    j = torch.arange(prefix + before + rows, device=device)[None, :] - prefix
    return (j < 0) | ((i - j >= 0) & (i - j < window))


def blockwise_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
                               window: int, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The blockwise kernel (see the module docstring): [B, H, S, E]."""
    seq, gqa = q.shape[2], q.shape[1] != k.shape[1]
    block = min(window, seq)
    blocks = math.ceil(seq / block)
    mask = band_mask(prefix, block, 0, window, q.device)
    if doc_ids is not None:  # [B, 1, W, P + W]
        mask = mask & same_document(doc_ids[:, :block], doc_ids[:, :block], prefix)[:, None]
    first = F.scaled_dot_product_attention(q[:, :, :block], k[:, :, :prefix + block], v[:, :, :prefix + block],
                                           attn_mask=mask, enable_gqa=gqa)
    if blocks == 1:
        return first
    pad = blocks * block - seq
    batch = q.shape[0]
    rest_q = F.pad(q[:, :, block:], (0, 0, 0, pad)).unflatten(2, (blocks - 1, block)).transpose(1, 2)
    rest_k, rest_v = (band_keys(t, prefix, block, pad) for t in (k, v))
    mask = band_mask(prefix, block, block, window, q.device)
    if doc_ids is not None:  # [B (n-1), 1, W, P + 2W]; padding rows have id -1
        ids = F.pad(doc_ids, (0, pad), value=-1).unflatten(1, (blocks, block))  # [B, n, W]
        keys = torch.cat((ids[:, :-1], ids[:, 1:]), dim=2)  # [B, n-1, 2W]
        mask = mask & same_document(ids[:, 1:], keys, prefix).flatten(0, 1)[:, None]
    # blocks folded into the batch: [B (n-1), H|K, W | P + 2W, E], 4-D and contiguous for SDPA's fused kernels
    rest = F.scaled_dot_product_attention(rest_q.flatten(0, 1), rest_k.flatten(0, 1), rest_v.flatten(0, 1),
                                          attn_mask=mask, enable_gqa=gqa)
    rest = rest.unflatten(0, (batch, blocks - 1)).transpose(1, 2).flatten(2, 3)  # [B, H, (n-1) W, E]
    return torch.cat((first, rest[:, :, :seq - block]), dim=2)


def same_document(query_ids: torch.Tensor, key_ids: torch.Tensor, prefix: int) -> torch.Tensor:
    """[..., Sq, P + Sk] boolean: key row P + j is in query i's document (query_ids [..., Sq], key_ids
    [..., Sk]); the P persistent rows always are."""
    same = query_ids[..., :, None] == key_ids[..., None, :]
    return F.pad(same, (prefix, 0), value=True)


def band_keys(t: torch.Tensor, prefix: int, block: int, pad: int) -> torch.Tensor:
    """Keys (or values) [B, K, P + S, E] -> [B, n-1, K, P + 2W, E]: for each block b > 0 of the
    n blocks, [P, block b-1, block b]."""
    tokens = F.pad(t[:, :, prefix:], (0, 0, 0, pad)).unflatten(2, (-1, block)).transpose(1, 2)  # [B, n, K, W, E]
    persistent = t[:, None, :, :prefix].expand(-1, tokens.shape[1] - 1, -1, -1, -1)  # [B, n-1, K, P, E]
    return torch.cat((persistent, tokens[:, :-1], tokens[:, 1:]), dim=3)


def window_visible(prefix: int, window: int, doc_ids: torch.Tensor | None = None) -> Callable:
    """FlexAttention mask_mod of the pattern: query token q_idx, key row kv_idx of [P, x] (of batch
    row b's documents when doc_ids [B, S] is given)."""
    def visible(b, h, q_idx, kv_idx):
        dist = q_idx + prefix - kv_idx
        return (kv_idx < prefix) | ((dist >= 0) & (dist < window))

    def visible_in_document(b, h, q_idx, kv_idx):
        token = (kv_idx - prefix).clamp(min=0)
        return visible(b, h, q_idx, kv_idx) & ((kv_idx < prefix) | (doc_ids[b, q_idx] == doc_ids[b, token]))
    return visible if doc_ids is None else visible_in_document


def band_block_mask(seq: int, prefix: int, window: int, device: torch.device,
                    block: int = FLEX_BLOCK, doc_ids: torch.Tensor | None = None) -> BlockMask:
    """FlexAttention BlockMask of the pattern for S queries over P + S keys, built from the band's
    geometry: a kv block is visited when it holds a persistent token or a key some query of the
    q block sees, and is `full` (no mask applied) when every valid pair in it is visible (never
    with `doc_ids`: a document start may cut any block)."""
    from torch.nn.attention.flex_attention import BlockMask

    keys = prefix + seq
    q_first = torch.arange(math.ceil(seq / block), device=device)[:, None] * block  # [Qb, 1]
    q_last = (q_first + block).clamp(max=seq) - 1
    kv_first = torch.arange(math.ceil(keys / block), device=device)[None, :] * block  # [1, KVb]
    kv_last = (kv_first + block).clamp(max=keys) - 1
    # query q sees key rows [0, P) and [P + q - W + 1, P + q]
    band_lo, band_hi = (prefix + q_first - window + 1).clamp(min=prefix), prefix + q_last
    visited = (kv_first < prefix) | ((kv_first <= band_hi) & (kv_last >= band_lo))
    full = (kv_last < prefix) | ((kv_first >= prefix + q_last - window + 1) & (kv_last <= prefix + q_first))
    if doc_ids is not None:
        full = torch.zeros_like(full)
    partial = visited & ~full

    def indices(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True)  # visited blocks first, ascending
        return blocks.sum(-1).to(torch.int32)[None, None], order.to(torch.int32)[None, None]

    return BlockMask.from_kv_blocks(*indices(partial), *indices(full), BLOCK_SIZE=block,
                                    mask_mod=window_visible(prefix, window, doc_ids), seq_lengths=(seq, keys))


@functools.cache
def compiled_flex_attention() -> Callable:
    """flex_attention compiled once per process (uncompiled it materialises every score)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, window: int,
                          compiled: bool = True, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The FlexAttention kernel (see the module docstring): [B, H, S, E]. `compiled=False` runs
    flex_attention eagerly (its unfused reference: what tests use on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    mask = band_block_mask(q.shape[2], prefix, window, q.device, doc_ids=doc_ids)
    attend = compiled_flex_attention() if compiled else flex_attention
    return attend(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def flex_attention_available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
                             window: int, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """FlexAttention on CUDA when it imports, else the blockwise kernel: [B, H, S, E] (within the
    documents of doc_ids [B, S] when given)."""
    if q.is_cuda and flex_attention_available():
        return flex_window_attention(q, k, v, prefix, window, doc_ids=doc_ids)
    return blockwise_window_attention(q, k, v, prefix, window, doc_ids)
