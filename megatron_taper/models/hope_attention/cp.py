"""Hope-attention under context parallelism: the chain of the online CMS levels' fast weights.

Context parallelism (contiguous split, parallel/cp/state.py): attention is the Transformer's
(all-gather or ring over the whole sequence); each online level whose period C_l is shorter
than the sequence (`chained_levels`) starts cp rank r's slice from the fast weights rank r - 1's
slice ended with (receive_state; [B, 2W, D] and [B, D, W]), makes the update at its slice's last
chunk unless it is the sequence's last, and hands the weights on (send_state), gradients flowing
back the same way: cp_state_bytes per layer and direction. The slice must hold whole chunks of
every chained level (check_hope_layout). Because attention makes every cp rank meet in each
layer, the chain is serial per layer: the CMS part of a layer takes cp times its one-slice time.

Documents (doc_start; `block_documents`): the block all-gathers the ranks' doc_start once (B x S
bytes; SequenceSplit.sequence_starts), which gives attention the document ids of the whole sequence
and every token its offset in its document. A chained level folds its slice's documents into the
batch as one process does (one row per document), every document's chunks counted from its first
token, and the chain's message carries what the slice's first document needs when it continues
the previous slice's last one (fixed shapes, every hop):
      w13, w2      [B, 2W, D], [B, D, W]: the fast weights at the start of that document's open chunk
                   (its chunk that the slice boundary cuts; after its last chunk when none is open)
      tail         [B, C - 1, D]: the sender's last C - 1 rows of that document's folded inputs n;
                   the receiver puts the open chunk's (offset mod C) of them in front of its first
                   document, so that the chunk is read and updated whole, from the weights it starts from
The sender reads its rows of the open chunk with those weights and leaves them out of its own scan
(zero rows are no-op updates; its folded rows are padded to whole chunks, the scan updating after
each). A slice whose first token starts a document starts it from the level's parameters. Cost:
the folding's padding as in one process, and the receiver scans the open chunk's rows again. Bytes
per chained level, hop and direction: 4 B (3 W D) + a B (C - 1) D (cost.py cp_state_bytes and
cp_document_bytes).

ContinuumLevel.online (hope_attention/model.py) asks `chained` and hands the weights on through
`receive_weights` and `send_weights`; with documents ContinuumLevel.forward calls `online_documents`.
The message sizes are counted in hope_attention/cost.py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatron_taper.models.hope_attention.fast_weights import SwiGLUActivations, Weights, identity
from megatron_taper.models.layers import document_ids
from megatron_taper.models.titans.documents import document_positions, pack_documents

if TYPE_CHECKING:
    from megatron_taper.models.hope_attention.model import ContinuumLevel, HopeAttentionBlock


def chained(level: ContinuumLevel, n: torch.Tensor) -> bool:
    """Whether `level`, on its slice n [B, s, D], passes its fast weights along the cp chain: under
    context parallelism, when the sequence holds more than one of its chunks."""
    split = level.context
    return split is not None and split.cp > 1 and n.shape[1] * split.cp > level.period


def receive_weights(level: ContinuumLevel, weights: Weights, batch: int) -> Weights:
    """The fast weights rank r - 1's slice ended with: [B, 2W, D], [B, D, W] (cp rank r > 0)."""
    from megatron_taper.parallel.cp.state import receive_state  # the model stays single-device until cp is applied

    return receive_state(level.context, level.context_tag, tuple(w.expand(batch, *w.shape) for w in weights))


