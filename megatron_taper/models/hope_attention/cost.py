"""Hope-attention's cost terms (cost/block.py), torch-free: the block's parameters, FLOPs and
saved activations with its online CMS levels, the online scan's FLOPs (hope_attention/online.py),
and the context-parallel chain's message sizes (hope_attention/cp.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_taper.cost.block import Cost, Split, attention_cost, swiglu_cost
from megatron_taper.cost.cp import CHAIN, CPMessage, attention_messages

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig
    from megatron_taper.models.cards import HopeConfig

GROUP_TOKENS = 1024  # tokens per group of chunks read through factors between materialised weights


def level_period(hope: HopeConfig, level: int) -> int:
    """C_l: the tokens per update of CMS level `level`."""
    return hope.chunk_size * hope.chunk_growth**level


def scan_groups(seq: int, period: int, updates: int) -> list[tuple[int, int]]:
    """[first, end) chunk ranges of the groups: K = GROUP_TOKENS / C update chunks each, the
    sequence's read-only last chunk (if any) in the last group."""
    per = max(1, GROUP_TOKENS // period)
    groups = [[first, min(first + per, updates)] for first in range(0, updates, per)]
    groups[-1][1] = -(-seq // period)
    return [tuple(g) for g in groups]


def scan_flops(seq: int, period: int, d: int, width: int, send_end: bool = False) -> float:
    """Forward matmul FLOPs of online_scan on one sequence (what torch's FLOP counter sees): per
    group the reads of n by its start w13 and n n_u^T, per chunk [a, g] through G_u, y and dh
    through w2^(c), ||h||^2 and w2's update; per group but the last, the next start w13."""
    chunks = -(-seq // period)
    updates = chunks if send_end else chunks - 1
    groups = scan_groups(seq, period, updates)
    total = 0.0
    for index, (first, end) in enumerate(groups):
        t0, t1 = first * period, min(end * period, seq)
        lu = (min(end, updates) - first) * period
        total += 2 * (t1 - t0) * d * 2 * width + (2 * (t1 - t0) * d * lu if end - first > 1 else 0)
        for j in range(end - first):
            rows = min(period, t1 - t0 - j * period)
            total += 2 * rows * lu * 2 * width if j else 0
            total += 2 * rows * width * (3 * d + 1) if first + j < updates else 2 * rows * width * d
        if lu and (index < len(groups) - 1 or send_end):
            total += 2 * 2 * width * lu * d
    return total


def hope_attention_layer_cost(cfg: ModelConfig, width: int, causal: bool = True) -> Cost:
    attn = attention_cost(cfg, causal)
    mlp = swiglu_cost(cfg, width)
    levels = cfg.hope.levels
    flops = attn.flops + levels * mlp.flops
    if cfg.hope.online:  # the inner updates' closed-form gradients
        flops += sum(online_update_flops(cfg, width, level) for level in range(levels))
    memory = attn + mlp.repeated(levels)
    act, per_batch = memory.act, Split()
    if cfg.hope.online:
        for level in range(levels):
            act = act + online_level_act(cfg, width, level)
        per_batch = Split(width=levels * 2 * width * cfg.d_model)  # [w1; w3] concatenated by each forward
    steps = levels if cfg.hope.online else 0  # one learnable step size (raw_step) per online level
    return Cost(attn.params + levels * mlp.params + steps, flops, tp_params=memory.params_split + Split(whole=steps),
                act=act, backward=memory.backward, per_batch=per_batch)


def online_update_flops(cfg: ModelConfig, width: int, level: int) -> float:
    """Forward FLOPs per token (over the sequence) of a level's inner updates beyond a plain
    SwiGLU's 6 W D: its scan's (scan_flops) reads through the low-rank factors and
    materialised start weights, less the plain read. Zero for a level with one chunk."""
    period = level_period(cfg.hope, level)
    if cfg.seq_len <= period:
        return 0.0
    return scan_flops(cfg.seq_len, period, cfg.d_model, width) / cfg.seq_len - 6 * width * cfg.d_model


def online_level_act(cfg: ModelConfig, width: int, level: int) -> Split:
    """Elements per token an online level keeps for backward besides a plain SwiGLU's, as counted
    from the tensors autograd saves (tests/cost/test_memory_model.py): its scan keeps n (as the
    SwiGLU does, in one copy) and per updated token the factors G [2W], H [W] and E [D], not the
    SwiGLU's 4 W activations."""
    period = level_period(cfg.hope, level)
    updates = -(-cfg.seq_len // period) - 1
    if not updates:  # one chunk: the SwiGLU's read as SwiGLUActivations, 4 more W-wide activations
        return Split(width=4 * width)
    plain = Split(width=-4 * width, input_copies=-cfg.d_model)
    return plain + Split(whole=cfg.d_model, width=3 * width).scaled(updates * period / cfg.seq_len)


def chained_levels(cfg: ModelConfig, cp: int) -> list[int]:
    """The online levels whose fast weights pass from cp slice to slice: those updated within the
    sequence (C_l < seq_len); the others read their outer weights on every rank."""
    if not cfg.hope.online or cp == 1:
        return []
    return [level for level in range(cfg.hope.levels) if level_period(cfg.hope, level) < cfg.seq_len]


def cp_state_bytes(cfg: ModelConfig, width: int, micro_batch: int, dtype_bytes: int = 4) -> int:
    """Bytes one rank sends to the next per layer and micro-batch, forward (and the same back,
    their gradient): the fast weights [B, 2W, D] and [B, D, W] of every chained level."""
    return len(chained_levels(cfg, 2)) * micro_batch * 3 * width * cfg.d_model * dtype_bytes


def hope_cp_messages(cfg: ModelConfig, layer: int, width: int, micro_batch: int, cp: int, act_bytes: int = 4,
                     attention: str = "allgather") -> tuple[CPMessage, ...]:
    """FamilySpec.cp_messages: the Transformer's attention, and the chain of the chained levels'
    fast weights (cp_state_bytes, fp32 like the weights they start from) where there are any."""
    state = cp_state_bytes(cfg, width, micro_batch)
    chain = (CPMessage(CHAIN, state),) if state else ()
    return attention_messages(cfg, micro_batch, cp, act_bytes, attention) + chain


def cp_document_bytes(cfg: ModelConfig, micro_batch: int, act_bytes: int = 4) -> int:
    """What the chain's message adds with documents per layer and direction (hope_attention/cp.py):
    every chained level's tail of open-chunk rows [B, C_l - 1, D] in the activations' dtype."""
    return sum(micro_batch * (level_period(cfg.hope, level) - 1) * cfg.d_model * act_bytes
               for level in chained_levels(cfg, 2))


def hope_cp_document_messages(cfg: ModelConfig, layer: int, width: int, micro_batch: int, cp: int,
                              act_bytes: int = 4, attention: str = "allgather") -> tuple[CPMessage, ...]:
    """FamilySpec.cp_document_messages: the chained levels' tails (cp_document_bytes), the same
    chain under every parallel.cp_attention."""
    rows = cp_document_bytes(cfg, micro_batch, act_bytes)
    return (CPMessage(CHAIN, rows, "rows"),) if rows else ()
