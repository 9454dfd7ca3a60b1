"""The training loss: next-token cross entropy, plain, vocab-parallel, or over chunks of tokens.

`loss_function(loss_chunk, group, vocab_start)` picks the one a ParallelModel uses
(train.loss_chunk):

    0           models.layers.cross_entropy (tp = 1: F.cross_entropy on an fp32 copy of the
                logits) or tensor.vocab_parallel_cross_entropy (tp > 1); both keep fp32
                [tokens, V_r] buffers for backward and make more in it.
    c > 0       chunked_cross_entropy: at most c tokens' logits are ever in fp32 at once.

Chunked cross entropy, logits [N, V_r] (this rank's vocabulary slice; V_r = V at tp = 1):

    forward   per chunk of c rows: x = fp32 copy of the chunk, its row max m [c] and
              s = sum exp(x - m) [c], and the target's logit where this rank holds the target.
              tp > 1: one all-reduce MAX of m [N], then one all-reduce SUM of
              (s * exp(m - M), target logit) [2, N]: two collectives of [N], as the unchunked
              vocab-parallel loss. lse = M + log S [N].
    saved     the logits themselves (their own dtype: the head's output, bf16 under autocast),
              lse [N] fp32 and the targets; no [N, V_r] fp32 buffer.
    backward  per chunk: softmax = exp(x - lse) recomputed in fp32, minus one at the target,
              scaled by grad / count, written into the logits' gradient (the logits' dtype).
              No collectives (the softmax needs only lse, which every rank has).

So the loss costs, per token, V_r logits in the compute dtype kept for backward and V_r more for
their gradient, plus one or two fp32 chunks [c, V_r] at a time (cost/memory.py), against an fp32
log-softmax / softmax kept and two or three fp32 [V_r] in backward unchunked. The arithmetic
is the same up to float32 rounding (sums in another order): the extra cost is one more exp
pass over the logits in backward.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed as dist

from megatron_taper.models.layers import IGNORE_INDEX, cross_entropy
from megatron_taper.parallel.tp.layers import vocab_parallel_cross_entropy

Group = dist.ProcessGroup


def loss_function(loss_chunk: int, group: Group | None = None, vocab_start: int = 0
                  ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss of logits [B, S, V_r] against targets [B, S] (module doc); `group` is the tp
    group when the logits are this rank's vocabulary slice starting at `vocab_start`."""
    if loss_chunk > 0:
        return functools.partial(chunked_cross_entropy, chunk=loss_chunk, group=group, vocab_start=vocab_start)
    if group is None:
        return cross_entropy
    return functools.partial(vocab_parallel_cross_entropy, group=group, vocab_start=vocab_start)


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, chunk: int, group: Group | None = None,
                          vocab_start: int = 0) -> torch.Tensor:
    """Mean next-token loss (float32, the same on every tp rank) over the targets != IGNORE_INDEX,
    as models.layers.cross_entropy (NaN when all are ignored; their gradient is 0), computed
    `chunk` tokens at a time (module doc); logits [B, S, V_r], targets [B, S] global ids."""
    return _ChunkedCrossEntropy.apply(logits.flatten(0, -2), targets.flatten(), chunk, group, vocab_start)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, chunk, group, vocab_start):
        # logits: [N, V_r]; targets: [N] global ids or IGNORE_INDEX
        n, v = logits.shape
        ids = targets - vocab_start
        inside = (ids >= 0) & (ids < v)  # False on every rank for IGNORE_INDEX
        ids = ids.clamp(0, v - 1)
        vmax = logits.new_empty(n, dtype=torch.float32)
        stats = logits.new_empty((2, n), dtype=torch.float32)  # [sum exp(x - max), target logit]
        for lo in range(0, n, chunk):
            x = logits[lo:lo + chunk].float()  # [c, V_r]
            m = x.amax(dim=-1)
            vmax[lo:lo + chunk] = m
            stats[0, lo:lo + chunk] = (x - m.unsqueeze(-1)).exp_().sum(-1)
            stats[1, lo:lo + chunk] = x.gather(-1, ids[lo:lo + chunk].unsqueeze(-1)).squeeze(-1)
        stats[1] *= inside
        if group is not None:
            local_max = vmax.clone()
            dist.all_reduce(vmax, op=dist.ReduceOp.MAX, group=group)
            stats[0] *= (local_max - vmax).exp_()
            dist.all_reduce(stats, group=group)
        lse = vmax + stats[0].log()
        kept = targets != IGNORE_INDEX
        count = kept.sum()  # the same on every rank: targets are replicated across tp
        # 0 / 0 = NaN when every target is ignored, as F.cross_entropy
        loss = torch.where(kept, lse - stats[1], 0.0).sum() / count
        ctx.save_for_backward(logits, lse, ids, inside, kept, count)
        ctx.chunk = chunk
        return loss

    @staticmethod
    def backward(ctx, grad):
        logits, lse, ids, inside, kept, count = ctx.saved_tensors
        # ignored rows get exactly 0 (also when all are ignored, as F.cross_entropy)
        scale = kept * (grad / count.clamp(min=1))
        out = torch.empty_like(logits)
        for lo in range(0, logits.shape[0], ctx.chunk):
            hi = min(lo + ctx.chunk, logits.shape[0])
            g = (logits[lo:hi].float() - lse[lo:hi].unsqueeze(-1)).exp_()  # [c, V_r] softmax
            g[torch.arange(hi - lo, device=g.device), ids[lo:hi]] -= inside[lo:hi].to(g.dtype)
            out[lo:hi] = g.mul_(scale[lo:hi].unsqueeze(-1))
        return out, None, None, None, None
