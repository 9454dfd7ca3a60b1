"""Titans' tensor-parallel plan (parallel/tp/plan.py runs it) and its layout checks; torch-free
at module level.

Tensor parallelism: attention and MLP as in the Transformer; the neural memory is split by head
(each rank runs the memories of its heads: wq/wk/wv/gates column-parallel, each entering the tp
region itself, M_0 and the per-head read-norm gains sliced along the head dimension, wo
row-parallel). Persistent tokens are replicated.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_taper.models.transformer.parallel import tp_plan_transformer_block
from megatron_taper.validation import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from megatron_taper.config import ModelConfig, ParallelConfig
    from megatron_taper.models.titans.model import TitansBlock
    from megatron_taper.parallel.tp.plan import TPBuilder

MESSAGE_TENSORS = 64  # parallel/cp/state.py: at most this many tensors in one message


def tp_plan_titans_block(block: TitansBlock, prefix: str, cfg: ModelConfig, tp: TPBuilder) -> None:
    tp_plan_transformer_block(block, prefix, cfg, tp)
    if hasattr(block, "mem_norm"):  # MAL: the memory's input has its own norm
        tp.replicated(block.mem_norm, f"{prefix}.mem_norm")
    tp_plan_memory(block.memory, f"{prefix}.memory", cfg, tp)


def tp_plan_memory(memory: nn.Module, mp: str, cfg: ModelConfig, tp: TPBuilder) -> None:
    """A per-head memory with wq/wk/wv/gates (head-major rows), wo, out_norm_weight, optional
    mem_w and conv taps (NeuralMemory, and memory_caching/linear_memory.py LinearMemory), split by head."""
    e, heads = cfg.head_dim, cfg.n_heads
    rows = tp.head_rows(heads, e)
    for attr in ("wq", "wk", "wv"):
        tp.column(memory, attr, mp, rows, input_mode="copy")
    tp.column(memory, "gates", mp, tp.head_rows(heads, memory.gates.out_features // heads), input_mode="copy")
    tp.row(memory, "wo", mp, tp.head_columns(heads, e))
    for i in range(len(getattr(memory, "mem_w", ()))):
        tp.shard_parameter(memory.mem_w, str(i), f"{mp}.mem_w", tp.head_rows(heads, 1))
    tp.shard_parameter(memory, "out_norm_weight", mp, rows)
    for attr in ("conv_q", "conv_k", "conv_v"):
        if getattr(memory, attr) is not None:  # depthwise: each rank keeps its heads' channels
            tp.shard_parameter(memory, attr, mp, rows)


def check_titans_layout(mcfg: ModelConfig, pcfg: ParallelConfig) -> None:
    if pcfg.tp > 1 and pcfg.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel is not supported for model.arch='titans' (the memory "
                          "and the persistent tokens need the whole sequence); set it to false")
    check_cp_layout(mcfg, pcfg)


def check_titans_documents(mcfg: ModelConfig, pcfg: ParallelConfig) -> None:
    """data.document_mask under the cp chain: MAG and MAL reset their memory's state at document
    starts along it, MAC does not (its segments' state passes rank to rank unchanged); MAC under
    Ulysses is refused for every run by check_cp_layout."""
    if pcfg.cp > 1 and mcfg.titans.variant == "mac" and pcfg.cp_attention != "ulysses":
        raise ConfigError(f"data.document_mask=true with parallel.cp={pcfg.cp} and parallel.cp_attention="
                          f"{pcfg.cp_attention}: model.titans.variant='mac' passes its memory's state along the cp "
                          "chain without resetting it at document starts (mag and mal do); use model.titans.variant="
                          "mag or mal, parallel.cp=1 or data.document_mask=false")


def check_cp_layout(mcfg: ModelConfig, pcfg: ParallelConfig) -> None:
    """Refuse the cp layouts Titans cannot split (one ConfigError naming the fields)."""
    cp, t = pcfg.cp, mcfg.titans
    if cp == 1:
        return
    local = mcfg.seq_len // cp
    if pcfg.cp_attention == "ulysses" and t.variant == "mac":
        raise ConfigError("model.titans.variant='mac' with parallel.cp_attention='ulysses': MAC's memory is not "
                          "per head along the sequence (each segment's retrieval goes through wo and the segment's "
                          "attention over every head before the memory writes it, so a head-sharded scan would need "
                          "two all-to-alls per segment, one segment after another); use model.titans.variant=mag or "
                          "mal, or parallel.cp_attention=allgather (the memory's state along the cp chain)")
    if pcfg.cp_attention == "ulysses" and t.window - 1 > local:
        raise ConfigError(f"model.titans.window={t.window} with parallel.cp_attention='ulysses' at parallel.cp={cp}: "
                          f"the window's W - 1 = {t.window - 1} rows before a slice must come from the one cp rank "
                          f"before it, whose slice holds model.seq_len / parallel.cp = {local} tokens; choose a "
                          f"smaller window or parallel.cp")
    if t.variant == "mac" and local % t.window:
        raise ConfigError(f"model.titans.variant='mac' at parallel.cp={cp}: each cp rank's slice, model.seq_len / "
                          f"parallel.cp = {mcfg.seq_len} / {cp} = {local} tokens, must hold whole segments of "
                          f"model.titans.window={t.window} tokens (a segment's attention and memory read cannot "
                          f"span two ranks); choose model.seq_len a multiple of {cp * t.window}")
    if 2 * t.memory_depth + 4 > MESSAGE_TENSORS:
        raise ConfigError(f"model.titans.memory_depth={t.memory_depth} at parallel.cp={cp}: a block's state message "
                          f"would hold more than {MESSAGE_TENSORS} tensors; use memory_depth <= "
                          f"{(MESSAGE_TENSORS - 4) // 2}")
