"""Where float8 pays: the rule that picks the linears train.float8 converts, and the measured speed
ratios (speedups.json next to this file) the step-time model prices them with. Torch-free.

The rule (`float8_converts`): a linear of K input and N output features converts when both are
multiples of the recipe's unit (16 for tensorwise and rowwise: torch._scaled_mm; 32 for mxfp8: its
scaling block) and min(K, N) >= train.float8_min_dim (default 4096). Why 4096: torchao's table
puts float8 at 0.80x bf16 at K,N = 2048,1024 and at 1.39x at 8192,16384; our 1.3B Transformer on
an H200, whose every block linear has a dimension of 2048, ran 0.97x compiled with all of them in
float8; so a dimension of 2048 does not pay and the next power of two is the first that may
(the interpolated ratio at 4096: 1.18x tensorwise, 1.07x rowwise). A training step's M (tokens
per micro-batch) is in the thousands, so the rule looks at K and N only.

The ratio of one linear (`float8_speedup`): the recipe's points (min(K, N), ratio) interpolated
linearly in log2 min(K, N), held constant beyond the first and the last point. mxfp8 has no
measured point, so the planner does not predict it.
"""
from __future__ import annotations

import functools
import json
import math
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig

SPEEDUPS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "speedups.json")
FLOAT8_UNIT = {"tensorwise": 16, "rowwise": 16, "mxfp8": 32}  # both dimensions multiples of this


@functools.lru_cache(maxsize=None)
def read_speedups(path: str = SPEEDUPS_FILE) -> dict:
    """The measured ratios: {"float8": {recipe: [[min_dim, ratio], ...]}, "math_rate": {...}}."""
    with open(path) as f:
        return json.load(f)


def float8_converts(in_features: int, out_features: int, min_dim: int, recipe: str) -> bool:
    """The rule (module doc): whether train.float8 converts a linear of these dimensions."""
    unit = FLOAT8_UNIT[recipe]
    return in_features % unit == 0 and out_features % unit == 0 and min(in_features, out_features) >= min_dim


def float8_speedup(in_features: int, out_features: int, recipe: str) -> float:
    """float8 / bf16 speed of one linear's matmuls (module doc); ValueError for a recipe without points."""
    points = read_speedups()["float8"].get(recipe)
    if not points:
        raise ValueError(f"no measured float8 ratio for recipe {recipe!r} in {SPEEDUPS_FILE}")
    x = math.log2(min(in_features, out_features))
    if x <= math.log2(points[0][0]):
        return float(points[0][1])
    for (d0, r0), (d1, r1) in zip(points, points[1:]):
        x0, x1 = math.log2(d0), math.log2(d1)
        if x <= x1:
            return r0 + (r1 - r0) * (x - x0) / (x1 - x0)
    return float(points[-1][1])


def block_linears(m: ModelConfig, width: int) -> list[tuple[int, int]]:
    """(in, out) features of the linears of a block with attention (wq, wk, wv, wo) and a SwiGLU
    of hidden width `width` (w1 and w3, or one fused gate/up linear, then w2): the Transformer's."""
    d, q, kv = m.d_model, m.n_heads * m.head_dim, m.kv_heads * m.head_dim
    mlp = [(d, 2 * width)] if m.fused_swiglu else [(d, width), (d, width)]
    return [(d, q), (d, kv), (d, kv), (q, d), *mlp, (width, d)]


def converted_params(m: ModelConfig, width: int, min_dim: int, recipe: str) -> float:
    """Parameters of a block of MLP width `width` in the linears the rule converts (float8 runs at
    tp = 1: whole linears); the memory model drops their bf16 copies."""
    return float(sum(k * n for k, n in block_linears(m, width) if float8_converts(k, n, min_dim, recipe)))


def block_float8_speedup(m: ModelConfig, width: int, min_dim: int, recipe: str) -> float:
    """float8 / bf16 speed of a block's linear matmuls together (block_linears, FLOPs-weighted):
    the rule's linears at their ratio, the others at 1."""
    linears = block_linears(m, width)
    flops = [k * n for k, n in linears]
    time = [k * n / (float8_speedup(k, n, recipe) if float8_converts(k, n, min_dim, recipe) else 1.0)
            for k, n in linears]
    return sum(flops) / sum(time)


def math_rate(compiled: bool) -> float:
    """A GPU step's arithmetic rate over the device profile's assumed one, eager or compiled
    (speedups.json math_rate, measured on an H200)."""
    return float(read_speedups()["math_rate"]["compiled" if compiled else "eager"])
