"""The memory bridge under context parallelism.

Context parallelism (contiguous split; slices of whole segments, check_bridge_layout): cp rank r's
slice starts from the state rank r - 1's slice ended with and hands its own end state on
(parallel/cp/state.py's chain: [B, m, D] once per window and direction); the auxiliary loss is each
rank's share of the whole sequence's mean. Attention makes every cp rank meet in each block, so the
bridge's writes run in turn: cp times one slice's. With `carry_state` S_n is the last cp rank's;
`take_state` broadcasts it over the cp group (B m D once per micro-batch), so cp rank 0 starts the
row's next window from it and every rank saves the same state in its checkpoint.

Documents (doc_start; `block_documents`): the block all-gathers the ranks' doc_start once (B x S
bytes; SequenceSplit.sequence_starts), which gives attention the document ids of the whole sequence
and every token its offset in its document. The bridge packs its slice's documents as one process
does (each moved to a segment boundary, its segments counted from its first token), and the
chain's message carries what the slice's first document needs when it continues the previous
slice's last one (fixed shapes, every hop):
      state   [B, m, D]: the state at the start of that document's open segment (the one the slice
              boundary cuts; after its last segment when none is open)
      tail    [B, T - 1, D]: the sender's last T - 1 packed input rows; the receiver puts the open
              segment's (offset mod T) of them in front of its first document, so that the segment
              is written whole (its tokens' reads of the state are the sender's)
A slice whose first token starts a document starts it from init_state. The auxiliary loss counts
an open segment on the rank that writes it (the receiver) and divides by the number of counted
segments of the whole sequence (from the offsets), so that the cp ranks' shares average to it.
With `carry_state` the last rank's S_n is the state after the last document's last segment, as in
one process. Bytes per hop and direction: B m D + B (T - 1) D in the activations' dtype
(cost.py cp_state_bytes and bridge_cp_document_messages).

MemoryBridge (bridge/model.py) calls `receive` and `send` on its slice (`forward_documents` with
documents); `take_state` calls `from_last_rank`. The chain's bytes: bridge/cost.py cp_state_bytes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_taper.models.layers import document_ids
from megatron_taper.models.titans.documents import document_positions, pack_documents

if TYPE_CHECKING:
    from megatron_taper.models.bridge.model import BridgeBlock, MemoryBridge
    from megatron_taper.parallel.cp.split import SequenceSplit


def receive(bridge: MemoryBridge, state: torch.Tensor) -> torch.Tensor:
    """The state [B, m, D] cp rank r - 1's slice ended with (cp rank r > 0)."""
    from megatron_taper.parallel.cp.state import receive_state  # the model stays single-device until cp is applied

    (state,) = receive_state(bridge.context, bridge.context_tag, (state,))
    return state


def send(bridge: MemoryBridge, out: torch.Tensor, message: tuple[torch.Tensor, ...] | None,
         writes: bool) -> torch.Tensor:
    """The bridge's output `out` after this slice: tied to the write's parameters where the slice
    writes nothing (not `writes`), and with `message` (its end state, and with documents the tail)
    handed to cp rank r + 1 where it has one."""
    from megatron_taper.parallel.cp.state import send_state, tie

    if not writes:  # a last slice of one segment writes nothing: zero gradients (DDP)
        out = tie(out, *(p for m in (bridge.write_input_norm, bridge.write_state_norm, bridge.write, bridge.gru)
                         for p in m.parameters()))
    if message is not None:  # rank r + 1 starts from this slice's end state
        out = send_state(bridge.context, bridge.context_tag, out, message)
    return out


def block_documents(block: BridgeBlock, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    doc_start: torch.Tensor) -> torch.Tensor:
    """BridgeBlock.forward of this rank's slice x [B, s, D] of documents (doc_start [B, s])."""
    starts = block.attn.context.sequence_starts(doc_start)  # [B, S] the whole sequence's (all-gather)
    if block.bridge is not None:
        x = block.bridge(x, doc_start, document_positions(starts))
    xn = block.attn_norm(x)
    x = x + block.attn.project_out(block.attn.attend(xn, cos, sin, doc_ids=document_ids(starts)), xn)
    return x + block.mlp(block.mlp_norm(x))


def forward_documents(bridge: MemoryBridge, x: torch.Tensor, doc_start: torch.Tensor,
                      offsets: torch.Tensor) -> torch.Tensor:
    """MemoryBridge.forward of this rank's slice x [B, s, D] of documents (doc_start [B, s]; offsets
    [B, S]: every token's offset in its document over the whole sequence), module doc."""
    from megatron_taper.parallel.cp.state import receive_state

    split, t = bridge.context, bridge.segment
    batch, s, dim = x.shape
    mine = offsets[:, split.positions(s, x.device)]  # [B, s]
    local = mine == 0  # a document starts here (the sequence's first token included)
    tail_like = (x.new_zeros(batch, t - 1, dim),) if t > 1 else ()
    if split.rank == 0:  # the window's first document: the carried state where the row continues
        initial = bridge.initial_state(x, doc_start[:, 0])
        packing = pack_documents(doc_start, t)
        xp = packing.pack(x)
    else:
        initial = bridge.initial_state(x, torch.ones_like(local[:, 0]))  # init_state
        received, *tail = receive_state(split, bridge.context_tag, (initial, *tail_like))
        initial = torch.where(local[:, :1, None], initial, received)
        carried = mine[:, 0] % t  # the open segment's rows before the slice
        packing = pack_documents(local, t, carried=carried, offset=mine[:, 0] - carried, carried_rows=t - 1)
        xp = packing.pack(x, carried_rows=tail[0] if tail else None)
    sends = split.rank < split.cp - 1
    states = bridge.states(xp, last=bridge.carry_state or sends, packing=packing, initial=initial)
    n = xp.shape[1] // t
    if bridge.carry_state:  # the last rank's S_n is the window's (take_state hands it to every cp rank)
        bridge.carry_out = states[:, -1].detach()
    out = x + torch.sigmoid(bridge.gate(bridge.read_norm(x))) * packing.unpack(
        bridge.read_states(bridge.read_norm(xp), states[:, :n]))
    end = packing.dest[:, -1]  # [B] the packed row of the slice's last token
    if bridge.aux_head is not None and bridge.training and torch.is_grad_enabled():
        opened = torch.zeros(batch, n, dtype=torch.bool, device=x.device)  # an open segment the next rank writes
        if sends:
            continued = offsets[:, split.positions(s, x.device)[-1] + 1] > 0  # the next slice continues it
            opened[torch.arange(batch, device=x.device), end // t] = ((end + 1) % t != 0) & continued
        counted = ((offsets % t == 0) & (offsets > 0)).sum()  # the whole sequence's segments after a first
        aux = bridge.aux_loss_documents(xp, states[:, :n], packing, opened, counted.clamp(min=1) / split.cp)
        out = bridge.with_aux_loss(out, aux)
    message = None
    if sends:
        state = states[torch.arange(batch, device=x.device), (end + 1) // t]  # the open segment's start state
        index = (end[:, None] - t + 2 + torch.arange(t - 1, device=x.device)).clamp(min=0)  # [B, T - 1]
        message = (state, *((xp.gather(1, index[..., None].expand(-1, -1, dim)),) if t > 1 else ()))
    return send(bridge, out, message, states.shape[1] > n or n > 1)


def from_last_rank(state: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """The last cp rank's `state`, on every rank of the split's group (B m D once per micro-batch)."""
    state = state.contiguous()
    dist.broadcast(state, src=dist.get_process_group_ranks(split.group)[-1], group=split.group)
    return state
