"""Tensor-parallel plans: applied from outside to a single-device model, per family.

A plan replaces each sharded nn.Linear / nn.Embedding by its tensor-parallel counterpart holding
this rank's slice of the weight (on the meta device when build.py builds there, so nothing is
allocated; slices of an initialised model otherwise, so a tp run starts from exactly the
one-process model), records how every sharded parameter maps to its logical tensor (`ShardSpec`), and notes
the replicated parameters whose gradients need a sum over tp ranks (under sequence parallelism
the norms see only their sequence chunk).

Plans live with their families: a FamilySpec's `tp_block_plan(block, prefix, cfg, tp)` shards one
block through this builder's helpers (column, row, replicated, attention, swiglu, head_rows, ...);
`apply_tp` runs it on every block and shards the embedding and head itself. Shapes a plan cannot
split are refused earlier, by cost/preflight.py (and the family's `check_layout`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from megatron_taper.models import family
from megatron_taper.models.layers import rope_tables, rope_tables_at
from megatron_taper.models.moe import MoE
from megatron_taper.parallel.tp.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    VocabParallelEmbedding,
    enter_tp_region,
    gather_whole_seq,
    scatter_to_seq_region,
    split_sizes,
)

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig


@dataclass
class TPBuilder:
    """Shards modules in place for one tp group and records what the ParallelModel needs."""

    group: object  # torch.distributed.ProcessGroup
    rank: int
    tp: int
    sequence_parallel: bool
    specs: dict[str, ShardSpec] = field(default_factory=dict)  # parameter name -> layout
    seq_local: list[str] = field(default_factory=list)  # replicated params with per-chunk grads (SP)
    vocab_start: int = 0

    @property
    def exit_mode(self) -> str:
        return "reduce_scatter_seq" if self.sequence_parallel else "reduce"

    # -- linears --------------------------------------------------------------------------------

    def column(self, parent: nn.Module, attr: str, prefix: str, spec: ShardSpec, input_mode: str = "none") -> None:
        linear = getattr(parent, attr)
        setattr(parent, attr, ColumnParallelLinear.from_linear(linear, spec, self.group, input_mode))
        self._record(f"{prefix}.{attr}", spec, linear.bias is not None, bias_sharded=True)

    def row(self, parent: nn.Module, attr: str, prefix: str, spec: ShardSpec) -> None:
        linear = getattr(parent, attr)
        setattr(parent, attr, RowParallelLinear.from_linear(linear, spec, self.group, self.exit_mode))
        self._record(f"{prefix}.{attr}", spec, linear.bias is not None, bias_sharded=False)

    def embedding(self, parent: nn.Module, attr: str, prefix: str) -> None:
        emb = getattr(parent, attr)
        spec = ShardSpec.split(0, split_sizes(emb.num_embeddings, self.tp, 1, "model.vocab_size"))
        new = VocabParallelEmbedding.from_embedding(emb, spec, self.group, self.exit_mode)
        setattr(parent, attr, new)
        self.specs[f"{prefix}.{attr}.weight"] = spec
        self.vocab_start = new.vocab_start

    def _record(self, name: str, spec: ShardSpec, has_bias: bool, bias_sharded: bool) -> None:
        self.specs[f"{name}.weight"] = spec
        if has_bias and bias_sharded:
            self.specs[f"{name}.bias"] = ShardSpec(0, spec.full, spec.starts, spec.sizes)
        elif has_bias and self.sequence_parallel:
            self.seq_local.append(f"{name}.bias")

    # -- regions ---------------------------------------------------------------------------------

    def enter_region_at_input(self, module: nn.Module) -> None:
        """f on the first positional argument of `module` (shared by its column-parallel layers)."""
        group, sp = self.group, self.sequence_parallel

        def hook(_mod, args):
            return (enter_tp_region(args[0], group, sp),) + tuple(args[1:])

        module.register_forward_pre_hook(hook)

    def enter_region_at_output(self, module: nn.Module) -> None:
        """f on the output of `module` (e.g. the final norm feeding a vocab-parallel head)."""
        group, sp = self.group, self.sequence_parallel
        module.register_forward_hook(lambda _mod, _args, out: enter_tp_region(out, group, sp))

    def replicated(self, module: nn.Module, prefix: str) -> None:
        """Parameters of `module` stay whole on every rank; under SP their grads are per-chunk."""
        if self.sequence_parallel:
            self.seq_local += [f"{prefix}.{n}" for n, _ in module.named_parameters()]

    # -- common pieces -----------------------------------------------------------------------------

    def head_specs(self, n_heads: int, n_kv_heads: int, head_dim: int) -> tuple[ShardSpec, ShardSpec, ShardSpec]:
        """(q rows, kv rows, wo columns). Query heads split evenly; kv heads split evenly when tp
        divides them, else (tp a multiple of kv heads) each rank holds the kv head of its queries."""
        q_sizes = split_sizes(n_heads * head_dim, self.tp, head_dim, "model.n_heads * head_dim")
        q_rows = ShardSpec.split(0, q_sizes)
        if n_kv_heads % self.tp == 0:
            kv_rows = ShardSpec.split(0, split_sizes(n_kv_heads * head_dim, self.tp, head_dim))
        else:
            assert self.tp % n_kv_heads == 0, (self.tp, n_kv_heads)
            per_kv = self.tp // n_kv_heads  # ranks sharing one kv head
            starts = tuple((r // per_kv) * head_dim for r in range(self.tp))
            kv_rows = ShardSpec(0, n_kv_heads * head_dim, starts, (head_dim,) * self.tp)
        return q_rows, kv_rows, ShardSpec(1, q_rows.full, q_rows.starts, q_rows.sizes)

    def head_rows(self, n_heads: int, per_head: int) -> ShardSpec:
        """Rows of a head-major projection with `per_head` rows per query head, split like wq."""
        return ShardSpec.split(0, split_sizes(n_heads * per_head, self.tp, per_head, "model.n_heads"))

    def head_columns(self, n_heads: int, per_head: int) -> ShardSpec:
        """Columns of a head-major input (e.g. an output projection), split like wo."""
        return ShardSpec.split(1, split_sizes(n_heads * per_head, self.tp, per_head, "model.n_heads"))

    def shard_parameter(self, parent: nn.Module, attr: str, prefix: str, spec: ShardSpec) -> None:
        """Replace a bare parameter `parent.<attr>` by this rank's slice of it."""
        full = getattr(parent, attr)
        setattr(parent, attr, nn.Parameter(spec.local(full.detach(), self.rank)))
        self.specs[f"{prefix}.{attr}"] = spec

    def attention(self, attn: nn.Module, prefix: str, n_heads: int, n_kv_heads: int, rope_theta: float) -> None:
        """Attention with wq/wk/wv/wo and forward(x, cos, sin) (models.layers.Attention)."""
        q_rows, kv_rows, o_cols = self.head_specs(n_heads, n_kv_heads, attn.head_dim)
        for attr, spec in (("wq", q_rows), ("wk", kv_rows), ("wv", kv_rows)):
            self.column(attn, attr, prefix, spec)
        self.row(attn, "wo", prefix, o_cols)
        if not self.sequence_parallel:
            self.enter_region_at_input(attn)
            return
        group, head_dim = self.group, attn.head_dim

        def hook(mod, args):
            # the caller built RoPE tables for its sequence chunk; attention sees the whole sequence
            # (under context parallelism the rank's slice, at its true positions)
            x = enter_tp_region(args[0], group, True)
            if mod.context is None:
                cos, sin = rope_tables(x.shape[1], head_dim, rope_theta, x.device)
            else:
                cos, sin = rope_tables_at(mod.context.positions(x.shape[1], x.device), head_dim, rope_theta)
            return (x, cos, sin) + tuple(args[3:])

        attn.register_forward_pre_hook(hook)

    def width_specs(self, width: int, unit: int, prefix: str) -> tuple[ShardSpec, ShardSpec]:
        """(rows of the up projections, columns of the down projection) of an MLP hidden width
        split in units of `unit` (uneven when the width does not divide)."""
        sizes = split_sizes(width, self.tp, unit, f"{prefix} MLP width (model.taper.multiple={unit})")
        return ShardSpec.split(0, sizes), ShardSpec.split(1, sizes)

    def swiglu(self, mlp: nn.Module, prefix: str, unit: int) -> None:
        """SwiGLU with w1/w3 (column) and w2 (row); the width splits in units of `unit`. Fused
        (w13, rows interleaved per hidden unit: models/layers.py): each rank's rows are the gate and
        up rows of its hidden units, a contiguous range of twice their count."""
        rows, cols = self.width_specs(mlp.w2.weight.shape[1], unit, prefix)
        if hasattr(mlp, "w13"):
            self.column(mlp, "w13", prefix, ShardSpec(0, 2 * rows.full, tuple(2 * s for s in rows.starts),
                                                      tuple(2 * n for n in rows.sizes)))
        else:
            self.column(mlp, "w1", prefix, rows)
            self.column(mlp, "w3", prefix, rows)
        self.row(mlp, "w2", prefix, cols)
        self.enter_region_at_input(mlp)

    def mlp(self, mlp: nn.Module, prefix: str, unit: int) -> None:
        """A block's MLP: a dense SwiGLU split by `swiglu`; a mixture of experts (models/moe.py) stays
        whole on every tp rank (router, experts and shared expert replicated: each rank routes and
        computes the same tokens, so its gradients are equal on the tp ranks, none summed over tp).
        Without SP its input and output need no tp collective; under SP it sees the whole sequence
        (gather_whole_seq at its input, scatter_to_seq_region at its output: the routing losses
        and expert loads are those of the whole sequence)."""
        if not isinstance(mlp, MoE):
            self.swiglu(mlp, prefix, unit)
        elif self.sequence_parallel:
            group = self.group
            mlp.register_forward_pre_hook(lambda _mod, args: (gather_whole_seq(args[0], group),) + tuple(args[1:]))
            mlp.register_forward_hook(lambda _mod, _args, out: scatter_to_seq_region(out, group))


