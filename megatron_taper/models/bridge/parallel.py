"""The memory bridge's tensor-parallel plan (parallel/tp/plan.py runs it) and layout checks; torch-free
at module level."""
from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_taper.models.transformer.parallel import tp_plan_transformer_block
from megatron_taper.validation import ConfigError

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig, ParallelConfig
    from megatron_taper.models.bridge.model import BridgeBlock
    from megatron_taper.parallel.tp.plan import TPBuilder


def tp_plan_bridge_block(block: BridgeBlock, prefix: str, cfg: ModelConfig, tp: TPBuilder) -> None:
    """The Transformer's plan; the bridge replicated (its input, the residual stream, is whole on
    every tp rank without sequence parallelism, which check_bridge_layout refuses)."""
    tp_plan_transformer_block(block, prefix, cfg, tp)
    if block.bridge is not None:
        tp.replicated(block.bridge, f"{prefix}.bridge")


def check_bridge_layout(mcfg: ModelConfig, pcfg: ParallelConfig) -> None:
    if mcfg.n_layers < 2:
        raise ConfigError(f"model.n_layers={mcfg.n_layers}: model.arch='bridge' needs at least 2 layers (a lower "
                          f"and an upper half)")
    if mcfg.bridge.slots and mcfg.seq_len <= mcfg.bridge.segment:
        raise ConfigError(f"model.bridge.segment={mcfg.bridge.segment} must be smaller than model.seq_len="
                          f"{mcfg.seq_len}: with one segment nothing is ever read from the state")
    if pcfg.tp > 1 and pcfg.sequence_parallel and mcfg.bridge.slots:
        raise ConfigError("parallel.sequence_parallel is not supported for model.arch='bridge' (the bridge reads "
                          "and writes whole segments, which sequence parallelism splits over the tp ranks); set "
                          "it to false")
    if pcfg.cp > 1 and mcfg.bridge.slots and (mcfg.seq_len // pcfg.cp) % mcfg.bridge.segment:
        raise ConfigError(f"parallel.cp={pcfg.cp}: each rank's slice of model.seq_len={mcfg.seq_len} "
                          f"({mcfg.seq_len // pcfg.cp} tokens) must hold whole segments of model.bridge.segment="
                          f"{mcfg.bridge.segment} (the bridge state passes from slice to slice at segment ends); "
                          f"choose model.seq_len / parallel.cp divisible by the segment")
    if mcfg.bridge.carry_state and (pcfg.pp > 1 or pcfg.zero == "deepspeed"):
        raise ConfigError(f"model.bridge.carry_state=true is supported with parallel.pp=1 and parallel.zero none "
                          f"or fsdp2 (the trainer hands the carried state to one whole model per micro-batch, "
                          f"which the pipeline schedule and DeepSpeed's engine do not); got pp={pcfg.pp}, "
                          f"zero={pcfg.zero}: set model.bridge.carry_state=false or change the layout")
