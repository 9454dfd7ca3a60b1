"""Tensor-parallel plans: applied from outside to an initialised single-device model, per family.

A plan replaces each sharded nn.Linear / nn.Embedding by its tensor-parallel counterpart holding
this rank's slice of the initialised weight (so a tp run starts from exactly the one-process
model), records how every sharded parameter maps to its logical tensor (`ShardSpec`), and notes
the replicated parameters whose gradients need a sum over tp ranks (under sequence parallelism
the norms see only their sequence chunk).

Adding a family: write `plan_<family>(model, tp: TPBuilder)` using the builder's helpers, a
`check_<family>(mcfg, pcfg)` that raises ConfigError for shapes the plan cannot split, and add
both to `TP_PLANS`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from megatron_taper.config import Config, ConfigError, ModelConfig, ParallelConfig
from megatron_taper.models.layers import rope_tables
from megatron_taper.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    VocabParallelEmbedding,
    enter_tp_region,
    split_sizes,
)


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

        def hook(_mod, args):
            # the caller built RoPE tables for its sequence chunk; attention sees the whole sequence
            x = enter_tp_region(args[0], group, True)
            cos, sin = rope_tables(x.shape[1], head_dim, rope_theta, x.device)
            return (x, cos, sin) + tuple(args[3:])

        attn.register_forward_pre_hook(hook)

    def swiglu(self, mlp: nn.Module, prefix: str, unit: int) -> None:
        """SwiGLU with w1/w3 (column) and w2 (row); the width splits in units of `unit`."""
        width = mlp.w1.weight.shape[0]
        sizes = split_sizes(width, self.tp, unit, f"{prefix} MLP width (model.taper.multiple={unit})")
        rows = ShardSpec.split(0, sizes)
        self.column(mlp, "w1", prefix, rows)
        self.column(mlp, "w3", prefix, rows)
        self.row(mlp, "w2", prefix, ShardSpec.split(1, sizes))
        self.enter_region_at_input(mlp)


# ---------------------------------------------------------------------------------------------
# Families


def check_transformer(mcfg: ModelConfig, pcfg: ParallelConfig) -> None:
    from megatron_taper.taper import layer_widths

    tp = pcfg.tp
    if mcfg.n_heads % tp:
        raise ConfigError(f"parallel.tp={tp} must divide model.n_heads={mcfg.n_heads}")
    kv = mcfg.kv_heads
    if kv % tp and tp % kv:
        raise ConfigError(
            f"parallel.tp={tp} and model.n_kv_heads={kv}: one must divide the other (kv heads are "
            f"split when tp divides them and replicated when tp is a multiple of them)"
        )
    if mcfg.vocab_size < tp:
        raise ConfigError(f"model.vocab_size={mcfg.vocab_size} is smaller than parallel.tp={tp}")
    unit = mcfg.taper.multiple
    for layer, width in enumerate(layer_widths(mcfg)):
        if width // unit < tp:
            raise ConfigError(
                f"layer {layer} has MLP width {width} = {width // unit} unit(s) of "
                f"model.taper.multiple={unit}, fewer than parallel.tp={tp}: lower parallel.tp or "
                f"model.taper.multiple, or raise model.mlp_width"
            )
    if pcfg.sequence_parallel and mcfg.seq_len % tp:
        raise ConfigError(
            f"parallel.sequence_parallel needs model.seq_len={mcfg.seq_len} divisible by parallel.tp={tp}"
        )


def plan_transformer(model: nn.Module, tp: TPBuilder) -> None:
    plan_decoder(model, tp, plan_transformer_block)


def plan_transformer_block(block: nn.Module, prefix: str, cfg: ModelConfig, tp: TPBuilder) -> None:
    tp.replicated(block.attn_norm, f"{prefix}.attn_norm")
    tp.replicated(block.mlp_norm, f"{prefix}.mlp_norm")
    tp.attention(block.attn, f"{prefix}.attn", cfg.n_heads, cfg.kv_heads, cfg.rope_theta)
    tp.swiglu(block.mlp, f"{prefix}.mlp", cfg.taper.multiple)


def plan_decoder(model: nn.Module, tp: TPBuilder,
                 plan_block: Callable[[nn.Module, str, ModelConfig, TPBuilder], None]) -> None:
    """Embedding, every block through `plan_block`, final norm and head (shared by all families)."""
    cfg = model.cfg
    if model.tok_embeddings is not None:
        tp.embedding(model, "tok_embeddings", "")
    for idx, block in model.layers.items():
        plan_block(block, f"layers.{idx}", cfg, tp)
    if model.norm is not None:
        tp.replicated(model.norm, "norm")
        if model.output is not None or (cfg.tie_embeddings and model.tok_embeddings is not None):
            tp.enter_region_at_output(model.norm)  # f before the vocab-parallel head
    if model.output is not None:
        spec = ShardSpec.split(0, split_sizes(cfg.vocab_size, tp.tp, 1, "model.vocab_size"))
        tp.column(model, "output", "", spec)
        tp.vocab_start = spec.starts[tp.rank]
    elif cfg.tie_embeddings and model.tok_embeddings is None and model.norm is not None:
        raise ConfigError("model.tie_embeddings with tensor parallelism needs the embedding on the head's stage")


@dataclass(frozen=True)
class TPPlan:
    apply: Callable[[nn.Module, TPBuilder], None]
    check: Callable[[ModelConfig, ParallelConfig], None]


# Gated Attention: the gate W_g (D -> H*E or D -> H, head-major) is split by head like wq.


def plan_gated_attention_block(block: nn.Module, prefix: str, cfg: ModelConfig, tp: TPBuilder) -> None:
    plan_transformer_block(block, prefix, cfg, tp)
    q_rows = tp.head_specs(cfg.n_heads, cfg.kv_heads, cfg.head_dim)[0]
    per_head = block.attn.wg.weight.shape[0] // cfg.n_heads  # head_dim (elementwise) or 1 (headwise)
    spec = ShardSpec.split(0, [n // cfg.head_dim * per_head for n in q_rows.sizes])
    tp.column(block.attn, "wg", f"{prefix}.attn", spec)


# Hope-attention: attention as in the Transformer, every CMS level a SwiGLU split like the MLP.


def check_hope_attention(mcfg: ModelConfig, pcfg: ParallelConfig) -> None:
    check_transformer(mcfg, pcfg)
    if mcfg.hope.online:
        raise ConfigError(f"model.hope.online=true is not supported with parallel.tp={pcfg.tp} (the online "
                          f"update needs each level's whole output); set model.hope.online=false or parallel.tp=1")


def plan_hope_attention_block(block: nn.Module, prefix: str, cfg: ModelConfig, tp: TPBuilder) -> None:
    tp.replicated(block.attn_norm, f"{prefix}.attn_norm")
    tp.attention(block.attn, f"{prefix}.attn", cfg.n_heads, cfg.kv_heads, cfg.rope_theta)
    for level, (norm, mlp) in enumerate(zip(block.cms_norms, block.cms)):
        tp.replicated(norm, f"{prefix}.cms_norms.{level}")
        tp.swiglu(mlp, f"{prefix}.cms.{level}", cfg.taper.multiple)


# Titans: attention and MLP as in the Transformer; the neural memory is split by head (each rank
# runs the memories of its heads: wq/wk/wv/gates column-parallel, each entering the tp region
# itself, M_0 and the per-head read-norm gains sliced along the head dimension, wo row-parallel).
# Persistent tokens are replicated.


def check_titans(mcfg: ModelConfig, pcfg: ParallelConfig) -> None:
    check_transformer(mcfg, pcfg)
    if pcfg.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel is not supported for model.arch='titans' (the memory "
                          "and the persistent tokens need the whole sequence); set it to false")


def plan_titans_block(block: nn.Module, prefix: str, cfg: ModelConfig, tp: TPBuilder) -> None:
    plan_transformer_block(block, prefix, cfg, tp)
    if hasattr(block, "mem_norm"):
        tp.replicated(block.mem_norm, f"{prefix}.mem_norm")
    memory, mp, e = block.memory, f"{prefix}.memory", cfg.head_dim
    q_rows, _, o_cols = tp.head_specs(cfg.n_heads, cfg.n_heads, e)
    for attr in ("wq", "wk", "wv"):
        tp.column(memory, attr, mp, q_rows, input_mode="copy")
    tp.column(memory, "gates", mp, ShardSpec.split(0, [n // e * 3 for n in q_rows.sizes]), input_mode="copy")
    tp.row(memory, "wo", mp, o_cols)
    heads = ShardSpec.split(0, [n // e for n in q_rows.sizes])
    for i, weight in enumerate(memory.mem_w):
        memory.mem_w[i] = nn.Parameter(heads.local(weight.detach(), tp.rank))
        tp.specs[f"{mp}.mem_w.{i}"] = heads
    memory.out_norm_weight = nn.Parameter(q_rows.local(memory.out_norm_weight.detach(), tp.rank))
    tp.specs[f"{mp}.out_norm_weight"] = q_rows


TP_PLANS: dict[str, TPPlan] = {
    "transformer": TPPlan(plan_transformer, check_transformer),
    "gated_attention": TPPlan(lambda m, tp: plan_decoder(m, tp, plan_gated_attention_block), check_transformer),
    "hope_attention": TPPlan(lambda m, tp: plan_decoder(m, tp, plan_hope_attention_block), check_hope_attention),
    "titans": TPPlan(lambda m, tp: plan_decoder(m, tp, plan_titans_block), check_titans),
}


def check_tp(mcfg: ModelConfig, pcfg: ParallelConfig) -> None:
    """Refuse (ConfigError naming the key) a model the tp plan cannot split; pure, no processes."""
    if pcfg.tp == 1:
        return
    if mcfg.arch not in TP_PLANS:
        raise ConfigError(f"parallel.tp={pcfg.tp}: no tensor-parallel plan for model.arch={mcfg.arch!r} "
                          f"(plans: {', '.join(TP_PLANS)})")
    TP_PLANS[mcfg.arch].check(mcfg, pcfg)


def apply_tp(model: nn.Module, group, rank: int, tp: int, cfg: Config) -> TPBuilder:
    """Shard `model` (initialised, on its device) in place; returns the recorded layouts."""
    check_tp(cfg.model, cfg.parallel)
    builder = TPBuilder(group, rank, tp, cfg.parallel.sequence_parallel)
    with torch.no_grad():
        TP_PLANS[cfg.model.arch].apply(model, builder)
    names = {n for n, _ in model.named_parameters()}
    builder.specs = {n.lstrip("."): s for n, s in builder.specs.items()}
    builder.seq_local = [n.lstrip(".") for n in builder.seq_local]
    assert set(builder.specs) <= names and set(builder.seq_local) <= names, (
        sorted(set(builder.specs) - names), sorted(set(builder.seq_local) - names))
    return builder
