"""What one slice of a sequence needs from the slices before it, under context parallelism.

Families whose state runs along the sequence (the recurrent memories) split each sequence
contiguously over the cp group (context_parallel.SequenceSplit with balanced=False): cp rank r
holds tokens [r S / cp, (r + 1) S / cp), so its slice starts where rank r - 1's ends. Three ways to
hand over what a slice needs, all differentiable (gradients travel back the same way):

chain, for updates that do not compose (deep memories, GRU states, online MLP levels):

    state = receive_state(split, tag, initial)   rank 0: `initial`; rank r > 0: rank r - 1's end
                                                 state (same shapes and dtypes as `initial`)
    y = send_state(split, tag, y, end_state)     hands end_state to rank r + 1, returns y

    forward   rank r - 1 -> r: the end state of the slice (point-to-point, once per layer and call)
    backward  rank r -> r - 1: the gradient of the state rank r received; send_state's backward
              waits for it before the rest of the layer's backward runs
    `y` is a tensor the rest of the model reads (the layer's output), so that send_state's
    backward runs before the backward of what produced end_state. On rank r > 0 `initial` is not
    read, but it receives a zero gradient, so every parameter has one on every rank (DDP).

    Cost: rank r waits for rank r - 1 at each layer, so the ranks run as a wavefront: when
    nothing else in a layer makes all cp ranks meet, L layers take L + cp - 1 layer-slices of time
    forward and backward instead of L; when a layer also has a collective over the cp group (e.g.
    attention over the whole sequence), each layer's chain runs in turn on every rank: the recurrent
    part takes cp times its one-slice time. Bytes: the state's size, once per layer and direction.

prefix, for updates that compose associatively (a linear memory with decay, decayed sums):

    state = prefix_state(split, initial, summary, combine)
        every rank's summary of its own slice (e.g. a decay product and the state its slice reaches
        from zero) is all-gathered (backward: reduce-scatter), and each rank folds those of the ranks
        before it into `initial` with the family's `combine`; nobody waits in a chain. Bytes: the
        summary's size x (cp - 1) per layer and direction. gather_states(split, t) is the all-gather
        alone (e.g. cached states that later slices read).

halo, for windows over the last tokens (sliding-window attention, causal convolutions):

    before = previous_rows(split, tag, x, rows)  [B, rows, ...]: the last `rows` rows (dim 1) of
                                                 rank r - 1's x; zeros on rank 0

    forward  rank r - 1 -> r: [B, rows, ...]; backward  rank r -> r - 1: their gradient, added to
    rank r - 1's x. `rows` must not exceed the slice (S / cp).

Tags: messages in flight at once between the same two ranks are told apart by `tag` (the
caller's, e.g. the layer's index, < 1024) and by the tensor's index in the state (< 64).

Activation checkpointing recomputes a block's forward inside backward, where the other ranks do not
send again: a recomputed receive (one called while a backward runs) returns what the forward
received (kept in split.received, oldest first per tag, until its own backward), and a recomputed
send sends nothing. This holds while each tag's recomputations come in the order of their
forwards (gradient accumulation, 1F1B). Collectives in the block (attention's or gather_states'
all-gather) do run again in the recompute, on every rank: send_state's backward triggers the
block's recompute before it waits for rank r + 1 (which recomputes before it sends), so no rank
waits in the chain while another waits for it in the all-gather.
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_taper.parallel.cp.split import SequenceSplit
from megatron_taper.parallel.tp.layers import gather_from_seq_region

_STATE_TAGS, _GRAD_TAGS, _HALO_TAGS, _HALO_GRAD_TAGS = 1 << 16, 2 << 16, 3 << 16, 4 << 16


def _tag(base: int, tag: int, index: int) -> int:
    assert 0 <= tag < 1024 and 0 <= index < 64, (tag, index)
    return base + tag * 64 + index


def _p2p(split: SequenceSplit, base: int, tag: int, to_next: Sequence[torch.Tensor] = (),
         from_previous: Sequence[torch.Tensor] = (), to_previous: Sequence[torch.Tensor] = (),
         from_next: Sequence[torch.Tensor] = ()) -> None:
    """Send to / fill from cp ranks r + 1 and r - 1 (no wrap-around), and wait for all of it."""
    ranks = dist.get_process_group_ranks(split.group)
    ops = []
    for tensors, op, offset in ((to_next, dist.isend, 1), (from_previous, dist.irecv, -1),
                                (to_previous, dist.isend, -1), (from_next, dist.irecv, 1)):
        for i, t in enumerate(tensors):
            ops.append(dist.P2POp(op, t if op is dist.irecv else t.contiguous(), ranks[split.rank + offset],
                                  split.group, _tag(base, tag, i)))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _like(tensors: Sequence[torch.Tensor]) -> list[tuple]:
    return [(t.shape, t.dtype, t.device) for t in tensors]


def _empty(like: list[tuple], zeros: bool = False) -> list[torch.Tensor]:
    make = torch.zeros if zeros else torch.empty
    return [make(shape, dtype=dtype, device=device) for shape, dtype, device in like]


def _recomputing() -> bool:
    """Whether this forward runs inside a backward (activation checkpointing's recompute)."""
    return torch._C._current_graph_task_id() != -1


def _receive_once(split: SequenceSplit, key: tuple, receive: Callable[[], list[torch.Tensor]],
                  keep: bool) -> list[torch.Tensor]:
    """receive(), or under recompute what the forward of `key` received (module doc); `keep`: a
    backward will follow (grad mode was on at the call), so keep what was received until then."""
    kept = split.received.setdefault(key, collections.deque())
    if _recomputing():
        return kept[0]
    out = receive()
    if keep:
        kept.append(out)
    return out


def _release(split: SequenceSplit, key: tuple) -> None:
    """The backward of `key`'s oldest forward ran: its kept tensors are no longer needed."""
    split.received[key].popleft()


class _ReceiveState(torch.autograd.Function):
    @staticmethod
    def forward(ctx, split, tag, anchor, *initial):
        ctx.split, ctx.tag, ctx.like = split, tag, _like(initial)

        def receive():
            received = _empty(ctx.like)
            _p2p(split, _STATE_TAGS, tag, from_previous=received)
            return received
        return tuple(t.clone() for t in _receive_once(split, ("state", tag), receive, anchor is not None))

    @staticmethod
    def backward(ctx, *grads):
        _release(ctx.split, ("state", ctx.tag))
        zeros = _empty(ctx.like, zeros=True)
        _p2p(ctx.split, _GRAD_TAGS, ctx.tag, to_previous=[z if g is None else g for g, z in zip(grads, zeros)])
        return (None, None, None, *zeros)


class _SendState(torch.autograd.Function):
    @staticmethod
    def forward(ctx, split, tag, y, *state):
        ctx.split, ctx.tag, ctx.like = split, tag, _like(state)
        if not _recomputing():
            _p2p(split, _STATE_TAGS, tag, to_next=state)
        ctx.save_for_backward(y)  # only for its unpacking in backward (below)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        # under activation checkpointing, unpacking a saved tensor recomputes the region first, as
        # rank r + 1 does before it sends this gradient: a collective in the region (attention's
        # all-gather) then runs on both ranks before this rank waits (without it they deadlock)
        _ = ctx.saved_tensors
        grads = _empty(ctx.like)
        _p2p(ctx.split, _GRAD_TAGS, ctx.tag, from_next=grads)
        return (None, None, grad, *grads)


def receive_state(split: SequenceSplit, tag: int, initial: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The state this rank's slice starts from: `initial` on cp rank 0, else rank r - 1's end state."""
    if split.rank == 0:
        return tuple(initial)
    # under grad mode a leaf that requires grad, so that the received state does (and its gradient
    # is sent back) even where `initial` does not
    anchor = torch.empty(0, device=initial[0].device, requires_grad=True) if torch.is_grad_enabled() else None
    return _ReceiveState.apply(split, tag, anchor, *initial)


def send_state(split: SequenceSplit, tag: int, y: torch.Tensor, end_state: Sequence[torch.Tensor]) -> torch.Tensor:
    """Hand `end_state` (this slice's end state) to cp rank r + 1; returns `y` (module doc)."""
    if split.rank == split.cp - 1:
        return y
    return _SendState.apply(split, tag, y, *end_state)


def gather_states(split: SequenceSplit, summary: torch.Tensor) -> torch.Tensor:
    """[cp, ...]: every cp rank's `summary` [...] in rank order (all-gather; backward
    reduce-scatters). The backward is a collective, so every rank's loss must depend on the
    result: pass what a rank does not read through `tie`."""
    return gather_from_seq_region(summary[None, None], split.group)[0]


class _Tie(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *others):
        ctx.like = _like(others)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *_empty(ctx.like, zeros=True))


def tie(x: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """x, with `others` in its backward (a zero gradient): their backward then runs on this rank
    even where nothing else reads them (gather_states' collective needs every rank)."""
    return _Tie.apply(x, *others) if torch.is_grad_enabled() else x


def prefix_state(split: SequenceSplit, initial: Sequence[torch.Tensor], summary: Sequence[torch.Tensor],
                 combine: Callable[[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]
                 ) -> tuple[torch.Tensor, ...]:
    """The state this rank's slice starts from, for an associative update: `initial` (the
    sequence's start) folded with the `summary` of each cp rank before this one, in order, by
    `combine(state, summary) -> state`. `summary`: what this rank's slice does to a state (e.g. a
    decay product and the state it reaches from zero)."""
    gathered = [gather_states(split, t) for t in summary]  # each [cp, ...]
    state = tuple(initial)
    for r in range(split.rank):
        state = combine(state, tuple(g[r] for g in gathered))
    return tuple(tie(t, *gathered) for t in state)


class _PreviousRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, split, tag, x, rows, keep):
        ctx.split, ctx.tag, ctx.shape, ctx.rows = split, tag, x.shape, rows
        tail = x[:, x.shape[1] - rows:]

        def receive():
            received = torch.zeros_like(tail)
            _p2p(split, _HALO_TAGS, tag, to_next=[tail] if split.rank < split.cp - 1 else [],
                 from_previous=[received] if split.rank > 0 else [])
            return [received]
        return _receive_once(split, ("rows", tag), receive, keep)[0].clone()

    @staticmethod
    def backward(ctx, grad):
        split = ctx.split
        _release(split, ("rows", ctx.tag))
        dx = grad.new_zeros(ctx.shape)
        from_next = [torch.empty_like(grad)] if split.rank < split.cp - 1 else []
        _p2p(split, _HALO_GRAD_TAGS, ctx.tag, to_previous=[grad] if split.rank > 0 else [], from_next=from_next)
        if from_next:
            dx[:, ctx.shape[1] - ctx.rows:] = from_next[0]
        return None, None, dx, None, None


def previous_rows(split: SequenceSplit, tag: int, x: torch.Tensor, rows: int) -> torch.Tensor:
    """The last `rows` rows (dim 1) of cp rank r - 1's `x` [B, s, ...]; zeros on rank 0 (module doc)."""
    if not 0 < rows <= x.shape[1]:
        raise ValueError(f"previous_rows: {rows} rows of a slice of {x.shape[1]}")
    return _PreviousRows.apply(split, tag, x, rows, torch.is_grad_enabled() and x.requires_grad)
