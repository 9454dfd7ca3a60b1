"""Whole-model parameter, FLOP and activation-memory costs, and MFU.

Per-block costs come from each family's FamilySpec.layer_cost (built from models/costs.py's
pieces: FLOPs are forward FLOPs per token, 2 per multiply-add; a training step is ~3x). This
module adds the embedding (first pipeline stage) and the final norm + LM head + loss (last
stage). megatron_taper/memory.py turns the memory side into bytes per rank.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from megatron_taper.models import family
from megatron_taper.models.costs import Cost, Split, norm_act
from megatron_taper.taper import layer_widths

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig


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


def model_costs(cfg: ModelConfig, causal: bool = True) -> ModelCosts:
    widths = layer_widths(cfg)
    spec = family(cfg.arch)
    layers = [spec.layer_cost(cfg, w, causal) for w in widths]
    if spec.block_extra_cost is not None:
        layers = [cost + spec.block_extra_cost(cfg, index, causal) for index, cost in enumerate(layers)]
    d, v = cfg.d_model, cfg.vocab_size
    embedding = Cost(v * d, 0.0, tp_params=Split(vocab=v * d))
    return ModelCosts(layers, embedding, head_cost(cfg), widths)


def head_cost(cfg: ModelConfig, vocab_parallel: bool = False) -> Cost:
    """Final norm, output projection and the fp32 cross-entropy of the last stage.

    Kept for backward per token: the norm's, the projection's input, and the loss's [V] fp32
    (F.cross_entropy: the log-softmax; vocab-parallel: the softmax of this rank's slice). The
    logits themselves (compute dtype) are not kept. Its backward's moment: besides those, the
    gradient of the log-softmax and of the logits (F.cross_entropy), or the softmax's copy, its
    scaled copy and the masked result (vocab_parallel_cross_entropy): 2 or 3 more [V] in fp32.
    """
    d, v = cfg.d_model, cfg.vocab_size
    params = d + (0 if cfg.tie_embeddings else v * d)
    tp_params = Split(whole=d, vocab=params - d)
    act = norm_act(d) + Split(whole=d, vocab=v)
    backward = Split(seq=d, vocab=(3 if vocab_parallel else 2) * v)
    return Cost(params, 2.0 * d * v, tp_params=tp_params, act=act, backward=(backward,))


def uniform_twin(cfg: ModelConfig) -> ModelConfig:
    """The same model with every layer at the uniform width (the budget's reference)."""
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
