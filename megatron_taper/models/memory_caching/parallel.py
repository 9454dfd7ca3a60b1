"""Memory Caching's tensor-parallel plan (parallel/tp/plan.py runs it) and layout checks; torch-free
at module level."""
from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_taper.models.titans.parallel import tp_plan_memory
from megatron_taper.validation import ConfigError

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig, ParallelConfig
    from megatron_taper.models.memory_caching.model import MemoryCachingBlock
    from megatron_taper.parallel.tp.plan import TPBuilder


def tp_plan_memory_caching_block(block: MemoryCachingBlock, prefix: str, cfg: ModelConfig, tp: TPBuilder) -> None:
    """Norms replicated; the memory and W_u split by head; the MLP's width split in units of
    model.taper.multiple (uneven when the width does not divide)."""
    tp.replicated(block.mixer_norm, f"{prefix}.mixer_norm")
    tp.replicated(block.mlp_norm, f"{prefix}.mlp_norm")
    tp_plan_memory(block.mixer.memory, f"{prefix}.mixer.memory", cfg, tp)
    if block.mixer.wu is not None:
        tp.column(block.mixer, "wu", f"{prefix}.mixer", tp.head_rows(cfg.n_heads, cfg.head_dim), input_mode="copy")
    tp.swiglu(block.mlp, f"{prefix}.mlp", cfg.taper.multiple)


def check_memory_caching_layout(mcfg: ModelConfig, pcfg: ParallelConfig) -> None:
    if pcfg.tp > 1 and pcfg.sequence_parallel:
        raise ConfigError(f"parallel.sequence_parallel is not supported for model.arch={mcfg.arch!r} (the "
                          "memory reads the whole sequence); set it to false")
    check_cp_layout(mcfg, pcfg)


def check_cp_layout(mcfg: ModelConfig, pcfg: ParallelConfig) -> None:
    """parallel.cp > 1: slices of whole segments (whole chunks for the deep memory without
    caching), and convolution taps that reach no further back than the slice before; under
    parallel.cp_attention=ulysses nothing (each rank scans the whole sequence for its heads)."""
    cp, seq, mc = pcfg.cp, mcfg.seq_len, mcfg.memory_caching
    if cp == 1 or pcfg.cp_attention == "ulysses":
        return
    local = seq // cp
    if mc.variant != "none" and local % mc.segment:
        raise ConfigError(f"parallel.cp={cp} splits model.seq_len={seq} into slices of {local} tokens, which "
                          f"model.memory_caching.segment={mc.segment} does not divide (a cached segment must not "
                          f"straddle two slices); choose a segment that divides {local}, or another parallel.cp")
    deep = mcfg.arch == "deep_memory"
    if deep and mc.variant == "none" and local % mcfg.titans.chunk_size:
        raise ConfigError(f"parallel.cp={cp} splits model.seq_len={seq} into slices of {local} tokens, which "
                          f"model.titans.chunk_size={mcfg.titans.chunk_size} does not divide (the deep memory's "
                          f"chunks take their gradients at the chunk's start, so chunks must not straddle slices)")
    key = "titans.conv_kernel" if deep else "memory_caching.linear_conv_kernel"
    taps = mcfg.titans.conv_kernel if deep else mc.linear_conv_kernel
    if taps - 1 > local:
        raise ConfigError(f"parallel.cp={cp}: model.{key}={taps} reaches {taps - 1} tokens back, past the slice of "
                          f"{local} tokens before (model.seq_len={seq} / parallel.cp); use fewer taps or a smaller cp")
