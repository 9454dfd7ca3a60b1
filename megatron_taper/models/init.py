"""Deterministic, split-independent parameter initialisation.

Each parameter is drawn from its own generator seeded by (seed, fully qualified name), so its
initial value is a function of (name, full shape, seed) alone: a model split into pipeline
stages, sharded for tensor parallelism or ZeRO, or built on the meta device and materialised
piece by piece (parallel/meta_init.py) gets exactly the weights of the one-process model.

Every family's model class exposes that function as `init_value(name, shape, seed)` (the
logical value, CPU float32); `init_parameters` fills a whole materialised model through it, which
is what the families' `init_weights(seed)` does.

Rule (GPT-2 / Megatron style): norm weights 1; biases 0; every other weight N(0, std), except the
projections that write into the residual stream (`wo`, `w2`, the experts' `w2`, names listed in `residual_out`),
which get N(0, std / sqrt(2 * n_layers)).
"""
from __future__ import annotations

import math
import zlib
from typing import Callable

import torch
from torch import nn

from megatron_taper.models.layers import FUSED_GATE_UP, GATE_UP, fuse_gate_up

RESIDUAL_OUT = ("wo.weight", "w2.weight", "experts.w2")  # the last: models/moe.py GroupedExperts

# (parameter name, full shape, seed) -> the logical initial value, CPU float32
InitValue = Callable[[str, tuple[int, ...], int], torch.Tensor]


def init_parameters(model: nn.Module, seed: int, init_value: InitValue | None = None, prefix: str = "") -> None:
    """Fill every (materialised, unsharded) parameter of `model` with init_value(prefix + name,
    shape, seed); `init_value` defaults to the model's own."""
    init_value = init_value or model.init_value
    with torch.no_grad():
        for name, param in model.named_parameters():
            full_tensor = init_value(prefix + name, tuple(param.shape), seed)
            param.copy_(full_tensor.to(device=param.device, dtype=param.dtype))


def init_tensor(name: str, shape: tuple[int, ...], seed: int, std: float, n_layers: int,
                residual_out: tuple[str, ...] = RESIDUAL_OUT) -> torch.Tensor:
    """The initial value of parameter `name` (unsharded), on the CPU in float32. A fused SwiGLU
    weight (`...w13.weight`, models/layers.py) is its gate and up weights' values interleaved, so
    the fused and the unfused model start from the same function."""
    if name.endswith(FUSED_GATE_UP):
        base, half = name[: -len(FUSED_GATE_UP)], (shape[0] // 2, *shape[1:])
        return fuse_gate_up(*(init_tensor(base + part, half, seed, std, n_layers, residual_out) for part in GATE_UP))
    if "norm" in name and name.endswith("weight") and len(shape) == 1:
        return torch.ones(shape)
    if name.endswith("bias"):
        return torch.zeros(shape)
    if name.endswith(tuple(residual_out)):
        std = std / math.sqrt(2 * n_layers)
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.randn(shape, generator=generator).mul_(std)  # in place: one full tensor at a time