def send_weights(level: ContinuumLevel, out: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Hand the end weights out[1:] to cp rank r + 1 (parallel/cp/state.py's chain); returns the outputs out[0]."""
    from megatron_taper.parallel.cp.state import send_state

    return send_state(level.context, level.context_tag, out[0], tuple(out[1:]))


def block_documents(block: HopeAttentionBlock, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    doc_start: torch.Tensor) -> torch.Tensor:
    """HopeAttentionBlock.forward of this rank's slice x [B, s, D] of documents (doc_start [B, s])."""
    split = block.attn.context
    starts = split.sequence_starts(doc_start)  # [B, S] the whole sequence's (all-gather)
    offsets = document_positions(starts)[:, split.positions(x.shape[1], x.device)]  # [B, s]
    xn = block.attn_norm(x)
    x = x + block.attn.project_out(block.attn.attend(xn, cos, sin, doc_ids=document_ids(starts)), xn)
    for norm, level in zip(block.cms_norms, block.cms):
        x = x + level(norm(x), offsets)
    return x


def _read(level: ContinuumLevel, n: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The level's outputs [R, C, D] for rows n [R, C, D] read with the fast weights [R, 2W, D], [R, D, W]."""
    return level.comm.sum_partial(SwiGLUActivations.of(n, w13).h @ w2.transpose(-1, -2))


def online_documents(level: ContinuumLevel, n: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """A chained online level on this rank's slice n [B, s, D] of documents, `offsets` [B, s] each
    token's offset in its document (module doc, Documents) -> its outputs [B, s, D]."""
    from megatron_taper.models.hope_attention.online import online_scan
    from megatron_taper.parallel.cp.state import receive_state, send_state

    split, period = level.context, level.period
    batch, _, dim = n.shape
    step = level.comm.reenter(torch.nn.functional.softplus(level.raw_step))
    sum_partial = None if level.comm.sum_partial is identity else level.comm.sum_partial
    w13, w2 = torch.cat((level.w1, level.w3)), level.w2
    local = offsets == 0  # a document starts here (the sequence's first token included)
    carried = offsets[:, 0] % period  # the open chunk's rows before the slice (0: none, or a start)
    starts13, starts2 = w13, w2
    if split.rank > 0:  # the first document's weights and open-chunk rows from rank r - 1
        r13, r2, *handed = receive_state(split, level.context_tag, (
            w13.expand(batch, *w13.shape), w2.expand(batch, *w2.shape), *_tail_like(n, period)))
    first = local.long().cumsum(1) == local[:, :1].long()  # [B, s] the slice's first document
    align = int((document_positions(local) + torch.where(first, carried[:, None], 0)).max()) + 1  # longest
    sends = split.rank < split.cp - 1
    if sends:  # whole chunks: the scan updates after every one (zero rows are no-op updates)
        align = -(-align // period) * period
    if split.rank > 0:
        packing = pack_documents(local, align, carried=carried, carried_rows=period - 1)
        rows = packing.pack(n, carried_rows=handed[0] if handed else None)
    else:
        packing = pack_documents(local, align)
        rows = packing.pack(n)
    blocks = rows.shape[1] // align  # folded rows per batch row: one per document, then empty ones
    rows = rows.view(batch * blocks, align, dim)
    if split.rank > 0:  # rows continuing the previous slice's document start from its weights
        continues = torch.zeros(batch * blocks, 1, 1, dtype=torch.bool, device=n.device)
        continues[::blocks] = ~local[:, :1, None]
        starts13 = torch.where(continues, r13.repeat_interleave(blocks, 0), w13)
        starts2 = torch.where(continues, r2.repeat_interleave(blocks, 0), w2)
    if not sends:
        if align <= period:  # one chunk per document: no update
            out = _read(level, rows, *(w.expand(rows.shape[0], *w.shape[-2:]) for w in (starts13, starts2)))
            out = out + 0.0 * step  # eta still joins the graph for a (zero) gradient, as DDP needs
        else:
            out = online_scan(rows, starts13, starts2, step, period, sum_partial)
        return level.comm.leave(packing.unpack(out.view(batch, -1, dim)))
    end = packing.dest[:, -1]  # [B] the folded row of the slice's last token
    last = torch.arange(batch, device=n.device) * blocks + end // align  # its document's block
    length = end % align + 1  # that document's rows (carried ones included)
    opened = length % period  # of which in its open chunk
    index = torch.arange(align, device=n.device)
    in_open = torch.zeros(batch * blocks, align, dtype=torch.bool, device=n.device)
    in_open[last] = (index >= (length - opened)[:, None]) & (index < length[:, None])
    out, end13, end2 = online_scan(rows.masked_fill(in_open[..., None], 0), starts13, starts2, step, period,
                                   sum_partial, send_end=True)
    end13, end2 = end13[last], end2[last]  # [B, ...]: the weights at the open chunk's start
    rows_back = torch.arange(period - 1, device=n.device)
    tail_index = (length[:, None] - (period - 1) + rows_back).clamp(min=0)  # [B, C - 1]
    tail = rows[last].gather(1, tail_index[..., None].expand(-1, -1, dim))
    read = _read(level, tail, end13, end2)  # [B, C - 1, D]
    mine = rows_back >= (period - 1 - opened)[:, None]  # the open chunk's rows among them
    out = out.index_put((last[:, None].expand_as(tail_index)[mine], tail_index[mine]), read[mine], accumulate=True)
    y = packing.unpack(out.view(batch, -1, dim))
    sent = (end13.to(w13.dtype), end2.to(w2.dtype), *((tail.to(n.dtype),) if period > 1 else ()))
    return level.comm.leave(send_state(split, level.context_tag, y, sent))


def _tail_like(n: torch.Tensor, period: int) -> tuple[torch.Tensor, ...]:
    """The message's tail [B, C - 1, D] as rank 0 would hand it (zeros); none for chunks of one row."""
    return (n.new_zeros(n.shape[0], period - 1, n.shape[2]),) if period > 1 else ()
