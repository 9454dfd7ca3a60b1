"""Packed windows of several documents for the chunked memories (Titans, Memory Caching).

`doc_start` [B, S] (bool, True where a new document begins) comes with the tokens. A memory
scanned in chunks of C rows takes every gradient of a chunk at the chunk's starting state, so a
document that starts inside a chunk only matches running it alone if its chunks start where its
own would: `pack_documents` moves every document to a chunk boundary. The packed row of a batch
row is, per document, [the P prefix rows (Titans' persistent tokens; none elsewhere), its tokens,
padding up to the next multiple of `align`]; rows are as long as the longest ([B, S'], S' <= S +
documents * (P + align - 1)). Padding rows are zeros that the scans treat as no-ops (`valid`),
and each document's first packed row is a reset (`resets`): the scan's state there is the
initial one. Reads come back to the token rows with `unpack`.

`fold_documents` packs with the longest document as `align`, so that every document fills one
aligned block of its own: `rows` folds those blocks into the batch ([R, L, D], one row per
document and per empty block), for a family that runs each document as a sequence of its own
(Hope's online levels, the tree LM).
"""
from __future__ import annotations

from typing import NamedTuple

import torch


def starts_inside(doc_start: torch.Tensor | None, context: object | None = None,
                  family: str = "this family") -> torch.Tensor | None:
    """doc_start, or None when no document starts after a row's first token (the window is then one
    sequence, and the caller runs exactly as without documents). Under context parallelism
    (`context` set) any start is refused: the state passed along the cp chain does not reset."""
    if doc_start is None:
        return None
    if context is not None:
        if bool(doc_start.any()):
            raise ValueError(f"data.document_mask with parallel.cp > 1: {family}'s state passed along the cp chain "
                             "does not reset at document starts; use parallel.cp_attention=ulysses (no chain) "
                             "where the family has it, or parallel.cp=1")
        return None
    return doc_start if bool(doc_start[:, 1:].any()) else None


