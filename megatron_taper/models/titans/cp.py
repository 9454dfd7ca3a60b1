"""Titans under context parallelism: each cp rank holds a contiguous slice of the sequence.

The split is the contiguous one (SequenceSplit balanced=False): cp rank r holds tokens
[r s, (r + 1) s), s = S / cp. The neural memory's update is not associative (a deep memory's
gradient step depends on the weights it starts from), so every block hands its state along the
cp chain (parallel/cp/state.py receive_state / send_state): rank r starts each block from what
rank r - 1 reached at the end of its slice, and sends back the gradient of it. One message per
block and direction carries everything a slice needs from the slices before it:

    MAG / MAL (the memory reads [P, x], P the persistent tokens, in chunks of C rows from row 0):
      memory weights W_l and surprise S_l     [B, H, i_l, o_l] each, per memory layer l
        (fp32, the state at the last chunk boundary before the slice's start)
      memory-input tail   [B, p + K - 1, D]   the memory's input rows since that boundary
        (p = (P + r s) mod C rows; the receiver computes their keys, values and gates again and
        scans the chunk whole, so every chunk's gradients are taken at its starting state exactly
        as in one process) and the K - 1 rows before them (the causal convolution's past; zeros
        on rank 0, which is what the convolution's zero padding is)
      attention tail      [B, min(W - 1, r s), D]   the attention input's last W - 1 rows (keys
        and values of the sliding window, projected again by the receiver, RoPE at their true
        positions); MAG's attention input is the memory's, MAL's is attn_norm(x + M(...))
    MAC (segments of W tokens, each slice whole segments: refused otherwise):
      W_l, S_l as above, the writes' convolution past (the last K - 1 rows of wk y, wv y, wq y,
      [B, K - 1, H E] each) and the retrieval queries' (the last K - 1 rows of wq norm(x))

Rank 0 sends the persistent tokens' effect through the state only: the tokens sit at the start
of the memory's stream, and every rank puts them in front of its attention keys (RoPE positions
0..P - 1, the tokens at P + their position, as in one process).

Bytes per block and direction (cp_state_bytes; W_l, S_l in fp32, the tails in the activations'
dtype of `a` bytes, H the heads of this tp rank):
    MAG / MAL  8 B H sum_l i_l o_l + a B D (p + K - 1 + min(W - 1, r s))
    MAC        8 B H sum_l i_l o_l + 4 a B (K - 1) H E
parallel.cp_attention=ulysses (MAG, MAL; MAC refused): no chain. The memory is per head, so each
rank scans the whole sequence for H / cp of the heads (`_ulysses_reads`, parallel/cp/ulysses.py):

    q, k, v projections before the convolution and the gates of the rank's tokens [B, s, H, 3 E + 3]
      -> all-to-all -> [B, S, H / cp, 3 E + 3]; the persistent tokens' rows of those heads in front
      (every rank projects them itself); convolution (those heads' taps), the scan from those heads'
      M_0, every chunk as in one process
    reads [B, S, H / cp, E] -> all-to-all back -> [B, s, H, E] -> the output projection per token
    the window's W - 1 rows before the slice come from rank r - 1 by previous_rows (all ranks at
    once; W - 1 must not exceed the slice)
    documents (doc_start): the ranks' doc_start slices all-gathered as attention's (SequenceSplit.
      sequence_starts, uint8 [B, S]); each rank then holds the whole sequence for its heads, so it
      runs one process's packed scan (titans/documents.py, TitansBlock.memory_reads) on the
      channels: packed behind those heads' persistent-token rows, padding rows the channels of a
      zero row; the window takes its rows' document offsets and ids from the whole sequence's

Bytes per block and micro-batch (cost.py ulysses_bytes): the two buffers a B s H (4 E + 3)
forward and again backward, (cp - 1) / cp of each leaving the rank, plus the halo a B (W - 1) D
each way. Nothing waits in a chain: every rank computes its heads' whole scan at once.

The window halo travels in the chain's message rather than by a separate previous_rows: a
separate exchange at the start of the next layer would make rank r - 1 wait for rank r to reach
that layer (a point-to-point send meets its receive), turning the wavefront into a lockstep.

Documents (doc_start, MAG / MAL; MAC refuses a document start under context parallelism): each
rank packs its slice's documents (titans/documents.py) and the message carries, with fixed shapes,
what the slice's first document needs when it continues the previous slice's last one:
      W_l, S_l          the state at the start of that document's open chunk (its last chunk
                        boundary in the document's own packed rows)
      memory tail       [B, C - 1 + K - 1, D]: the sender's last packed memory-input rows; the
                        receiver takes the open chunk's (P + offset) mod C rows in front of its first
                        document and the K - 1 before them as the convolution's past
      attention tail    [B, min(W - 1, r s), D] as without documents
      ends              [B, 2] fp32: the packed position of the sender's last row in its document
                        (which gives the open chunk's length) and its last token's offset (the
                        halo's document and RoPE positions)
A slice whose first token starts a document starts it from M_0 behind the persistent tokens. The
bytes per block and direction: 8 B H sum_l i_l o_l + a B D (C - 1 + K - 1 + min(W - 1, r s)) + 8 B
(cost.py cp_state_bytes counts it, documents=True).

Cost of the chain: nothing in a Titans block makes all cp ranks meet (its attention is a window
or a segment), so the ranks run as a wavefront: L blocks take L + cp - 1 block-slices of S / cp
tokens forward and again backward, against L blocks of S tokens in one process: a step takes
about (L + cp - 1) / (L cp) of the one-process time plus the messages, and each rank keeps the
activations of S / cp tokens. The receiver also recomputes the projections of the tail rows
(at most C - 1 + K - 1 memory rows and W - 1 attention rows per block): under 1% for s >> C, W.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatron_taper.models.titans.cost import conv_rows, tail_rows
from megatron_taper.models.titans.documents import (
    Packing,
    document_ids,
    document_positions,
    pack_documents,
    starts_inside,
)

if TYPE_CHECKING:
    from megatron_taper.models.titans.model import MACBlock, MAGBlock, MALBlock, TitansBlock


def conv_kernel(block: TitansBlock) -> int:
    return 0 if block.memory.conv_k is None else block.memory.conv_k.shape[1]


def _receive(block: TitansBlock, initial: list[torch.Tensor]) -> list[torch.Tensor]:
    """`initial` on cp rank 0, else what rank r - 1 sent (empty tensors are not sent)."""
    from megatron_taper.parallel.cp.state import receive_state

    sent = [t for t in initial if t.numel()]
    got = iter(receive_state(block.context, block.context_tag, sent) if sent else ())
    return [next(got) if t.numel() else t for t in initial]


def _send(block: TitansBlock, y: torch.Tensor, ends: list[torch.Tensor], like: list[torch.Tensor]) -> torch.Tensor:
    """Hand `ends` (shaped as cp rank r + 1's initial state `like`) to rank r + 1; returns y."""
    from megatron_taper.parallel.cp.state import send_state

    assert [t.shape for t in ends] == [t.shape for t in like], ([t.shape for t in ends], [t.shape for t in like])
    sent = [t.to(m.dtype) for t, m in zip(ends, like) if m.numel()]
    return send_state(block.context, block.context_tag, y, sent) if sent else y


def _last(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x[:, x.shape[1] - rows:]


def _stream_initial(block: TitansBlock, x: torch.Tensor, rank: int) -> list[torch.Tensor]:
    """MAG / MAL: [W_l..., S_l..., memory-input tail, attention tail] of cp rank `rank`'s start."""
    memory = block.memory
    weights, surprise = memory.init_state(x.shape[0])
    mem, attn = tail_rows(block.persistent.shape[0], memory.chunk_size, conv_kernel(block), block.window, rank,
                          x.shape[1])
    return [*weights, *surprise, x.new_zeros(x.shape[0], mem, x.shape[2]), x.new_zeros(x.shape[0], attn, x.shape[2])]


def _memory_slice(block: TitansBlock, x: torch.Tensor, received: list[torch.Tensor]):
    """The memory over this rank's slice x [B, s, D] (its input rows) from the received state:
    (reads of the slice's tokens [B, H, s, E], the state at the last chunk boundary, the memory's
    input rows with the received tail in front)."""
    memory, n, rank = block.memory, len(block.memory.mem_w), block.context.rank
    weights, surprise, tail = received[:n], received[n:2 * n], received[2 * n]
    prefix = block.persistent.shape[0] if rank == 0 else 0
    rows = torch.cat((tail, block.with_prefix(x) if prefix else x), dim=1)  # [B, p + K - 1 + (P) + s, D]
    features, _ = memory.project(rows, rows)  # zero convolution past: the tail's first K - 1 rows are its past
    skip = conv_rows(conv_kernel(block))
    features = tuple(f[:, :, skip:] for f in features)
    reads, state = memory.scan_features(features, (weights, surprise), whole_chunks=True)
    return reads[:, :, tail.shape[1] - skip + prefix:], state, rows


def _ends(block: TitansBlock, x: torch.Tensor, state, rows: torch.Tensor, attn_rows: torch.Tensor):
    """(what rank r + 1 receives, the shapes it expects) in MAG / MAL."""
    like = _stream_initial(block, x, block.context.rank + 1)
    mem, attn = like[-2].shape[1], like[-1].shape[1]
    return [*state[0], *state[1], _last(rows, mem), _last(attn_rows, attn)], like


def mag_mix(block: MAGBlock, xn: torch.Tensor) -> torch.Tensor:
    """MAGBlock.mix of this rank's slice xn [B, s, D]."""
    if block.context.attention == "ulysses":
        return mag_mix_ulysses(block, xn)
    rank, local = block.context.rank, xn.shape[1]
    received = _receive(block, _stream_initial(block, xn, rank))
    reads, state, rows = _memory_slice(block, xn, received)
    gate = torch.sigmoid(block.memory.output(reads))
    halo = received[-1]
    keys = torch.cat((halo, xn), dim=1)  # [B, halo + s, D]
    gate = _send(block, gate, *_ends(block, xn, state, rows, keys))
    return block.window_attention(block.with_prefix(keys), halo.shape[1], rank * local) * gate


def mal_forward(block: MALBlock, x: torch.Tensor) -> torch.Tensor:
    """MALBlock.forward of this rank's slice x [B, s, D]."""
    if block.context.attention == "ulysses":
        return mal_forward_ulysses(block, x)
    rank, local = block.context.rank, x.shape[1]
    received = _receive(block, _stream_initial(block, x, rank))
    reads, state, rows = _memory_slice(block, block.mem_norm(x), received)
    x = x + block.memory.output(reads)
    halo, xa = received[-1], block.attn_norm(x)
    xa = _send(block, xa, *_ends(block, x, state, rows, torch.cat((halo, xa), dim=1)))
    x = x + block.window_attention(block.with_prefix(torch.cat((halo, xa), dim=1)), halo.shape[1], rank * local)
    return x + block.mlp(block.mlp_norm(x))


def mac_mix(block: MACBlock, xn: torch.Tensor) -> torch.Tensor:
    """MACBlock.mix of this rank's slice xn [B, s, D] (whole segments: check_cp_layout)."""
    memory, n, rows = block.memory, len(block.memory.mem_w), conv_rows(conv_kernel(block))
    weights, surprise = memory.init_state(xn.shape[0])
    past = [xn.new_zeros(xn.shape[0], rows, memory.out_norm_weight.shape[0]) for _ in range(4 if rows else 0)]
    initial = [*weights, *surprise, *past]  # pasts: retrieval queries', then the writes' k, v, q
    received = _receive(block, initial)
    state, pasts = (received[:n], received[n:2 * n]), received[2 * n:]
    out, state, query_past, past = block.segments(xn, state, pasts[0] if rows else None,
                                                  tuple(pasts[1:]) if rows else None)
    ends = [*state[0], *state[1], *((query_past, *past) if rows else ())]
    return _send(block, out, ends, initial)


# -- documents (doc_start; MAG / MAL) ----------------------------------------------------------------

def _document_initial(block: TitansBlock, x: torch.Tensor, rank: int) -> list[torch.Tensor]:
    """MAG / MAL with documents: [W_l..., S_l..., memory tail [B, C - 1 + K - 1, D], attention tail
    [B, min(W - 1, r s), D], ends [B, 2] fp32] of cp rank `rank`'s start (module doc, Documents)."""
    batch, dim = x.shape[0], x.shape[2]
    weights, surprise = block.memory.init_state(batch)
    mem = block.memory.chunk_size - 1 + conv_rows(conv_kernel(block))
    attn = min(block.window - 1, rank * x.shape[1])
    ends = torch.full((batch, 2), -1.0, device=x.device)
    return [*weights, *surprise, x.new_zeros(batch, mem, dim), x.new_zeros(batch, attn, dim), ends]


def _memory_documents(block: TitansBlock, x: torch.Tensor, received: list[torch.Tensor], doc_start: torch.Tensor):
    """The memory over this rank's slice x [B, s, D] of documents from the received state: (reads of
    the slice's tokens [B, H, s, E], the state at the start of the open chunk of each row's last
    document, the memory tail to hand on, the packed position of each row's last row)."""
    memory, n, rank = block.memory, len(block.memory.mem_w), block.context.rank
    weights, surprise, tail, ends = received[:n], received[n:2 * n], received[2 * n], received[-1]
    size, kc, dim = memory.chunk_size, conv_rows(conv_kernel(block)), x.shape[2]
    starts = doc_start.clone()
    if rank == 0:
        starts[:, 0] = True
    last = ends[:, 0].long()  # the previous slice's last memory row's position in its document
    carried = torch.where(starts[:, 0], 0, (last + 1) % size)
    packing = pack_documents(starts, size, block.persistent.shape[0], carried=carried, offset=last + 1 - carried,
                             carried_rows=tail.shape[1])
    rows = packing.pack(x, block.persistent, tail)  # [B, S', D]
    past = None
    if kc:  # the K - 1 rows before the carried ones (positions keep out those of another document)
        index = (tail.shape[1] - carried - kc)[:, None] + torch.arange(kc, device=x.device)
        before = tail.gather(1, index[..., None].expand(-1, -1, dim))
        past = tuple(proj(before) for proj in (memory.wk, memory.wv, memory.wq))
    features, _ = memory.project(rows, rows, past, positions=packing.positions)
    reads, final, chunks = memory.scan_with_starts(features, (weights, surprise),
                                                   documents=(packing.valid, packing.resets))
    end = packing.dest[:, -1]  # [B] the packed row of the slice's last token
    position = packing.positions.gather(1, end[:, None])[:, 0]
    chunk = end // size + ((position + 1) % size == 0)  # the open chunk, or after the last one when none is open
    state = []
    for every, after in zip(chunks[0] + chunks[1], final[0] + final[1]):  # [B, H, N, i, o], [B, H, i, o]
        stacked = torch.cat((every, after.unsqueeze(2)), dim=2)
        state.append(stacked.gather(2, chunk.view(-1, 1, 1, 1, 1).expand(-1, stacked.shape[1], 1,
                                                                          *stacked.shape[3:])).squeeze(2))
    index = (end[:, None] - tail.shape[1] + 1 + torch.arange(tail.shape[1], device=x.device)).clamp(min=0)
    mem_tail = rows.gather(1, index[..., None].expand(-1, -1, dim))
    return packing.unpack(reads, dim=2), state, mem_tail, position


def _document_offsets(block: TitansBlock, doc_start: torch.Tensor, halo: int, ends: torch.Tensor):
    """The window's token offsets in their documents and document ids over [halo, slice] ([B, halo + s]
    each): the slice's first document continues the previous slice's last where the slice does not
    start one (not on cp rank 0); halo rows of another document get id -1."""
    last = ends[:, 1].long()  # the previous slice's last token's offset in its document (-1: none)
    continues = ~doc_start[:, 0] & (last >= 0)
    ids = document_ids(doc_start)
    offsets = document_positions(doc_start) + torch.where(continues[:, None] & (ids == 0), last[:, None] + 1, 0)
    halo_offsets = last[:, None] - (halo - 1 - torch.arange(halo, device=ids.device))
    halo_ids = torch.where(continues[:, None] & (halo_offsets >= 0), 0, -1)
    return torch.cat((halo_offsets.clamp(min=0), offsets), dim=1), torch.cat((halo_ids, ids), dim=1)


def mag_documents(block: MAGBlock, xn: torch.Tensor, doc_start: torch.Tensor) -> torch.Tensor:
    """MAGBlock.mix of this rank's slice xn [B, s, D] of documents (doc_start [B, s])."""
    if block.context.attention == "ulysses":
        return mag_mix_ulysses(block, xn, doc_start)
    rank = block.context.rank
    received = _receive(block, _document_initial(block, xn, rank))
    reads, state, mem_tail, mem_last = _memory_documents(block, xn, received, doc_start)
    gate = torch.sigmoid(block.memory.output(reads))
    halo, ends = received[-2], received[-1]
    offsets, ids = _document_offsets(block, doc_start, halo.shape[1], ends)
    keys = torch.cat((halo, xn), dim=1)
    like = _document_initial(block, xn, rank + 1)
    sent = [*state, mem_tail, _last(keys, like[-2].shape[1]), torch.stack((mem_last, offsets[:, -1]), 1).float()]
    gate = _send(block, gate, sent, like)
    return block.document_window(block.with_prefix(keys), offsets, ids, halo.shape[1]) * gate


def mal_documents(block: MALBlock, x: torch.Tensor, doc_start: torch.Tensor) -> torch.Tensor:
    """MALBlock.forward of this rank's slice x [B, s, D] of documents (doc_start [B, s])."""
    if block.context.attention == "ulysses":
        return mal_forward_ulysses(block, x, doc_start)
    rank = block.context.rank
    received = _receive(block, _document_initial(block, x, rank))
    reads, state, mem_tail, mem_last = _memory_documents(block, block.mem_norm(x), received, doc_start)
    x = x + block.memory.output(reads)
    halo, ends = received[-2], received[-1]
    offsets, ids = _document_offsets(block, doc_start, halo.shape[1], ends)
    xa = block.attn_norm(x)
    like = _document_initial(block, x, rank + 1)
    sent = [*state, mem_tail, _last(torch.cat((halo, xa), dim=1), like[-2].shape[1]),
            torch.stack((mem_last, offsets[:, -1]), 1).float()]
    xa = _send(block, xa, sent, like)
    x = x + block.document_window(block.with_prefix(torch.cat((halo, xa), dim=1)), offsets, ids, halo.shape[1])
    return x + block.mlp(block.mlp_norm(x))


def head_channels(memory: torch.nn.Module, x: torch.Tensor, extra: tuple[torch.nn.Module, ...] = ()) -> torch.Tensor:
    """x [B, T, D] -> [B, T, H, 3 E + g + E x len(extra)]: per head the memory's q, k, v projections
    before the convolution, its g gate pre-activations, and the E channels of each `extra` projection
    (Memory Caching's W_u); what parallel.cp_attention=ulysses sends all-to-all."""
    batch, t, e = x.shape[0], x.shape[1], memory.head_dim
    projected = [proj(x).view(batch, t, -1, e) for proj in (memory.wq, memory.wk, memory.wv, *extra)]
    gates = memory.gates(x).view(batch, t, projected[0].shape[2], -1)
    return torch.cat([*projected[:3], gates, *projected[3:]], dim=-1)


def head_features(memory: torch.nn.Module, z: torch.Tensor, heads: slice, positions: torch.Tensor | None = None):
    """head_channels z [B, T, n, c] of the memory's heads `heads` (the whole sequence) -> (the memory's
    features k, v, q [B, n, T, E] and gates, as memory.project gives them; the extra projections
    [B, n, T, E] each). `positions` [B, T]: the rows' offsets in their documents (causal_conv)."""
    e = memory.head_dim
    gates = memory.gates.weight.shape[0] // (memory.wq.weight.shape[0] // e)  # gate pre-activations per head
    zq, zk, zv, g, *extra = z.split((e, e, e, gates) + (e,) * ((z.shape[-1] - 3 * e - gates) // e), dim=-1)
    taps = slice(heads.start * e, heads.stop * e)
    q, k, v = (memory.conv_heads(p.flatten(2), None if conv is None else conv[taps], None, positions)[0]
               for p, conv in ((zq, memory.conv_q), (zk, memory.conv_k), (zv, memory.conv_v)))
    return (k, v, q, *memory.gate_features(g.flatten(2))), [u.transpose(1, 2) for u in extra]


def pack_channels(packing: Packing, z: torch.Tensor, padding: torch.Tensor,
                  prefix: torch.Tensor | None = None) -> torch.Tensor:
    """head_channels z [B, T, n, c] of a window of documents -> its packed rows [B, T', n, c]
    (titans/documents.py), with `prefix` [P, n, c] in front of each document and `padding` [n, c]
    (the channels of a zero row, which one process's packed zeros project to) in the padding rows."""
    flat = packing.pack(z.flatten(2), None if prefix is None else prefix.flatten(1)).unflatten(2, z.shape[2:])
    return torch.where(packing.valid[..., None, None], flat, padding.to(flat.dtype))


def ulysses_heads(split, heads: int) -> slice:
    """parallel.cp_attention=ulysses: this cp rank's share of a tp rank's `heads` heads."""
    return slice(split.rank * heads // split.cp, (split.rank + 1) * heads // split.cp)


def _ulysses_reads(block: TitansBlock, x: torch.Tensor, doc_start: torch.Tensor | None = None) -> torch.Tensor:
    """parallel.cp_attention=ulysses: the memory's reads [B, H, s, E] of this rank's slice x [B, s, D]
    (its input rows), each rank scanning the whole sequence for H / cp of the heads (module doc);
    `doc_start` [B, S]: the whole sequence's document starts (one process's packed scan)."""
    from megatron_taper.parallel.cp.ulysses import heads_to_seq, seq_to_heads

    memory, split, batch = block.memory, block.context, x.shape[0]
    heads = ulysses_heads(split, memory.mem_w[0].shape[0])
    mine = seq_to_heads(head_channels(memory, x), split, None)  # [B, S, H / cp, 3 E + 3]: the whole sequence
    prefix = head_channels(memory, block.with_prefix(x[:1, :0]))[0, :, heads]  # [P, H / cp, 3 E + 3]
    if doc_start is None:
        features = head_features(memory, torch.cat((prefix.expand(batch, -1, -1, -1), mine), dim=1), heads)[0]
        reads, _ = memory.scan_features(features, memory.init_state(batch, heads), heads=heads)  # [B, n, P + S, E]
        reads = reads[:, :, prefix.shape[0]:]
    else:  # as TitansBlock.memory_reads: the documents packed, each behind the persistent tokens
        packing = pack_documents(doc_start, memory.chunk_size, prefix.shape[0])
        padding = head_channels(memory, x.new_zeros(1, 1, x.shape[2]))[0, 0, heads]
        features = head_features(memory, pack_channels(packing, mine, padding, prefix), heads, packing.positions)[0]
        reads, _ = memory.scan_features(features, memory.init_state(batch, heads), heads=heads,
                                        documents=(packing.valid, packing.resets))
        reads = packing.unpack(reads, dim=2)
    return heads_to_seq(reads.transpose(1, 2), split, None).transpose(1, 2)  # [B, H, s, E]


def _ulysses_halo(block: TitansBlock, xa: torch.Tensor) -> torch.Tensor:
    """The attention input's last W - 1 rows of cp rank r - 1 ([B, 0, D] on rank 0), by previous_rows."""
    from megatron_taper.parallel.cp.state import previous_rows

    if block.window <= 1:
        return xa[:, :0]
    halo = previous_rows(block.context, block.context_tag, xa, block.window - 1)
    return halo[:, :0] if block.context.rank == 0 else halo


def _ulysses_documents(block: TitansBlock, doc_start: torch.Tensor | None, local: int):
    """The whole sequence's doc_start [B, S] (all-gathered as attention's, parallel/cp/split.py), or
    None where no document starts after a row's first token (one process then runs without
    documents); and the window's token offsets in their documents and document ids over [halo,
    slice] ([B, halo + s] each), or None."""
    if doc_start is None:
        return None, None
    whole = starts_inside(block.context.sequence_starts(doc_start))
    if whole is None:
        return None, None
    rank = block.context.rank
    halo = 0 if rank == 0 or block.window <= 1 else block.window - 1  # _ulysses_halo's rows
    cols = slice(rank * local - halo, (rank + 1) * local)
    return whole, (document_positions(whole)[:, cols], document_ids(whole)[:, cols])


def mag_mix_ulysses(block: MAGBlock, xn: torch.Tensor, doc_start: torch.Tensor | None = None) -> torch.Tensor:
    """MAGBlock.mix of this rank's slice xn [B, s, D] under parallel.cp_attention=ulysses (with
    documents: doc_start [B, s])."""
    whole, window = _ulysses_documents(block, doc_start, xn.shape[1])
    gate = torch.sigmoid(block.memory.output(_ulysses_reads(block, xn, whole)))
    halo = _ulysses_halo(block, xn)
    return _ulysses_window(block, torch.cat((halo, xn), dim=1), halo.shape[1], window) * gate


def mal_forward_ulysses(block: MALBlock, x: torch.Tensor, doc_start: torch.Tensor | None = None) -> torch.Tensor:
    """MALBlock.forward of this rank's slice x [B, s, D] under parallel.cp_attention=ulysses (with
    documents: doc_start [B, s])."""
    whole, window = _ulysses_documents(block, doc_start, x.shape[1])
    x = x + block.memory.output(_ulysses_reads(block, block.mem_norm(x), whole))
    xa = block.attn_norm(x)
    halo = _ulysses_halo(block, xa)
    x = x + _ulysses_window(block, torch.cat((halo, xa), dim=1), halo.shape[1], window)
    return x + block.mlp(block.mlp_norm(x))


def _ulysses_window(block: TitansBlock, keys: torch.Tensor, halo: int, window) -> torch.Tensor:
    """The sliding window over [halo, slice] rows `keys` [B, halo + s, D] behind the persistent tokens;
    `window`: (offsets, ids) of documents (_ulysses_documents), or None."""
    xp = block.with_prefix(keys)
    if window is None:
        return block.window_attention(xp, halo, block.context.rank * (keys.shape[1] - halo))
    return block.document_window(xp, *window, halo)
