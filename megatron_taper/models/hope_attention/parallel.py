"""Hope-attention's tensor-parallel plan (parallel/tp/plan.py runs it) and layout checks; torch-free
at module level.

Tensor parallelism splits every level's width like a SwiGLU's (w1, w3 by rows, w2 by columns).
A shard's update needs the whole output error: each chunk's partial outputs (with the partial
||h_t||^2) are all-reduced once in the scan's forward, and once more in its backward (the sum's
reuse by the shard's update: f, identity forward, all-reduce backward); eta enters through f;
everything else in the update stays on its shard.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from megatron_taper.models.hope_attention.cost import chained_levels, level_period
from megatron_taper.validation import ConfigError

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig, ParallelConfig
    from megatron_taper.models.hope_attention.model import HopeAttentionBlock, LevelComm
    from megatron_taper.parallel.tp.plan import TPBuilder


def tp_plan_hope_attention_block(block: HopeAttentionBlock, prefix: str, cfg: ModelConfig, tp: TPBuilder) -> None:
    """Attention as in the Transformer; every CMS level's width split like a SwiGLU's (w1, w3 by
    rows, w2 by columns, in units of model.taper.multiple, uneven when it does not divide), with
    the level's collectives in place. raw_step stays whole: it enters the shards through f, whose
    backward already sums its gradient over the tp ranks (also under sequence parallelism)."""
    tp.replicated(block.attn_norm, f"{prefix}.attn_norm")
    tp.attention(block.attn, f"{prefix}.attn", cfg.n_heads, cfg.kv_heads, cfg.rope_theta)
    for index, (norm, level) in enumerate(zip(block.cms_norms, block.cms)):
        tp.replicated(norm, f"{prefix}.cms_norms.{index}")
        name = f"{prefix}.cms.{index}"
        rows, columns = tp.width_specs(level.w1.shape[0], cfg.taper.multiple, name)
        tp.shard_parameter(level, "w1", name, rows)
        tp.shard_parameter(level, "w3", name, rows)
        tp.shard_parameter(level, "w2", name, columns)
        level.comm = tensor_parallel_comm(tp.group, tp.sequence_parallel, matmuls_only=level.period is None)


def tensor_parallel_comm(group, sequence_parallel: bool, matmuls_only: bool) -> LevelComm:
    """A level's collectives over the tp group: f at the input (all-gather of the sequence under
    SP; `matmuls_only`: only matmuls read it, not an online level's update), an all-reduce of
    partial outputs, f for the sum's reuse in the update; the output back to the block's layout
    (SP: this rank's sequence chunk)."""
    from megatron_taper.models.hope_attention.fast_weights import LevelComm, identity
    from megatron_taper.parallel.tp import layers as ops  # the model file stays single-device until a plan runs

    def on_group(op):
        return functools.partial(op, group=group)

    return LevelComm(
        enter=functools.partial(ops.enter_tp_region, group=group, sequence_parallel=sequence_parallel,
                                matmuls_only=matmuls_only),
        sum_partial=on_group(ops.reduce_from_tp_region),
        reenter=on_group(ops.copy_to_tp_region),
        leave=on_group(ops.scatter_to_seq_region) if sequence_parallel else identity,
        leave_partial=on_group(ops.reduce_scatter_to_seq_region if sequence_parallel else ops.reduce_from_tp_region))


def check_hope_layout(m: ModelConfig, p: ParallelConfig) -> None:
    if p.cp == 1:
        return
    local = m.seq_len // p.cp
    for level in chained_levels(m, p.cp):
        period = level_period(m.hope, level)
        if local % period:
            raise ConfigError(f"parallel.cp={p.cp}: each rank's slice of model.seq_len={m.seq_len} ({local} tokens) "
                              f"must hold whole chunks of CMS level {level} (C_{level} = model.hope.chunk_size x "
                              f"model.hope.chunk_growth^{level} = {period} tokens), whose fast weights pass from "
                              f"slice to slice; choose model.seq_len / parallel.cp divisible by {period}")
