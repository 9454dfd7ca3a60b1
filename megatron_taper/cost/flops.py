"""Whole-model parameter, FLOP and activation-memory costs, and MFU.

Per-block costs come from each family's FamilySpec.layer_cost (built from cost/block.py's
pieces: FLOPs are forward FLOPs per token, 2 per multiply-add; a training step is ~3x); an MoE
layer's (model.moe) MLP is cost/block.py's moe_cost, whose FLOPs are the active ones. This
module adds the embedding (first pipeline stage) and the final norm + LM head + loss (last
stage). megatron_taper/cost/memory.py turns the memory side into bytes per rank.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megatron_taper.cost.block import Cost, Split, moe_cost, norm_act
from megatron_taper.cost.devices import read_devices
from megatron_taper.models import family
from megatron_taper.taper import layer_widths, moe_layers

if TYPE_CHECKING:
    import torch

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
    # an MoE layer: the family's block with an MLP of width 0 (its norm) plus the experts (active FLOPs)
    layers = [spec.layer_cost(cfg, 0, causal) + moe_cost(cfg, w) if moe else spec.layer_cost(cfg, w, causal)
              for w, moe in zip(widths, moe_layers(cfg))]
    if spec.block_extra_cost is not None:
        layers = [cost + spec.block_extra_cost(cfg, index, causal) for index, cost in enumerate(layers)]
    d, v = cfg.d_model, cfg.vocab_size
    embedding = Cost(v * d, 0.0, tp_params=Split(vocab=v * d))
    return ModelCosts(layers, embedding, head_cost(cfg), widths)


def head_cost(cfg: ModelConfig, vocab_parallel: bool = False, chunked: bool = False, bf16: bool = False) -> Cost:
    """Final norm, output projection and the cross-entropy of the last stage.

    Kept for backward per token: the norm's, the projection's input, and the loss's [V]: in fp32
    unchunked (F.cross_entropy: the log-softmax; vocab-parallel: the softmax of this rank's
    slice; the logits themselves, compute dtype, are not kept), or the logits in the compute
    dtype under train.loss_chunk (`chunked`, parallel/loss.py). Its backward's moment: besides
    those, the gradient of the log-softmax and of the logits (F.cross_entropy), or the scaled
    softmax (vocab_parallel_cross_entropy, one pass): 2 or 1 more [V] in fp32, the latter beside
    its cast to the logits' dtype under bf16 (`bf16`: one more [V] in the compute dtype); chunked,
    the logits' gradient [V] in the compute dtype (the fp32 chunks, a fixed number of tokens, are
    added by cost/memory.py).
    """
    d, v = cfg.d_model, cfg.vocab_size
    params = d + (0 if cfg.tie_embeddings else v * d)
    tp_params = Split(whole=d, vocab=params - d)
    if chunked:
        act = norm_act(d) + Split(whole=d, logits=v)
        backward = Split(seq=d, logits=v)
    else:
        act = norm_act(d) + Split(whole=d, vocab=v)
        backward = Split(seq=d, vocab=(1 if vocab_parallel else 2) * v, logits=v if vocab_parallel and bf16 else 0)
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


# Dense peak TFLOP/s of one device, (bf16, fp32), by the fragment of its name it is matched by
# (the longest first); the numbers and their sources are in cost/devices.json.
PEAK_TFLOPS = {name: (e["bf16_tflops"], e["fp32_tflops"]) for name, e in read_devices().items() if e["bf16_tflops"]}


def device_name(device: torch.device) -> str:
    """The accelerator's product name (CUDA / ROCm), else the device type ("cpu", "mps", ...)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return device.type


def lookup_peak_tflops(name: str, bf16: bool) -> float | None:
    """Dense peak TFLOP/s of a device called `name` (PEAK_TFLOPS, longest fragment first), or None."""
    for fragment in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if fragment in name:
            bf16_peak, fp32_peak = PEAK_TFLOPS[fragment]
            return bf16_peak if bf16 else fp32_peak
    return None


def peak_flops(device: torch.device, bf16: bool, override_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s of one device for MFU: `override_tflops` (train.peak_tflops) when > 0, else the
    table's entry for this accelerator, else None (CPUs and unlisted devices)."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    peak = lookup_peak_tflops(device_name(device), bf16)
    return None if peak is None else peak * 1e12
