"""The tree LM's tensor-parallel plan (parallel/tp/plan.py runs it) and model and layout checks;
torch-free at module level.

Parallelism: tensor parallelism splits the cell's hidden width C like an MLP (W_in column-
parallel, W_out row-parallel: one all-reduce of [pairs, 4D] per cell level) and the SwiGLU as in
the Transformer; pipeline parallelism (one layer: nothing to split) and sequence parallelism (the
tree spans the whole sequence) are refused.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_taper.models.tree.cost import cell_width
from megatron_taper.validation import ConfigError

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig, ParallelConfig
    from megatron_taper.models.tree.model import TreeLayer
    from megatron_taper.parallel.tp.plan import TPBuilder


def check_tree_model(cfg: ModelConfig) -> None:
    if cfg.n_layers != 1:
        raise ConfigError(f"model.n_layers={cfg.n_layers}: model.arch='tree' is a single-layer model; set "
                          f"model.n_layers=1")


def tp_plan_tree_layer(block: TreeLayer, prefix: str, cfg: ModelConfig, tp: TPBuilder) -> None:
    """Norms replicated; the cell's hidden width C split in units of model.taper.multiple (W_in
    column-, W_out row-parallel: one all-reduce per cell level); the SwiGLU as the Transformer's."""
    tp.replicated(block.leaf_norm, f"{prefix}.leaf_norm")
    tp.replicated(block.cell.norm, f"{prefix}.cell.norm")
    tp.replicated(block.mlp_norm, f"{prefix}.mlp_norm")
    rows, cols = tp.width_specs(block.cell.w_in.weight.shape[0], cfg.taper.multiple, f"{prefix}.cell")
    # f on W_in's input only: the children also enter the gated sum, whose gradient is whole on every rank
    tp.column(block.cell, "w_in", f"{prefix}.cell", rows, input_mode="copy")
    tp.row(block.cell, "w_out", f"{prefix}.cell", cols)
    tp.swiglu(block.mlp, f"{prefix}.mlp", cfg.taper.multiple)


def check_tree_layout(m: ModelConfig, p: ParallelConfig) -> None:
    check_tree_model(m)
    if p.pp > 1:
        raise ConfigError(f"parallel.pp={p.pp}: model.arch='tree' has a single layer, nothing to split over "
                          f"pipeline stages; use parallel.pp=1")
    if p.tp > 1 and p.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel is not supported for model.arch='tree' (the tree spans the "
                          "whole sequence); set it to false")
    local = m.seq_len // p.cp
    if p.cp > 1 and local & (local - 1):
        raise ConfigError(f"parallel.cp={p.cp}: model.arch='tree' needs each rank's slice model.seq_len / "
                          f"parallel.cp = {m.seq_len}/{p.cp} = {local} tokens to be a power of two (a whole block of "
                          f"the balanced tree, whose root the later slices read); choose model.seq_len = "
                          f"parallel.cp x a power of two")
    units = cell_width(m) // m.taper.multiple
    if p.tp > units:
        raise ConfigError(f"parallel.tp={p.tp}: the tree cell's width {cell_width(m)} (model.tree.cell_width) is "
                          f"{units} unit(s) of model.taper.multiple={m.taper.multiple}, fewer than parallel.tp")
