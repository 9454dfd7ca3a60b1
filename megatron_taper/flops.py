"""Per-layer parameter, FLOP and activation-memory model, and MFU.

FLOPs are forward FLOPs per token (one multiply-add = 2 FLOPs); a training step costs about 3x
(backward = 2x forward). Attention scores and values cost 2 * 2 * H * E * C per token, where the
context C is (S + 1) / 2 on average under a causal mask (S when `causal=False`, which is what
`torch.utils.flop_counter` counts for SDPA). Elementwise work (norms, RoPE, activations, softmax)
is not counted, as in the usual 6N accounting.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_taper.config import ModelConfig
from megatron_taper.taper import layer_widths


@dataclass(frozen=True)
class Cost:
    params: int
    flops: float  # forward FLOPs per token
    act_bytes: float = 0.0  # activations kept for backward, per token, at 2 bytes per element


@dataclass(frozen=True)
class ModelCosts:
    layers: list[Cost]
    embedding: Cost  # first pipeline stage
    head: Cost  # last pipeline stage: final norm, output projection, loss
    widths: list[int] = field(default_factory=list)

    @property
    def total_params(self) -> int:
        return self.embedding.params + self.head.params + sum(c.params for c in self.layers)

    @property
    def total_flops(self) -> float:
        return self.embedding.flops + self.head.flops + sum(c.flops for c in self.layers)


def attention_cost(cfg: ModelConfig, causal: bool = True, extra_params: int = 0) -> Cost:
    d, h, k, e, s = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.seq_len
    matmul = d * h * e + 2 * d * k * e + h * e * d + extra_params
    context = (s + 1) / 2 if causal else s
    flops = 2 * matmul + 4 * h * e * context
    # saved for backward: norm input, q, k, v, attention output (+ softmax stats, ignored)
    acts = 2 * (d + h * e + 2 * k * e + h * e + d)
    return Cost(matmul + d, flops, acts)


def swiglu_cost(cfg: ModelConfig, width: int) -> Cost:
    d = cfg.d_model
    matmul = 3 * d * width
    acts = 2 * (d + 3 * width)  # norm input, w1 out, w3 out, product
    return Cost(matmul + d, 2 * matmul, acts)


def transformer_layer_cost(cfg: ModelConfig, width: int, causal: bool = True) -> Cost:
    return _add(attention_cost(cfg, causal), swiglu_cost(cfg, width))


def model_costs(cfg: ModelConfig, causal: bool = True) -> ModelCosts:
    widths = layer_widths(cfg)
    layer_cost = LAYER_COSTS[cfg.arch]
    layers = [layer_cost(cfg, w, causal) for w in widths]
    d, v = cfg.d_model, cfg.vocab_size
    embedding = Cost(v * d, 0.0, 0.0)
    head_params = d + (0 if cfg.tie_embeddings else v * d)
    head = Cost(head_params, 2.0 * d * v, 2.0 * (d + 2 * v))  # logits + fp32 softmax kept for the loss
    return ModelCosts(layers, embedding, head, widths)


def uniform_twin(cfg: ModelConfig) -> ModelConfig:
    import copy

    twin = copy.deepcopy(cfg)
    twin.taper.schedule = "uniform"
    twin.taper.start = 1.0
    return twin


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops_per_s: float | None) -> float | None:
    """Model FLOPs utilisation of a training run (forward + backward = 3x forward)."""
    if not peak_flops_per_s:
        return None
    return 3.0 * flops_per_token * tokens_per_s / peak_flops_per_s


# Dense peak FLOP/s per device by name fragment: (bf16, fp32 non-tensor-core).
_PEAKS = {
    "H200": (989e12, 67e12),
    "H100": (989e12, 67e12),
    "A100": (312e12, 19.5e12),
    "L40S": (362e12, 91.6e12),
    "A10G": (125e12, 31.2e12),
    "V100": (125e12, 15.7e12),
}


def peak_flops(device: torch.device, bf16: bool) -> float | None:
    """Peak FLOP/s of one device, or None where unknown (CPUs); used only for MFU reporting."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, (bf16_peak, fp32_peak) in _PEAKS.items():
        if fragment in name:
            return bf16_peak if bf16 else fp32_peak
    return None


def _add(a: Cost, b: Cost) -> Cost:
    return Cost(a.params + b.params, a.flops + b.flops, a.act_bytes + b.act_bytes)


def _gated_attention_layer_cost(cfg: ModelConfig, width: int, causal: bool = True) -> Cost:
    from megatron_taper.models.gated_attention import gated_attention_layer_cost

    return gated_attention_layer_cost(cfg, width, causal)


def _titans_layer_cost(cfg: ModelConfig, width: int, causal: bool = True) -> Cost:
    from megatron_taper.models.titans import titans_layer_cost

    return titans_layer_cost(cfg, width, causal)


def _hope_attention_layer_cost(cfg: ModelConfig, width: int, causal: bool = True) -> Cost:
    from megatron_taper.models.hope_attention import hope_attention_layer_cost

    return hope_attention_layer_cost(cfg, width, causal)


# Per-family cost of one block given its MLP width; families register theirs here.
LAYER_COSTS = {
    "transformer": transformer_layer_cost,
    "gated_attention": _gated_attention_layer_cost,
    "titans": _titans_layer_cost,
    "hope_attention": _hope_attention_layer_cost,
}
