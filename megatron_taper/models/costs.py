"""Cost of the pieces blocks are made of: parameters, forward FLOPs and saved activations.

FLOPs are forward FLOPs per token (one multiply-add = 2 FLOPs); a training step costs about 3x
(backward = 2x forward). Attention scores and values cost 2 * 2 * H * E * C per token, where the
context C is (S + 1) / 2 on average under a causal mask (S when `causal=False`, which is what
`torch.utils.flop_counter` counts for SDPA). Elementwise work (norms, RoPE, activations, softmax)
is not counted, as in the usual 6N accounting. Each family's `layer_cost` (its FamilySpec) is
built from these; flops.py adds embedding and head and sums over the model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig


@dataclass(frozen=True)
class Cost:
    params: int
    flops: float  # forward FLOPs per token
    act_bytes: float = 0.0  # activations kept for backward, per token, at 2 bytes per element

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.params + other.params, self.flops + other.flops, self.act_bytes + other.act_bytes)


def attention_cost(cfg: ModelConfig, causal: bool = True, extra_outputs: int = 0) -> Cost:
    """Pre-norm attention with wq/wk/wv/wo; `extra_outputs`: the width of one more projection of
    the normalised input whose output is kept for backward (e.g. an output gate)."""
    d, h, k, e, s = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.seq_len
    matmul = d * h * e + 2 * d * k * e + h * e * d + d * extra_outputs
    context = (s + 1) / 2 if causal else s
    flops = 2 * matmul + 4 * h * e * context
    # saved for backward: norm input, q, k, v, attention output (+ softmax stats, ignored), extra
    acts = 2 * (d + h * e + 2 * k * e + h * e + d + extra_outputs)
    return Cost(matmul + d, flops, acts)


def swiglu_cost(cfg: ModelConfig, width: int) -> Cost:
    """Pre-norm SwiGLU MLP of hidden width `width`."""
    d = cfg.d_model
    matmul = 3 * d * width
    acts = 2 * (d + 3 * width)  # norm input, w1 out, w3 out, product
    return Cost(matmul + d, 2 * matmul, acts)
