"""float8 training of the blocks' linear layers through torchao (train.float8).

`apply_float8(model, device, train, fsdp_all_gather)` swaps the nn.Linear layers inside
`model.layers` (the blocks of every family: attention projections, MLPs, gates, memory
projections) that cost/float8.py's rule picks (both dimensions multiples of the recipe's unit and
at least train.float8_min_dim: where float8 pays) for torchao's float8 training linears, by
train.float8_recipe:
- tensorwise: Float8Linear, input and weight cast to float8 e4m3 and the output gradient to e5m2,
  each with one dynamic scale per tensor (amax / float8 max);
- rowwise: Float8Linear with one scale per row (torchao's "rowwise" recipe, scales rounded to
  powers of 2; every gradient in e4m3);
- mxfp8: MXFP8 (one e8m0 scale per 32 elements) through torchao's MXFP8TrainingOpConfig, which
  wraps the weights of the linears it converts; only on a Blackwell GPU (compute capability 10.x),
  refused elsewhere with a ConfigError.
The matmuls run on the float8 values; parameters, gradients and optimizer state stay as they were
(fp32), parameter names do not change, so checkpoints move freely between runs with and without
it. The embedding and the head stay in the compute dtype (their error goes straight into the
logits). The other linears stay as they are; with a rule that takes every width,
cost/preflight.py keeps the MLP widths and d_model legal (model.taper.multiple and model.d_model
multiples of the recipe's unit).

On a CUDA device of compute capability 8.9 or more the float8 matmuls are torch._scaled_mm, and
float8 needs the compiled blocks there (parallelize() refuses it eager: eager float8 ran 2.4x
slower than bf16 on an H200); on the CPU (and older GPUs) torchao's emulation
(Float8LinearConfig(emulate=True)) rounds to float8 and multiplies in the compute dtype, the same
numerics in the matmul's inputs, eager or compiled (a numerics check, not a speed-up). With fsdp2
at dp > 1 on CUDA and the tensorwise recipe the weights are all-gathered in float8 (torchao's
enable_fsdp_float8_all_gather: the shard is cast with the scale of the whole weight, an
all-reduce of its amax, before the all-gather: a quarter of fp32's bytes, half of bf16's);
torchao has no float8 all-gather for rowwise scales, so rowwise gathers as without float8. On
the CPU (gloo) they are gathered as without float8 and cast after the gather, because gloo has
no float8 dtype (its all-gather fails with "Invalid scalar type"), so the float8 all-gather is
not tested here.

Applied by parallelize() after tensor parallelism (only tp = 1: our column/row-parallel layers
are not nn.Linear; cost/preflight.py refuses tp > 1) and before activation checkpointing and ZeRO, in
torchtitan's order.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from megatron_taper.cost.float8 import float8_converts
from megatron_taper.validation import ConfigError

if TYPE_CHECKING:
    from megatron_taper.config import TrainConfig


def float8_linears(model: nn.Module, train: TrainConfig) -> list[str]:
    """Names (under `model.layers`) of the nn.Linear layers the rule converts (module doc)."""
    return [name for name, m in model.layers.named_modules() if type(m) is nn.Linear
            and float8_converts(m.in_features, m.out_features, train.float8_min_dim, train.float8_recipe)]


def float8_hardware(device: torch.device) -> bool:
    """Whether `device` runs float8 matmuls (CUDA, compute capability 8.9 or more), else emulation."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def apply_float8(model: nn.Module, device: torch.device, train: TrainConfig, fsdp_all_gather: bool) -> list[str]:
    """In place on `model.layers` (module doc); returns the names of the linears converted."""
    names = set(float8_linears(model, train))
    if train.float8_recipe == "mxfp8":
        _apply_mxfp8(model, device, names)
        return sorted(names)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    # torchao all-gathers float8 weights only with one scale per tensor; rowwise gathers them as without float8
    gather = fsdp_all_gather and train.float8_recipe == "tensorwise"
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(train.float8_recipe),
                                 emulate=not float8_hardware(device), enable_fsdp_float8_all_gather=gather)
    convert_to_float8_training(model.layers, config=config, module_filter_fn=lambda _, name: name in names)
    return sorted(names)


def _apply_mxfp8(model: nn.Module, device: torch.device, names: set[str]) -> None:
    """train.float8_recipe=mxfp8: torchao's MXFP8 training on a Blackwell GPU, a ConfigError elsewhere."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is None or capability[0] != 10:
        where = f"compute capability {capability[0]}.{capability[1]}" if capability else device.type
        raise ConfigError(f"train.float8_recipe=mxfp8 needs a Blackwell GPU (compute capability 10.x; this rank "
                          f"runs on {where}); use train.float8_recipe=tensorwise or rowwise")
    try:
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
        from torchao.quantization import quantize_
    except ImportError as e:
        raise ConfigError(f"train.float8_recipe=mxfp8 needs torchao's MXFP8 training "
                          f"(torchao.prototype.moe_training, torchao >= 0.18): {e}") from None
    config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_RCEIL)
    quantize_(model.layers, config, filter_fn=lambda _, name: name in names)
