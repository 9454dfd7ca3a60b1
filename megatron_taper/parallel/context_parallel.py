"""Context parallelism (parallel.cp): each sequence is split over the ranks of a cp group.

Every rank of a cp group receives the same samples (the data loader serves the group as one dp
rank) and keeps its slice of each sequence, with the load-balanced causal split of Megatron-core
and torchtitan: the S tokens are cut into 2 cp chunks of c = S / (2 cp) and cp rank r holds chunks
r and 2 cp - 1 - r, so every rank does the same causal attention work (an early chunk attends to
few keys, a late one to many).

    tokens [B, S + 1] -> inputs, targets [B, S] -> this rank's [B, S / cp]     (split)
    positions [S / cp]: the true positions of those tokens                    (positions)

The model sees only its slice; its `context` attributes (models/transformer.py, models/layers.py
Attention) hold this SequenceSplit, which gives the RoPE positions and attends over the whole
sequence (`attend`, all-gather of K/V):

    k, v [B, K, S / cp, E] (RoPE applied at the true positions)
      -> all-gather over cp -> [B, K, S, E] in rank order (each rank's two chunks in turn)
    q [B, H, S / cp, E] attends to them under the causal mask at the true positions
      (key position <= query position; ALiBi: the bias -slope_h x distance of the true positions)
    backward: the gathered k, v gradients are reduce-scattered back to the ranks holding them

Communication per attention layer and micro-batch, per rank: forward an all-gather receiving
2 x B x K x S x E x (cp - 1) / cp elements (K and V), backward a reduce-scatter of the same size.
Memory: the gathered K and V ([B, K, S, E] each, the whole sequence) are kept for backward in every
layer, beside the activations of the rank's S / cp tokens (cost/memory.py).

Loss (`split_loss`): each rank's share is the sum of its tokens' losses x cp / the kept targets of
the whole sequence (a scalar all-reduce of the count), so that the mean of the shares over the cp
group is the loss of the whole sequence; gradients are averaged over dp x cp (DDP over
ParallelContext.grad_group), which makes them the one-process gradients.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_taper.models.layers import IGNORE_INDEX, Attention, causal_mask_at
from megatron_taper.parallel.tensor import gather_from_seq_region


@dataclass(frozen=True)
class SequenceSplit:
    """The load-balanced causal split of sequences over the cp group (module doc)."""

    cp: int
    rank: int  # this rank's index in the cp group
    group: dist.ProcessGroup

    def positions_of(self, rank: int, local_len: int, device: torch.device) -> torch.Tensor:
        """True positions [local_len] of the tokens cp rank `rank` holds (chunks rank, 2 cp - 1 - rank)."""
        c = local_len // 2
        late = 2 * self.cp - 1 - rank
        return torch.cat((torch.arange(rank * c, (rank + 1) * c, device=device),
                          torch.arange(late * c, (late + 1) * c, device=device)))

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """True positions of this rank's `local_len` tokens."""
        return self.positions_of(self.rank, local_len, device)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, ...] the whole sequence -> [B, S / cp, ...] this rank's two chunks."""
        chunks = x.chunk(2 * self.cp, dim=1)
        return torch.cat((chunks[self.rank], chunks[2 * self.cp - 1 - self.rank]), dim=1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               slopes: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole sequence's keys: q [B, H, s, E],
        k, v [B, K, s, E] at this rank's positions (s = S / cp); `slopes` [H]: ALiBi. -> [B, H, s, E]."""
        s = q.shape[2]
        # all-gather along the sequence (dim 1 of [B, s, K, E]); backward reduce-scatters
        k_all, v_all = (gather_from_seq_region(t.transpose(1, 2), self.group).transpose(1, 2) for t in (k, v))
        q_pos = self.positions(s, q.device)
        k_pos = torch.cat([self.positions_of(r, s, q.device) for r in range(self.cp)])
        mask = causal_mask_at(q_pos, k_pos, slopes)
        if slopes is not None:
            mask = mask.to(q.dtype)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def apply_context_parallel(model: nn.Module, split: SequenceSplit) -> None:
    """Hand `split` to the model and to each of its attention modules (their `context`)."""
    model.context = split
    for module in model.modules():
        if isinstance(module, Attention):
            module.context = split


def split_batch(split: SequenceSplit | None, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of tokens [B, S + 1]: the whole [B, S] each, or this rank's slices."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if split is None:
        return inputs, targets
    return split.split(inputs), split.split(targets)


def split_loss(logits: torch.Tensor, targets: torch.Tensor, inner, split: SequenceSplit) -> torch.Tensor:
    """This rank's share of the loss of the whole sequence (module doc): `inner` (the mean over
    this rank's kept targets) x kept x cp / kept over the cp group. A rank whose targets are all
    IGNORE_INDEX gives NaN, as `inner` does."""
    mean = inner(logits, targets)
    kept = (targets != IGNORE_INDEX).sum().to(torch.float32)
    total = kept.clone()
    dist.all_reduce(total, group=split.group)
    return mean * (kept * split.cp / total)


def cp_mean(value: torch.Tensor, split: SequenceSplit | None) -> torch.Tensor:
    """The mean of a per-rank loss share over the cp group: the loss of the whole sequence."""
    if split is None:
        return value
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.AVG, group=split.group)
    return value
