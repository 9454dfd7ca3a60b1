"""The memory bridge under context parallelism.

Context parallelism (contiguous split; slices of whole segments, check_bridge_layout): cp rank r's
slice starts from the state rank r - 1's slice ended with and hands its own end state on
(parallel/cp/state.py's chain: [B, m, D] once per window and direction); the auxiliary loss is each
rank's share of the whole sequence's mean. Attention makes every cp rank meet in each block, so the
bridge's writes run in turn: cp times one slice's. With `carry_state` S_n is the last cp rank's;
`take_state` broadcasts it over the cp group (B m D once per micro-batch), so cp rank 0 starts the
row's next window from it and every rank saves the same state in its checkpoint.

MemoryBridge (bridge/model.py) calls `receive` and `send` on its slice; `take_state` calls
`from_last_rank`. The chain's bytes: bridge/cost.py cp_state_bytes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megatron_taper.models.bridge.model import MemoryBridge
    from megatron_taper.parallel.cp.split import SequenceSplit


def receive(bridge: MemoryBridge, state: torch.Tensor) -> torch.Tensor:
    """The state [B, m, D] cp rank r - 1's slice ended with (cp rank r > 0)."""
    from megatron_taper.parallel.cp.state import receive_state  # the model stays single-device until cp is applied

    (state,) = receive_state(bridge.context, bridge.context_tag, (state,))
    return state


def send(bridge: MemoryBridge, out: torch.Tensor, end: torch.Tensor | None, n: int, sends: bool) -> torch.Tensor:
    """The bridge's output `out` after this slice of n segments: tied to the write's parameters where
    the slice writes nothing, and with its end state handed to cp rank r + 1 where it `sends`."""
    from megatron_taper.parallel.cp.state import send_state, tie

    if end is None and n == 1:  # a last slice of one segment writes nothing: zero gradients (DDP)
        out = tie(out, *(p for m in (bridge.write_input_norm, bridge.write_state_norm, bridge.write, bridge.gru)
                         for p in m.parameters()))
    if sends:  # rank r + 1 starts from this slice's end state
        out = send_state(bridge.context, bridge.context_tag, out, (end,))
    return out


def from_last_rank(state: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """The last cp rank's `state`, on every rank of the split's group (B m D once per micro-batch)."""
    state = state.contiguous()
    dist.broadcast(state, src=dist.get_process_group_ranks(split.group)[-1], group=split.group)
    return state