def document_positions(doc_start: torch.Tensor) -> torch.Tensor:
    """[B, S] long: each token's offset from the start of its document; tokens before the row's first
    marked start count from row 0 (the window's start is where the sequence started)."""
    index = torch.arange(doc_start.shape[1], device=doc_start.device).expand_as(doc_start)
    last_start = torch.where(doc_start, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - last_start


def document_ids(doc_start: torch.Tensor) -> torch.Tensor:
    """[B, S] long: equal ids for the tokens of one document (cumsum of doc_start)."""
    return doc_start.long().cumsum(dim=1)


class Packing(NamedTuple):
    """Where every token of a [B, S] window sits in the packed layout [B, S'] (module docstring)."""
    dest: torch.Tensor       # [B, S] long: the packed row of token t
    source: torch.Tensor     # [B, S'] long: the row each packed row copies from: 0..S-1 a token, S + j the
    #                          prefix row j, S + P zeros (padding), S + P + 1 + i the carried row i
    valid: torch.Tensor      # [B, S'] bool: a token or a prefix row (not padding)
    resets: torch.Tensor     # [B, S'] bool: a document's first packed row (its first prefix row, or token)
    positions: torch.Tensor  # [B, S'] long: the offset from the document's first packed row
    prefix: int
    align: int

    def pack(self, x: torch.Tensor, prefix_rows: torch.Tensor | None = None,
             carried_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, S, D] (and the prefix rows [P, D], the carried rows [B, R, D]) -> the packed
        [B, S', D], zeros where padding."""
        parts = [x] if prefix_rows is None else [x, prefix_rows.to(x.dtype).expand(x.shape[0], -1, -1)]
        parts.append(x.new_zeros(x.shape[0], 1, x.shape[2]))
        rows = torch.cat((*parts, *(() if carried_rows is None else (carried_rows.to(x.dtype),))), dim=1)
        return rows.gather(1, self.source[..., None].expand(-1, -1, x.shape[2]))

    def unpack(self, y: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The token rows of packed y ([B, S', ...] with the packed rows along `dim`, batch first)."""
        batch, seq = self.dest.shape
        index = self.dest.view(batch, *(1,) * (dim - 1), seq, *(1,) * (y.dim() - dim - 1))
        shape = list(y.shape)
        shape[dim] = seq
        return y.gather(dim, index.expand(shape))

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, D] -> its packed blocks of `align` rows folded into the batch: [B S' / align, align, D]."""
        return self.pack(x).unflatten(1, (-1, self.align)).flatten(0, 1)

    def unrows(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse of `rows` for the token rows: y [B S' / align, align, D] -> [B, S, D]."""
        return self.unpack(y.unflatten(0, (self.dest.shape[0], -1)).flatten(1, 2))


def pack_documents(doc_start: torch.Tensor, align: int, prefix: int = 0, carried: torch.Tensor | None = None,
                   offset: torch.Tensor | None = None, carried_rows: int = 0) -> Packing:
    """The packed layout (module docstring) of the documents of doc_start [B, S]; row 0 always starts
    one (the window's first tokens are a sequence of their own), unless `carried` [B] is given:
    then a row whose first token does not start a document continues one (context parallelism):
    its first document has no prefix rows but the last carried[b] of `carried_rows` rows handed
    over (pack's `carried_rows`) in front of its tokens, does not reset, and its packed positions
    start at offset[b]."""
    batch, seq = doc_start.shape
    device = doc_start.device
    continues = torch.zeros(batch, dtype=torch.bool, device=device) if carried is None else ~doc_start[:, 0]
    starts = doc_start.clone()
    starts[:, 0] = True
    segment = starts.long().cumsum(dim=1) - 1  # [B, S]: the document of each token, from 0
    count = int(segment.max()) + 1
    lengths = torch.zeros(batch, count, dtype=torch.long, device=device).scatter_add_(
        1, segment, torch.ones_like(segment))  # [B, M]; 0 for documents a row does not have
    exists = lengths > 0
    first_continues = torch.zeros_like(exists)
    first_continues[:, 0] = continues
    lead = torch.where(first_continues, 0 if carried is None else carried[:, None], prefix * exists)  # rows before
    padded = torch.where(exists, -(-(lengths + lead) // align) * align, 0)
    base = padded.cumsum(dim=1) - padded  # [B, M] each document's first packed row
    first = lengths.cumsum(dim=1) - lengths  # [B, M] each document's first token
    tokens = torch.arange(seq, device=device).expand(batch, -1)
    dest = base.gather(1, segment) + lead.gather(1, segment) + tokens - first.gather(1, segment)  # [B, S]
    total = int(padded.sum(dim=1).max())
    sink = total  # one column past the end takes the writes of documents a row does not have
    source = torch.full((batch, total + 1), seq + prefix, dtype=torch.long, device=device)
    source.scatter_(1, dest, tokens)
    if prefix:
        has_prefix = exists & ~first_continues
        rows = torch.where(has_prefix[..., None], base[..., None] + torch.arange(prefix, device=device), sink)
        source.scatter_(1, rows.flatten(1), (seq + torch.arange(prefix, device=device)).repeat(count).expand(batch, -1))
    if carried is not None:  # the continuing first document's carried rows: the last carried[b] of them
        index = torch.arange(carried_rows, device=device)
        take = continues[:, None] & (index >= carried_rows - carried[:, None])  # [B, R]
        rows = torch.where(take, index - (carried_rows - carried[:, None]), sink)
        source.scatter_(1, rows, (seq + prefix + 1 + index).expand(batch, -1))
    resets = torch.zeros(batch, total + 1, dtype=torch.bool, device=device)
    resets.scatter_(1, torch.where(exists & ~first_continues, base, sink), True)
    source, resets = source[:, :total], resets[:, :total]
    document = torch.zeros(batch, total + 1, dtype=torch.long, device=device)
    document.scatter_(1, torch.where(exists, base, sink), 1)
    owner = (document[:, :total].cumsum(dim=1) - 1).clamp(min=0)  # [B, S'] the document each packed row belongs to
    positions = torch.arange(total, device=device) - base.gather(1, owner)
    if offset is not None:
        positions = positions + torch.where((owner == 0) & continues[:, None], offset[:, None], 0)
    return Packing(dest, source, source != seq + prefix, resets, positions, prefix, align)


def fold_documents(doc_start: torch.Tensor) -> Packing:
    """pack_documents aligned to the longest document: one block of `align` rows per document."""
    return pack_documents(doc_start, int(document_positions(doc_start).max()) + 1)
