"""float8 training of the blocks' linear layers through torchao (train.float8).

`apply_float8(model, device, fsdp_all_gather)` swaps every nn.Linear inside `model.layers` (the
blocks of every family: attention projections, MLPs, gates, memory projections) whose in and out
features are both multiples of 16 (torch._scaled_mm's rule) for torchao's Float8Linear: its
input and weight are cast to float8 e4m3 and the output gradient to e5m2, each with one dynamic
scale per tensor (amax / float8 max), and the matmuls run on the float8 values; parameters,
gradients and optimizer state stay as they were (fp32), parameter names do not change, so
checkpoints move freely between runs with and without it. The embedding and the head stay in
the compute dtype (their error goes straight into the logits). Linears with a dimension that is
not a multiple of 16 (small gates of some families) stay as they are; the MLP widths are kept
legal by cost/preflight.py (model.taper.multiple a multiple of 16, d_model too).

On a CUDA device of compute capability 8.9 or more the float8 matmuls are torch._scaled_mm; on
the CPU (and older GPUs) torchao's emulation (Float8LinearConfig(emulate=True)) rounds to float8 and multiplies
in the compute dtype, the same numerics in the matmul's inputs. With fsdp2 at dp > 1 on CUDA the
weights are all-gathered in float8 (torchao's enable_fsdp_float8_all_gather: the shard is cast
with the scale of the whole weight, an all-reduce of its amax, before the all-gather: a quarter
of fp32's bytes, half of bf16's); on the CPU (gloo) they are gathered as without float8 and cast
after the gather, because gloo has no float8 dtype (its all-gather fails with "Invalid scalar
type"), so the float8 all-gather is not tested here.

Applied by parallelize() after tensor parallelism (only tp = 1: our column/row-parallel layers
are not nn.Linear; cost/preflight.py refuses tp > 1) and before activation checkpointing and ZeRO, in
torchtitan's order.
"""
from __future__ import annotations

import torch
from torch import nn

FLOAT8_MULTIPLE = 16  # torch._scaled_mm: both dimensions of a float8 operand multiples of 16


def float8_legal(linear: nn.Module) -> bool:
    return (type(linear) is nn.Linear and linear.in_features % FLOAT8_MULTIPLE == 0
            and linear.out_features % FLOAT8_MULTIPLE == 0)


def apply_float8(model: nn.Module, device: torch.device, fsdp_all_gather: bool) -> int:
    """In place on `model.layers` (module doc); returns the number of linears converted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    emulate = device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9)
    config = Float8LinearConfig(emulate=emulate, enable_fsdp_float8_all_gather=fsdp_all_gather)
    before = sum(float8_legal(m) for m in model.layers.modules())
    convert_to_float8_training(model.layers, config=config, module_filter_fn=lambda m, _: float8_legal(m))
    return before
