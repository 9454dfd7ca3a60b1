"""Hope-attention under context parallelism: the chain of the online CMS levels' fast weights.

Context parallelism (contiguous split, parallel/cp/state.py): attention is the Transformer's
(all-gather or ring over the whole sequence); each online level whose period C_l is shorter
than the sequence (`chained_levels`) starts cp rank r's slice from the fast weights rank r - 1's
slice ended with (receive_state; [B, 2W, D] and [B, D, W]), makes the update at its slice's last
chunk unless it is the sequence's last, and hands the weights on (send_state), gradients flowing
back the same way: cp_state_bytes per layer and direction. The slice must hold whole chunks of
every chained level (check_hope_layout). Because attention makes every cp rank meet in each
layer, the chain is serial per layer: the CMS part of a layer takes cp times its one-slice time.

ContinuumLevel.online (hope_attention/model.py) asks `chained` and hands the weights on through
`receive_weights` and `send_weights`; the message sizes are counted in hope_attention/cost.py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from megatron_taper.models.hope_attention.model import ContinuumLevel, Weights


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
