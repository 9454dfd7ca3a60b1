"""Context parallelism (parallel.cp): each sequence is split over the ranks of a cp group.

Every rank of a cp group receives the same samples (the data loader serves the group as one dp
rank) and keeps its slice of each sequence, with the load-balanced causal split of Megatron-core
and torchtitan: the S tokens are cut into 2 cp chunks of c = S / (2 cp) and cp rank r holds chunks
r and 2 cp - 1 - r, so every rank does the same causal attention work (an early chunk attends to
few keys, a late one to many). Families whose state passes along the sequence (the recurrent
memories: parallel/cp/state.py) take the contiguous split instead (`balanced=False`: rank r holds
chunks 2 r and 2 r + 1, tokens [r S / cp, (r + 1) S / cp)); attention over it is computed by the
same code, with rank r doing r + 1/2 of rank 0's causal work.

    tokens [B, S + 1] -> inputs, targets [B, S] -> this rank's [B, S / cp]     (split)
    positions [S / cp]: the true positions of those tokens                    (positions)

The model sees only its slice; its `context` attributes (models/transformer/model.py, models/layers.py
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
layer, beside the activations of the rank's S / cp tokens (cost/memory.py); SDPA runs under an
explicit mask, which on the CPU has no fused kernel: it keeps the attention weights [B, H, S / cp,
S] (measured: docs/architectures.md).

parallel.cp_attention=ulysses (parallel/cp/ulysses.py): q, k and v go all-to-all from sequence-sharded to
head-sharded instead, attention runs over the whole sequence for the rank's share of the heads, and the
outputs come back by a second all-to-all.

parallel.cp_attention=ring (`_RingAttention`): K and V blocks travel around the ring instead.

    forward   cp steps: attend to the block held (the rank's own first, then the one received
              from cp rank r - 1 at the step before), merge the block's output by its
              log-sum-exp (online softmax), pass the block on to r + 1 while computing (isend /
              irecv of [B, K, S / cp, E] x 2)
    saved     q, k, v of the rank's slice, the merged output and log-sum-exp [B, H, S / cp]
    backward  cp steps again: each block's dq, dk, dv from the saved global output and
              log-sum-exp (as flash attention's backward); the block's dk, dv accumulate as they
              travel with it, and one last step hands them to the rank that owns it

Bytes sent per rank and layer, in blocks of [2, B, K, S / cp, E]: forward cp - 1 (as the
all-gather), backward cp - 1 blocks of K, V plus cp of their gradients (the all-gather's
reduce-scatter: cp - 1), in point-to-point steps that overlap the blocks' attention; only the
rank's own K and V are kept for backward. Each block's attention is computed here in fp32 matmuls,
not by a fused kernel: per (query tile of at most `tile` rows of one chunk, key chunk) pair,
[B, H, tile, S / (2 cp)] scores at a time, masked by causal_mask_at where the pair needs it and
skipped where every key lies after every query.

Packed documents (data.document_mask: the model's doc_start, each rank its slice [B, S / cp]):
attention keeps to each query's document in every mode. Each attention layer all-gathers the
ranks' doc_start slices (uint8, B x S / cp bytes per rank, beside K/V's 2 x B x K x S / cp x E
elements) and counts starts along the whole sequence (`document_ids`, in position order), so a
document that spans slices has one id on every rank; the causal mask (the all-gather's, each ring
piece's, and Ulysses' over the whole sequence for the rank's heads) is ANDed with "same document"
(ALiBi's bias set to -inf outside it); a Hope-attention or bridge block gathers the starts once
(`sequence_starts`) for its attention and its chain. Every ring piece then carries a mask; pieces whose pairs are
all in other documents are still computed (skipping them would need the ids on the host).

train.compile=true (each block compiled, parallel/block_options.py): the all-gather traces into the
block's graph (measured, torch 2.13: no graph break, one graph per block); the ring's
batch_isend_irecv is a graph break (dynamo: "P2P compilation is disabled"), so the ring's steps run
eagerly between the compiled pieces (measured: 7 breaks, 12 graphs for 2 blocks).

Loss (`split_loss`): each rank's share is the sum of its tokens' losses x cp / the kept targets of
the whole sequence (a scalar all-reduce of the count), so that the mean of the shares over the cp
group is the loss of the whole sequence; gradients are averaged over dp x cp (DDP over
ParallelContext.grad_group), which makes them the one-process gradients.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_taper.cost.attention_memory import CP_RING_TILE
from megatron_taper.models.layers import IGNORE_INDEX, Attention, causal_mask_at, document_ids, within_documents
from megatron_taper.parallel.cp.ulysses import ulysses_attention
from megatron_taper.parallel.tp.layers import gather_from_seq_region


@dataclass(frozen=True)
class SequenceSplit:
    """The load-balanced causal split of sequences over the cp group (module doc)."""

    cp: int
    rank: int  # this rank's index in the cp group
    group: dist.ProcessGroup
    # parallel.cp_attention: allgather (K/V of the whole sequence) | ring (K/V passed around the
    # ring) | ulysses (all-to-all to the whole sequence for a share of the heads, parallel/cp/ulysses.py)
    attention: str = "allgather"
    tile: int = CP_RING_TILE  # ring: query rows per piece of a block's attention ([B, H, rows, C] scores)
    # True: the load-balanced causal split (chunks r and 2 cp - 1 - r); False: contiguous (chunks 2 r
    # and 2 r + 1, i.e. rank r holds tokens [r S / cp, (r + 1) S / cp)), for the families whose state
    # passes from one slice to the next in sequence order (parallel/cp/state.py)
    balanced: bool = True
    # parallel/cp/state.py: what each (kind, tag) received in forwards whose backward has not run
    # yet, oldest first, for the forward that activation checkpointing recomputes inside backward
    received: dict = field(default_factory=dict, compare=False, repr=False)

    def chunk_ids(self, rank: int) -> tuple[int, int]:
        """Indices of the two of the 2 cp equal chunks of the sequence that cp rank `rank` holds."""
        return (rank, 2 * self.cp - 1 - rank) if self.balanced else (2 * rank, 2 * rank + 1)

    def chunk_starts(self, rank: int, chunk: int) -> tuple[int, int]:
        """First positions of the two chunks of `chunk` tokens that cp rank `rank` holds."""
        first, second = self.chunk_ids(rank)
        return first * chunk, second * chunk

    def positions_of(self, rank: int, local_len: int, device: torch.device) -> torch.Tensor:
        """True positions [local_len] of the tokens cp rank `rank` holds (its two chunks, chunk_ids)."""
        c = local_len // 2
        return torch.cat([torch.arange(start, start + c, device=device) for start in self.chunk_starts(rank, c)])

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """True positions of this rank's `local_len` tokens."""
        return self.positions_of(self.rank, local_len, device)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, ...] the whole sequence -> [B, S / cp, ...] this rank's two chunks."""
        chunks = x.chunk(2 * self.cp, dim=1)
        first, second = self.chunk_ids(self.rank)
        return torch.cat((chunks[first], chunks[second]), dim=1)

    def pass_on(self, x: torch.Tensor, tag: int = 0):
        """Send x to cp rank r + 1 and receive the same shape from r - 1 (in the background); a
        function that waits and returns what was received. `tag` tells apart transfers in flight
        at once (a block and the gradients travelling with another)."""
        world = dist.get_process_group_ranks(self.group)
        received = torch.empty_like(x)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, x.contiguous(), world[(self.rank + 1) % self.cp], self.group, tag),
            dist.P2POp(dist.irecv, received, world[(self.rank - 1) % self.cp], self.group, tag)])

        def wait() -> torch.Tensor:
            for work in works:
                work.wait()
            return received
        return wait

    def gathered_positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """True positions [S] of the whole sequence in the order an all-gather over the cp group
        lays it out (each rank's two chunks in rank order)."""
        return torch.cat([self.positions_of(r, local_len, device) for r in range(self.cp)])

    def sequence_starts(self, doc_start: torch.Tensor) -> torch.Tensor:
        """doc_start [B, S] of the whole sequence, in position order, from this rank's [B, s]: every
        rank's starts all-gathered (uint8, B x S bytes)."""
        s = doc_start.shape[1]
        gathered = gather_from_seq_region(doc_start.to(torch.uint8), self.group)  # [B, S] in rank order
        starts = torch.empty_like(gathered)
        starts[:, self.gathered_positions(s, doc_start.device)] = gathered
        return starts.bool()

    def document_ids(self, doc_start: torch.Tensor) -> torch.Tensor:
        """Document ids [B, S] of the whole sequence, in position order, from this rank's doc_start
        [B, s] (sequence_starts), counted along the whole sequence, so that ids agree across slices
        (models/layers.py document_ids)."""
        return document_ids(self.sequence_starts(doc_start))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor | None = None,
               doc_start: torch.Tensor | None = None, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole sequence's keys: q [B, H, s, E],
        k, v [B, K, s, E] at this rank's positions (s = S / cp); `slopes` [H]: ALiBi; `doc_start`
        [B, s] (this rank's tokens): only keys of the query's document (ids over the whole
        sequence: document_ids), or `ids` [B, S] when the caller has them already. -> [B, H, s, E]."""
        if ids is None and doc_start is not None:
            ids = self.document_ids(doc_start)
        if self.attention == "ring":
            return _RingAttention.apply(q, k, v, slopes, self, ids)
        if self.attention == "ulysses":
            return ulysses_attention(q, k, v, slopes, self, ids)
        s = q.shape[2]
        # all-gather along the sequence (dim 1 of [B, s, K, E]); backward reduce-scatters
        k_all, v_all = (gather_from_seq_region(t.transpose(1, 2), self.group).transpose(1, 2) for t in (k, v))
        q_pos = self.positions(s, q.device)
        k_pos = self.gathered_positions(s, q.device)
        mask = within_documents(causal_mask_at(q_pos, k_pos, slopes), ids, q_pos, k_pos)
        if slopes is not None:
            mask = mask.to(q.dtype)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def _block_scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled scores [B, H, s, t] in fp32 of q [B, H, s, E] over k [B, H, t, E]; `mask`: None (all
    visible), boolean (True = may attend) or an additive bias, [s, t], [H, s, t] or (documents)
    [B, 1 or H, s, t]."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return scores + mask


def _heads(t: torch.Tensor, n: int) -> torch.Tensor:
    """[B, K, t, E] -> [B, n, t, E] in fp32, each kv head repeated for its query heads (GQA)."""
    return (t if t.shape[1] == n else t.repeat_interleave(n // t.shape[1], dim=1)).float()


def _fold(t: torch.Tensor, k: int) -> torch.Tensor:
    """The gradient of _heads: [B, n, t, E] summed back to [B, k, t, E]."""
    return t if t.shape[1] == k else t.unflatten(1, (k, -1)).sum(2)


def _pieces(split: SequenceSplit, s: int, owner: int, slopes: torch.Tensor | None, device: torch.device,
            ids: torch.Tensor | None = None):
    """The pieces of this rank's attention over the block of cp rank `owner`: (query rows, key rows,
    mask or None) per (query tile of at most split.tile rows of one chunk, key chunk), leaving out
    the pairs where every key lies after every query (half of the diagonal blocks' work). With
    document ids [B, S] (position order) every piece is also masked to pairs in one document."""
    c = s // 2
    out = []
    for qi, q0 in enumerate(split.chunk_starts(split.rank, c)):
        for lo in range(0, c, split.tile):
            hi = min(lo + split.tile, c)
            for ki, k0 in enumerate(split.chunk_starts(owner, c)):
                if k0 >= q0 + hi:
                    continue
                mask = None
                q_pos, k_pos = torch.arange(q0 + lo, q0 + hi, device=device), torch.arange(k0, k0 + c, device=device)
                if slopes is not None or k0 + c - 1 > q0 + lo or ids is not None:
                    mask = within_documents(causal_mask_at(q_pos, k_pos, slopes), ids, q_pos, k_pos)
                out.append((slice(qi * c + lo, qi * c + hi), slice(ki * c, (ki + 1) * c), mask))
    return out


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, slopes, split, ids):
        # q [B, H, s, E]; k, v [B, K, s, E] at this rank's positions
        h, s = q.shape[1], q.shape[2]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)  # [B, H, s]
        block = torch.stack((k, v))  # [2, B, K, s, E]
        for step in range(split.cp):
            pending = split.pass_on(block) if step < split.cp - 1 else None
            kh, vh = _heads(block[0], h), _heads(block[1], h)
            for rows, keys, mask in _pieces(split, s, (split.rank - step) % split.cp, slopes, q.device, ids):
                scores = _block_scores(q[:, :, rows], kh[:, :, keys], mask)  # [B, H, tile, C]
                old = lse[:, :, rows]
                new = torch.logaddexp(old, scores.logsumexp(-1))
                safe = torch.where(torch.isinf(new), 0.0, new).unsqueeze(-1)
                out[:, :, rows] = (out[:, :, rows] * (old.unsqueeze(-1) - safe).exp()
                                   + (scores - safe).exp() @ vh[:, :, keys])
                lse[:, :, rows] = new
            if pending is not None:
                block = pending()
        ctx.save_for_backward(q, k, v, out, lse, slopes, ids)
        ctx.split = split
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, slopes, ids = ctx.saved_tensors
        split = ctx.split
        h, s, kv_heads = q.shape[1], q.shape[2], k.shape[1]
        grad = grad.float()
        delta = (grad * out).sum(-1, keepdim=True)  # [B, H, s, 1]
        safe = torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1)
        scale = q.shape[-1] ** -0.5
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        block = torch.stack((k, v))
        dblock = None  # the gradients travelling with `block`
        for step in range(split.cp):
            pending = split.pass_on(block) if step < split.cp - 1 else None
            kh, vh = _heads(block[0], h), _heads(block[1], h)
            dkh, dvh = torch.zeros_like(kh), torch.zeros_like(vh)
            for rows, keys, mask in _pieces(split, s, (split.rank - step) % split.cp, slopes, q.device, ids):
                p = (_block_scores(q[:, :, rows], kh[:, :, keys], mask) - safe[:, :, rows]).exp()  # [B, H, tile, C]
                ds = p * (grad[:, :, rows] @ vh[:, :, keys].transpose(-1, -2) - delta[:, :, rows]) * scale
                dq[:, :, rows] += ds @ kh[:, :, keys]
                dkh[:, :, keys] += ds.transpose(-1, -2) @ q[:, :, rows].float()
                dvh[:, :, keys] += p.transpose(-1, -2) @ grad[:, :, rows]
            travelling = torch.stack((_fold(dkh, kv_heads), _fold(dvh, kv_heads)))
            if dblock is not None:
                travelling += dblock
            dblock = split.pass_on(travelling, tag=1)()  # to the next rank, with the block it belongs to
            if pending is not None:
                block = pending()
        # dblock now holds the gradients of this rank's own block (each ended one step past its owner)
        return dq.to(q.dtype), dblock[0].to(k.dtype), dblock[1].to(v.dtype), None, None, None


def apply_context_parallel(model: nn.Module, split: SequenceSplit) -> None:
    """Hand `split` to the model and to each of its modules that has a `context` attribute (the
    attention modules, and the family modules that pass state between slices, parallel/cp/state.py),
    and give each of those a `context_tag`: its index among them, which tells its messages apart
    from other layers' messages in flight at the same time."""
    model.context = split
    holders = [m for m in model.modules() if m is not model and (isinstance(m, Attention) or hasattr(m, "context"))]
    for tag, module in enumerate(holders):
        module.context = split
        module.context_tag = tag


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
