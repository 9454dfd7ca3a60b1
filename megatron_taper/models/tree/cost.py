"""The tree LM's cost terms (cost/block.py), torch-free: its cell's and MLP's parameters, FLOPs
and saved activations, the sweeps' count of cell levels and applications (`tree_depth`), and the
context-parallel all-gather (tree/cp.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_taper.cost.block import Cost, Split, norm_act, swiglu_cost
from megatron_taper.cost.cp import ALLGATHER, CPMessage

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig


def cell_width(cfg: ModelConfig) -> int:
    return cfg.tree.cell_width or 2 * cfg.d_model


@dataclass
class SweepCount:
    """What one `tree_prefixes` call did: sequential cell levels and cell applications (pairs)."""

    up_levels: int = 0
    down_levels: int = 0
    cell_pairs: int = 0  # parents computed, per sequence

    @property
    def levels(self) -> int:
        return self.up_levels + self.down_levels


def tree_depth(seq_len: int) -> SweepCount:
    """Levels and cell applications of `tree_prefixes` for a sequence of `seq_len` tokens."""
    up = seq_len.bit_length() - 1  # floor(log2 n)
    down = sum(1 for k in range(up + 1) if 3 << k <= seq_len)
    up_pairs = sum(seq_len >> k for k in range(1, up + 1))  # complete blocks of size >= 2
    down_pairs = seq_len - (up + 1)  # every prefix length except the powers of two
    return SweepCount(up, down, up_pairs + down_pairs)


def tree_layer_cost(cfg: ModelConfig, width: int, causal: bool = True) -> Cost:
    """The cell's matmuls per token (tree_depth(seq_len).cell_pairs / seq_len applications, about
    two) and the SwiGLU MLP. Activations per cell application, as autograd keeps them: the pair
    2D, W_in's output C and GELU's C, W_out's output 4D (gates and proposal), the three sigmoids
    3D and the norm's 2D + 1; plus the leaves' norm. Measured against autograd's saved tensors:
    within 3% at power-of-two lengths, 6% otherwise (copies of strided slices)."""
    d, c = cfg.d_model, cell_width(cfg)
    applications = tree_depth(cfg.seq_len).cell_pairs / cfg.seq_len
    cell_params = 2 * d * c + c + 4 * d * c + 4 * d + d
    cell_flops = 2.0 * (2 * d * c + 4 * d * c) * applications
    per_application = Split(whole=11 * d + 1, width=2 * c)
    act = norm_act(d) + per_application.scaled(applications)
    tp_params = Split(whole=4 * d + 2 * d, width=6 * d * c + c)
    # backward's moment: the prefix states' gradient, and the widest level's (S/2 applications)
    # gradients of its output and pair (3D) and of its hidden width before and after GELU (2C)
    backward = Split(seq=d, whole=1.5 * d, width=c)
    cell = Cost(cell_params + d, cell_flops, tp_params=tp_params, act=act, backward=(backward,))
    return cell + swiglu_cost(cfg, width)


def cp_gather_bytes(cfg: ModelConfig, cp: int, micro_batch: int, dtype_bytes: int = 4) -> int:
    """The all-gathered roots of one micro-batch under context parallelism: [cp, B, D] (the
    full buffer; a rank receives (cp - 1) / cp of it forward, and the reduce-scatter backward
    moves as much); no point-to-point traffic and no chain."""
    return cp * micro_batch * cfg.d_model * dtype_bytes if cp > 1 else 0


def tree_cp_messages(cfg: ModelConfig, layer: int, width: int, micro_batch: int, cp: int, act_bytes: int = 4,
                     attention: str = "allgather") -> tuple[CPMessage, ...]:
    """FamilySpec.cp_messages: each tree layer all-gathers the slices' roots (cp_gather_bytes)."""
    return (CPMessage(ALLGATHER, cp_gather_bytes(cfg, cp, micro_batch, act_bytes), "roots"),)