# ---------------------------------------------------------------------------------------------
# The whole model


def apply_tp(model: nn.Module, group, rank: int, tp: int, model_cfg: ModelConfig,
             sequence_parallel: bool) -> TPBuilder:
    """Shard `model` (on meta, or initialised on its device) in place by its family's plan: the embedding,
    every block through the FamilySpec's `tp_block_plan`, the final norm and the head. Returns the
    recorded layouts. Shapes were checked by cost/preflight.py."""
    plan_block = family(model_cfg.arch).tp_block_plan
    assert plan_block is not None, f"preflight refuses parallel.tp > 1 for {model_cfg.arch}"
    tp_ = TPBuilder(group, rank, tp, sequence_parallel)
    with torch.no_grad():
        if model.tok_embeddings is not None:
            tp_.embedding(model, "tok_embeddings", "")
        for idx, block in model.layers.items():
            plan_block(block, f"layers.{idx}", model_cfg, tp_)
        if model.norm is not None:
            tp_.replicated(model.norm, "norm")
            if model.output is not None or model.tok_embeddings is not None:
                tp_.enter_region_at_output(model.norm)  # f before the vocab-parallel head
        if model.output is not None:
            spec = ShardSpec.split(0, split_sizes(model_cfg.vocab_size, tp, 1, "model.vocab_size"))
            tp_.column(model, "output", "", spec)
            tp_.vocab_start = spec.starts[rank]
    names = {n for n, _ in model.named_parameters()}
    tp_.specs = {n.lstrip("."): s for n, s in tp_.specs.items()}
    tp_.seq_local = [n.lstrip(".") for n in tp_.seq_local]
    assert set(tp_.specs) <= names and set(tp_.seq_local) <= names, (
        sorted(set(tp_.specs) - names), sorted(set(tp_.seq_local) - names))
    return tp_
