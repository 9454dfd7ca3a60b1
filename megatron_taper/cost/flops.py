"""Whole-model parameter, FLOP and activation-memory costs, and MFU.

Per-block costs come from each family's FamilySpec.layer_cost (built from cost/block.py's
pieces: FLOPs are forward FLOPs per token, 2 per multiply-add; a training step is ~3x). This
module adds the embedding (first pipeline stage) and the final norm + LM head + loss (last
stage). megatron_taper/cost/memory.py turns the memory side into bytes per rank.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megatron_taper.cost.block import Cost, Split, norm_act
from megatron_taper.models import family
from megatron_taper.taper import layer_widths

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
    layers = [spec.layer_cost(cfg, w, causal) for w in widths]
    if spec.block_extra_cost is not None:
        layers = [cost + spec.block_extra_cost(cfg, index, causal) for index, cost in enumerate(layers)]
    d, v = cfg.d_model, cfg.vocab_size
    embedding = Cost(v * d, 0.0, tp_params=Split(vocab=v * d))
    return ModelCosts(layers, embedding, head_cost(cfg), widths)


def head_cost(cfg: ModelConfig, vocab_parallel: bool = False, chunked: bool = False) -> Cost:
    """Final norm, output projection and the cross-entropy of the last stage.

    Kept for backward per token: the norm's, the projection's input, and the loss's [V]: in fp32
    unchunked (F.cross_entropy: the log-softmax; vocab-parallel: the softmax of this rank's
    slice; the logits themselves, compute dtype, are not kept), or the logits in the compute
    dtype under train.loss_chunk (`chunked`, parallel/loss.py). Its backward's moment: besides
    those, the gradient of the log-softmax and of the logits (F.cross_entropy), or the softmax's
    copy, its scaled copy and the masked result (vocab_parallel_cross_entropy): 2 or 3 more [V]
    in fp32; chunked, the logits' gradient [V] in the compute dtype (the fp32 chunks, a fixed
    number of tokens, are added by cost/memory.py).
    """
    d, v = cfg.d_model, cfg.vocab_size
    params = d + (0 if cfg.tie_embeddings else v * d)
    tp_params = Split(whole=d, vocab=params - d)
    if chunked:
        act = norm_act(d) + Split(whole=d, logits=v)
        backward = Split(seq=d, logits=v)
    else:
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


# Dense (no sparsity) peak TFLOP/s of one device: (bf16 on tensor / matrix cores, fp32 without
# tensor cores: torch leaves TF32 off for matmuls by default). A device is matched by the longest
# fragment of its name (torch.cuda.get_device_name; ROCm builds name AMD devices through it too).
# From the vendors' data sheets; where a sheet gives only sparse figures they are halved:
#   NVIDIA HGX B200: 36 PFLOPS FP16/BF16 sparse and 600 TFLOPS FP32 for 8 GPUs -> 2,250 / 75
#   NVIDIA GB200 NVL72: 360 PFLOPS FP16/BF16 sparse and 5,760 TFLOPS FP32 for 72 GPUs -> 2,500 / 80
#   NVIDIA H100 / H200 SXM: 1,979 BF16 sparse -> 989, FP32 67; H100 PCIe: 1,513 -> 756, FP32 51;
#   H100 NVL / H200 NVL: 1,671 -> 835, FP32 60; GH200 as H100 SXM
#   NVIDIA A100 (SXM and PCIe): 312 BF16 dense, FP32 19.5
#   NVIDIA L40S: 733 sparse -> 362, FP32 91.6; L40: 362 sparse -> 181, FP32 90.5;
#   L4: 242 sparse -> 121, FP32 30.3; A10: 125 BF16, FP32 31.2 (no sheet for the cloud A10G: A10's)
#   NVIDIA V100: 125 FP16 tensor cores (no bf16: bf16 autocast is not used there), FP32 15.7
#   AMD Instinct MI300X and MI325X: 1,307.4 BF16 dense, FP32 163.4; MI300A: 980.6, FP32 122.6;
#   MI250X: 383, FP32 47.9; MI250: 362.1, FP32 45.3; MI355X: 2,500 BF16 dense, FP32 157.3
PEAK_TFLOPS = {
    "B200": (2250.0, 75.0),
    "GB200": (2500.0, 80.0),
    "H200 NVL": (835.0, 60.0),
    "H200": (989.0, 67.0),
    "GH200": (989.0, 67.0),
    "H100 NVL": (835.0, 60.0),
    "H100 PCIe": (756.0, 51.0),
    "H100": (989.0, 67.0),
    "A100": (312.0, 19.5),
    "L40S": (362.0, 91.6),
    "L40": (181.0, 90.5),
    "L4": (121.0, 30.3),
    "A10": (125.0, 31.2),
    "V100": (125.0, 15.7),
    "MI355X": (2500.0, 157.3),
    "MI325X": (1307.4, 163.4),
    "MI300X": (1307.4, 163.4),
    "MI300A": (980.6, 122.6),
    "MI250X": (383.0, 47.9),
    "MI250": (362.1, 45.3),
}


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
