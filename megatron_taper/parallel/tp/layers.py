"""Megatron-style tensor parallelism on plain tensors, the process group always passed explicitly.

Communication operations come in autograd pairs (f / g in the Megatron paper):

    copy_to_tp_region         forward identity             backward all-reduce
    reduce_from_tp_region     forward all-reduce           backward identity
    gather_from_seq_region    forward all-gather (seq)     backward reduce-scatter (seq)
    reduce_scatter_to_seq     forward reduce-scatter (seq) backward all-gather (seq)
    scatter_to_seq_region     forward split (seq)          backward all-gather (seq)
    gather_whole_seq          forward all-gather (seq)     backward split (seq)

Without sequence parallelism a block is  x -> f -> column-parallel ... row-parallel -> g,
with it (norm regions sharded along the sequence, dim 1 of [B, S, D]) f becomes an all-gather and
g a reduce-scatter along the sequence. A module replicated over tp that needs the whole sequence
under SP (a mixture of experts: plan.py) runs as x -> gather_whole_seq -> module ->
scatter_to_seq_region: every rank computes the same outputs and, from the all-gathered output
gradient, the same parameter and input gradients, of which it keeps its chunk.

Copies and dtypes. g sums the row-parallel partial output in place (a new tensor: no clone;
a copy only when it is strided or a dispatch mode runs, see _ReduceFromRegion), and f's backward
sums the input gradient in place when every reader is a matmul (`enter_tp_region`). Sequence
collectives keep the models' batch-major [B, S, D] layout: the all-gather lands rank r's
[B, s, D] chunk at rows r*B.. of a [tp*B, s, D] buffer and the reduce-scatter sends rows of
[tp, B, s, D]; both are views when B = 1 and cost one copy (the [tp, B] <-> [B, tp]
permutation) otherwise, and both results are contiguous. f for matmul inputs casts its input to
the matmul dtype first, so under bf16 autocast every activation collective moves bf16: forward,
the row-parallel outputs (bf16 matmul outputs) and the SP all-gather of the norm output;
backward, the input gradients of the column-parallel matmuls and, under SP, the row-parallel
outputs' gradients. The vocab-parallel embedding's sum stays fp32 (its output, like the
residual stream, is fp32 by the policy; one rank contributes each row, so the sum is exact), as
do the loss statistics.

Sharding rule (one rule for every split dimension): a dimension of n = units * unit elements is
split over tp ranks in whole units; rank r gets floor(units / tp) units, plus one for the first
units % tp ranks. So shards differ by at most one alignment unit, and a dimension with fewer than
tp units is refused. MLP widths use unit = model.taper.multiple, the vocabulary unit 1, attention
heads unit = head_dim. A `ShardSpec` may also describe replicated blocks (several ranks holding
the same slice, e.g. key/value heads when n_kv_heads < tp).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import increment_version
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from megatron_taper.models.layers import IGNORE_INDEX

Group = dist.ProcessGroup


# ---------------------------------------------------------------------------------------------
# Sharding rule


def split_sizes(n: int, tp: int, unit: int = 1, key: str = "dimension") -> list[int]:
    """Sizes of the tp shards of a dimension of n elements, in whole alignment units (see module doc)."""
    if n % unit:
        raise ValueError(f"{key}={n} is not a multiple of its alignment unit {unit}")
    units = n // unit
    if units < tp:
        raise ValueError(
            f"{key}={n} is {units} alignment unit(s) of {unit}, fewer than parallel.tp={tp}: "
            f"every tensor-parallel rank needs at least one unit"
        )
    base, extra = divmod(units, tp)
    return [(base + (r < extra)) * unit for r in range(tp)]


@dataclass(frozen=True)
class ShardSpec:
    """How a logical tensor is laid out over the tp ranks along `dim`.

    Rank r holds full.narrow(dim, starts[r], sizes[r]). Slices of different ranks either coincide
    (replicas) or do not overlap, and together they cover the whole dimension.
    """

    dim: int
    full: int
    starts: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def split(cls, dim: int, sizes: list[int]) -> "ShardSpec":
        starts = [sum(sizes[:r]) for r in range(len(sizes))]
        return cls(dim, sum(sizes), tuple(starts), tuple(sizes))

    def replicas(self, rank: int) -> int:
        """Number of ranks holding the same slice as `rank` (1 for a plain shard)."""
        mine = (self.starts[rank], self.sizes[rank])
        return sum((s, n) == mine for s, n in zip(self.starts, self.sizes))

    @torch.no_grad()
    def local(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        assert full.shape[self.dim] == self.full, (tuple(full.shape), self)
        return full.narrow(self.dim, self.starts[rank], self.sizes[rank]).clone()

    @torch.no_grad()
    def gather(self, local: torch.Tensor, group: Group) -> torch.Tensor:
        """The logical tensor from every rank's slice (a collective over `group`; uneven slices are
        padded to the largest so that it runs on any backend)."""
        rank = dist.get_rank(group)
        assert local.shape[self.dim] == self.sizes[rank], (tuple(local.shape), self)
        pad = max(self.sizes)
        moved = local.movedim(self.dim, 0)
        buf = moved.new_zeros((pad,) + tuple(moved.shape[1:]))
        buf[: moved.shape[0]] = moved
        out = moved.new_empty((len(self.sizes) * pad,) + tuple(moved.shape[1:]))
        _all_gather_single(out, buf.contiguous(), group)
        pieces, seen = [], set()
        for r in sorted(range(len(self.sizes)), key=lambda r: self.starts[r]):
            if self.starts[r] not in seen:
                seen.add(self.starts[r])
                pieces.append(out[r * pad: r * pad + self.sizes[r]])
        return torch.cat(pieces).movedim(0, self.dim).contiguous()

    def full_shape(self, local: torch.Tensor) -> list[int]:
        shape = list(local.shape)
        shape[self.dim] = self.full
        return shape


@torch.no_grad()
def sum_replicas_(items: list[tuple[torch.Tensor, ShardSpec]], group: Group) -> None:
    """In place: each local tensor summed over the ranks that hold the same slice of it (e.g. kv
    heads shared by several tp ranks), all of them in one all-reduce over `group`: every rank
    puts its slices into zeroed full-size buffers, so a sum gives each slice's replica sum."""
    rank = dist.get_rank(group)
    buffers = []
    for local, spec in items:
        buf = local.new_zeros(spec.full_shape(local))
        buf.narrow(spec.dim, spec.starts[rank], spec.sizes[rank]).copy_(local)
        buffers.append(buf)
    flat = torch.cat([b.reshape(-1) for b in buffers])
    dist.all_reduce(flat, group=group)
    for (local, spec), buf, summed in zip(items, buffers, flat.split([b.numel() for b in buffers])):
        local.copy_(summed.view_as(buf).narrow(spec.dim, spec.starts[rank], spec.sizes[rank]))


