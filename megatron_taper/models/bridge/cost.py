"""The memory bridge's cost terms (cost/block.py), torch-free: its parameters and forward FLOPs per
token (exactly the matmuls of bridge/model.py, 2 per multiply-add), counted with the block that
holds it, and its state's context-parallel chain (bridge/cp.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_taper.cost.block import Cost
from megatron_taper.cost.cp import CHAIN, CPMessage, attention_messages

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig


def segment_bounds(seq_len: int, segment: int) -> list[tuple[int, int]]:
    return [(start, min(start + segment, seq_len)) for start in range(0, seq_len, segment)]


def bridge_layer(cfg: ModelConfig) -> int:
    """The index of the block that holds the bridge: the first of the upper half."""
    return cfg.n_layers // 2


def bridge_params(cfg: ModelConfig) -> int:
    d, h, e, b = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.bridge
    attention = 4 * d * h * e
    gru = 2 * 3 * d * d + 2 * 3 * d
    aux = d * d if b.aux_weight > 0 else 0
    return b.slots * d + 4 * d + 2 * attention + gru + d * d + d + aux


def bridge_flops(cfg: ModelConfig) -> float:
    """The bridge's forward FLOPs over one sequence of model.seq_len tokens (evaluation: the
    auxiliary head, training only, adds 2 D^2 per segment and is not counted). The last segment's
    write is counted with carry_state only (otherwise it is not computed)."""
    d, h, e, s, m, t = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.seq_len, cfg.bridge.slots, cfg.bridge.segment
    n = -(-s // t)
    write = 2 * 2 * d * h * e * s  # wk, wv on every token
    bounds = segment_bounds(s, t)
    for start, end in bounds if cfg.bridge.carry_state else bounds[:-1]:
        write += m * (2 * d * h * e + 2 * h * e * d + 2 * 6 * d * d)  # wq, wo, the GRU's two [3D, D] maps
        write += 4 * h * e * m * (end - start)  # scores and values
    read = s * (2 * d * h * e + 2 * d * d)  # wq, gate
    read += n * m * 2 * 2 * d * h * e  # wk, wv on the states
    read += n * t * (4 * h * e * m + 2 * h * e * d)  # scores, values, wo: padded rows of the last segment included
    return write + read


def bridge_block_cost(cfg: ModelConfig, index: int, causal: bool = True) -> Cost:
    """The bridge, counted with the block that holds it. Its activation memory is not modelled."""
    if not cfg.bridge.slots or index != bridge_layer(cfg):
        return Cost(0, 0.0)
    return Cost(bridge_params(cfg), bridge_flops(cfg) / cfg.seq_len)


def cp_state_bytes(cfg: ModelConfig, micro_batch: int, dtype_bytes: int = 4) -> int:
    """Bytes a cp rank sends to the next per micro-batch forward (and the same back, their
    gradient): the bridge state [B, m, D], once (one bridge per model)."""
    return micro_batch * cfg.bridge.slots * cfg.d_model * dtype_bytes


def bridge_cp_messages(cfg: ModelConfig, layer: int, width: int, micro_batch: int, cp: int, act_bytes: int = 4,
                       attention: str = "allgather") -> tuple[CPMessage, ...]:
    """FamilySpec.cp_messages: the Transformer's attention in every block, and on the block that
    holds the bridge (bridge_layer) the chain of its state (cp_state_bytes)."""
    state = cp_state_bytes(cfg, micro_batch, act_bytes) if layer == bridge_layer(cfg) else 0
    chain = (CPMessage(CHAIN, state),) if state else ()
    return attention_messages(cfg, micro_batch, cp, act_bytes, attention) + chain


def bridge_cp_document_messages(cfg: ModelConfig, layer: int, width: int, micro_batch: int, cp: int,
                                act_bytes: int = 4, attention: str = "allgather") -> tuple[CPMessage, ...]:
    """FamilySpec.cp_document_messages: on the block that holds the bridge, the tail of open-segment
    rows [B, T - 1, D] its chain hands on with the state (bridge/cp.py), in the activations' dtype; the
    same chain under every parallel.cp_attention."""
    rows = micro_batch * (cfg.bridge.segment - 1) * cfg.d_model * act_bytes
    return (CPMessage(CHAIN, rows, "rows"),) if rows and cfg.bridge.slots and layer == bridge_layer(cfg) else ()