# ---------------------------------------------------------------------------------------------
# Communication with autograd (f / g pairs)


def _all_gather_single(out: torch.Tensor, x: torch.Tensor, group: Group) -> None:
    """Concatenate every rank's x along dim 0 into out (named all_gather_into_tensor before 2.13)."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)


def _reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, group: Group) -> None:
    """Sum x over ranks and keep this rank's dim-0 chunk (reduce_scatter_tensor before 2.13)."""
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x, group=group)


def _gather_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[B, s, ...] -> [B, tp * s, ...], rank order along the sequence (contiguous)."""
    world = dist.get_world_size(group)
    x = x.contiguous()
    b, s, rest = x.shape[0], x.shape[1], tuple(x.shape[2:])
    out = x.new_empty((world * b, s) + rest)
    _all_gather_single(out, x, group)  # [tp * B, s, ...]: rank r's chunk at rows r * B ...
    # [tp, B, s] -> [B, tp, s]: a view when B = 1, else the one copy of the gather
    return out.view((world, b, s) + rest).transpose(0, 1).reshape((b, world * s) + rest)


def _reduce_scatter_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[B, S, ...] summed over ranks -> this rank's [B, S / tp, ...] chunk (contiguous)."""
    world = dist.get_world_size(group)
    b, n, rest = x.shape[0], x.shape[1], tuple(x.shape[2:])
    assert n % world == 0, f"sequence {n} does not split over {world} ranks"
    # [B, tp, s] -> [tp, B, s]: rank r's chunk at rows r * B; a view when B = 1, else one copy
    chunks = x.reshape((b, world, n // world) + rest).transpose(0, 1).contiguous()
    out = x.new_empty((b, n // world) + rest)
    _reduce_scatter_single(out, chunks.view((world * b, n // world) + rest), group)
    return out


def _split_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    assert x.shape[1] % world == 0, f"sequence {x.shape[1]} does not split over {world} ranks"
    return x.chunk(world, dim=1)[rank].contiguous()


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul reads x in: autocast's on x's device when it is on and casts x (bf16
    under train.precision=bf16, docs/precision.md), else x's own."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind) and x.is_floating_point() and x.dtype != torch.float64:
        return torch.get_autocast_dtype(kind)
    return x.dtype


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, own_grad):
        ctx.group, ctx.own_grad = group, own_grad
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # summed in place only when the gradient is this region's own (every reader is a matmul,
        # whose input gradient is a new tensor); otherwise autograd may have handed the same
        # tensor to another branch too (both inputs of an add get one tensor), so sum a copy
        grad = grad.contiguous() if ctx.own_grad else grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        # x (partial sums the caller hands over) is summed in place, unless it is strided or a
        # dispatch mode runs: op-level checkpointing's caching mode holds the matmul output it
        # saved and would hand the sum to its recompute
        if x.is_contiguous() and not is_in_torch_dispatch_mode():
            ctx.mark_dirty(x)
            dist.all_reduce(x, group=group)
            increment_version(x)  # another op that saved x for backward then raises, not reads the sum
            return x
        x = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SeqRegion(torch.autograd.Function):
    """A sequence collective whose backward is its transpose: "gather" (all-gather; backward
    reduce-scatter), "reduce_scatter" (backward all-gather), "split" (backward all-gather)."""

    @staticmethod
    def forward(ctx, x, group, op):
        ctx.group, ctx.op = group, op
        if op == "gather":
            return _gather_seq(x, group)
        return _reduce_scatter_seq(x, group) if op == "reduce_scatter" else _split_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.op == "gather":
            return _reduce_scatter_seq(grad, ctx.group), None, None
        return _gather_seq(grad, ctx.group), None, None


class _GatherWholeSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_seq(grad, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _CopyToRegion.apply(x, group, False)


def reduce_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum of every rank's partial x; x itself is summed in place (when contiguous) and returned."""
    return _ReduceFromRegion.apply(x, group)


def gather_from_seq_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sequence-sharded input of a column-parallel region ([B, S/tp, ...] -> [B, S, ...])."""
    return _SeqRegion.apply(x, group, "gather")


def reduce_scatter_to_seq_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Partial sums leaving a row-parallel region ([B, S, ...] -> summed [B, S/tp, ...])."""
    return _SeqRegion.apply(x, group, "reduce_scatter")


def scatter_to_seq_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Replicated [B, S, ...] -> this rank's [B, S/tp, ...] chunk."""
    return _SeqRegion.apply(x, group, "split")


def gather_whole_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's [B, S/tp, ...] chunk -> [B, S, ...] for a region replicated over tp whose output
    gradient is the same on every rank (module doc), whose input gradient's chunk it keeps."""
    return _GatherWholeSeq.apply(x, group)


def enter_tp_region(x: torch.Tensor, group: Group, sequence_parallel: bool, matmuls_only: bool = True
                    ) -> torch.Tensor:
    """f: make the input of column-parallel layers replicated (all-gather under SP).

    matmuls_only (every reader of the result is a matmul): x enters in the dtype the matmuls read
    it in (`matmul_dtype`: bf16 under autocast), so the readers share one cast copy instead of
    casting one each, and both directions move that dtype: the all-gather under SP, and the
    backward all-reduce (or reduce-scatter) of the input gradient, which is summed in place.
    Otherwise x keeps its dtype (e.g. a reader that also uses it elementwise in fp32)."""
    if matmuls_only:
        x = x.to(matmul_dtype(x))
    if sequence_parallel:
        return gather_from_seq_region(x, group)
    return _CopyToRegion.apply(x, group, matmuls_only)


# ---------------------------------------------------------------------------------------------
# Layers. Parameter names match nn.Linear / nn.Embedding, so checkpoints keep their keys.

INPUT_MODES = ("none", "copy", "gather_seq")
OUTPUT_MODES = ("none", "reduce", "reduce_scatter_seq")


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r: W_r holds rows [start, start + size) of the logical [out, in] weight.

    input_mode: "copy" (f = copy_to_tp_region), "gather_seq" (f under sequence parallelism) or
    "none" when the caller already entered the region (one f shared by several projections).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Group, input_mode: str = "copy"):
        super().__init__()
        assert input_mode in INPUT_MODES, input_mode
        self.group, self.input_mode = group, input_mode
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: ShardSpec, group: Group,
                    input_mode: str = "none") -> "ColumnParallelLinear":
        rank = dist.get_rank(group)
        assert spec.dim == 0
        with torch.no_grad():
            weight = spec.local(linear.weight.detach(), rank)
            bias = None if linear.bias is None else spec.local(linear.bias.detach(), rank)
        return cls(weight, bias, group, input_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_mode != "none":
            x = enter_tp_region(x, self.group, self.input_mode == "gather_seq")
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"local_out={self.weight.shape[0]}, in={self.weight.shape[1]}, input_mode={self.input_mode}"


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T + b: W_r holds columns [start, start + size) of the logical [out, in]
    weight; the bias is replicated and added after the reduction."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Group, output_mode: str = "reduce"):
        super().__init__()
        assert output_mode in OUTPUT_MODES, output_mode
        self.group, self.output_mode = group, output_mode
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: ShardSpec, group: Group,
                    output_mode: str = "reduce") -> "RowParallelLinear":
        assert spec.dim == 1
        with torch.no_grad():
            weight = spec.local(linear.weight.detach(), dist.get_rank(group))
            bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(weight, bias, group, output_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.output_mode == "reduce":
            y = reduce_from_tp_region(y, self.group)
        elif self.output_mode == "reduce_scatter_seq":
            y = reduce_scatter_to_seq_region(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"out={self.weight.shape[0]}, local_in={self.weight.shape[1]}, output_mode={self.output_mode}"


class VocabParallelEmbedding(nn.Module):
    """Rank r holds the embedding rows of token ids [vocab_start, vocab_start + rows); ids outside
    give zeros, and the partial lookups are summed (all-reduce, or reduce-scatter along the
    sequence under sequence parallelism)."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, group: Group, output_mode: str = "reduce"):
        super().__init__()
        assert output_mode in OUTPUT_MODES, output_mode
        self.group, self.output_mode, self.vocab_start = group, output_mode, vocab_start
        self.weight = nn.Parameter(weight)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, spec: ShardSpec, group: Group,
                       output_mode: str = "reduce") -> "VocabParallelEmbedding":
        rank = dist.get_rank(group)
        assert spec.dim == 0
        with torch.no_grad():
            weight = spec.local(emb.weight.detach(), rank)
        return cls(weight, spec.starts[rank], group, output_mode)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens - self.vocab_start
        outside = (ids < 0) | (ids >= self.weight.shape[0])
        out = F.embedding(ids.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.output_mode == "reduce":
            return reduce_from_tp_region(out, self.group)
        if self.output_mode == "reduce_scatter_seq":
            return reduce_scatter_to_seq_region(out, self.group)
        return out

    def extra_repr(self) -> str:
        return f"vocab_start={self.vocab_start}, rows={self.weight.shape[0]}, dim={self.weight.shape[1]}"


# ---------------------------------------------------------------------------------------------
# Vocab-parallel cross-entropy: only [N] statistics cross ranks, never the [N, V] logits.


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start):
        # logits: [N, V_r] this rank's vocabulary slice; targets: [N] global ids or IGNORE_INDEX
        x = logits.float()
        vmax = x.amax(dim=-1)
        dist.all_reduce(vmax, op=dist.ReduceOp.MAX, group=group)
        exp = (x - vmax.unsqueeze(-1)).exp_()
        ids = targets - vocab_start
        inside = (ids >= 0) & (ids < x.shape[-1])  # False on every rank for IGNORE_INDEX
        ids = ids.clamp(0, x.shape[-1] - 1)
        target_logit = (x.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - vmax) * inside
        stats = torch.stack((exp.sum(-1), target_logit))  # [2, N]: one all-reduce for both
        dist.all_reduce(stats, group=group)
        sum_exp, target_logit = stats
        kept = targets != IGNORE_INDEX
        count = kept.sum()  # the same on every rank: targets are replicated across tp
        # 0 / 0 = NaN when every target is ignored, as F.cross_entropy
        loss = torch.where(kept, sum_exp.log() - target_logit, 0.0).sum() / count
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), ids, inside, kept, count)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, ids, inside, kept, count = ctx.saved_tensors
        # ignored rows get exactly 0 (also when all are ignored, as F.cross_entropy): their scale is 0
        scale = torch.where(kept, grad / count.clamp(min=1), 0.0)  # [N]
        g = softmax * scale.unsqueeze(-1)  # one pass over [N, V_r]
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, ids] -= inside.to(g.dtype) * scale
        return g.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: Group,
                                 vocab_start: int) -> torch.Tensor:
    """Mean next-token loss (float32, the same on every tp rank) over the targets != IGNORE_INDEX,
    as models.layers.cross_entropy (NaN when all are ignored; their gradient is 0); logits
    [B, S, V_r] hold the vocabulary slice starting at vocab_start, targets [B, S] global token ids."""
    return _VocabParallelCrossEntropy.apply(logits.flatten(0, -2), targets.flatten(), group, vocab_start)
