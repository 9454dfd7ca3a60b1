"""Meta-device construction: each rank allocates and initialises only its own pieces of the model.

    with torch.device("meta"): model = build_model(cfg)     parameters without storage
    shapes = logical_shapes(model)                            full shapes, before any split
    pm = parallelize(model, ...)                              pipeline strip, tp slices, fully_shard: on meta
    materialise(pm, shapes, model.init_value, seed)           to_empty on ctx.device, then per parameter:
        full = init_value(name, full_shape, seed)             one full parameter (CPU, fp32)
        local = pm.local_tensor(name, full)                   its tp slice, then its fsdp2 dp shard
        param (local part) <- local

Host memory while building: this rank's parameters (its stage, tp slice and ZeRO shard) plus one
full parameter at a time (and its slices). The values are models/init.py's per-parameter rule, a
function of (name, full shape, seed), so they equal the one-process model's for every layout.

to_empty cannot recreate buffer values: `has_buffers` lets build.py build a model that registers
any buffer materialised instead (no family in this package does).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from megatron_taper.parallel.model import ParallelModel, local_part

if TYPE_CHECKING:
    from megatron_taper.models.init import InitValue


def logical_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Parameter name -> full shape, of the unsplit model (call before parallelize)."""
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of `module` is on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def has_buffers(module: nn.Module) -> bool:
    return next(module.buffers(), None) is not None


@torch.no_grad()
def materialise(pm: ParallelModel, shapes: dict[str, tuple[int, ...]], init_value: InitValue, seed: int) -> int:
    """Allocate `pm.module` (built on meta and parallelised) on its device and give every parameter
    this rank's part of init_value(name, full shape, seed); returns the number of parameters set.

    fsdp2 parameters are DTensors: FSDP2's to_empty allocates the (padded) dp shards and the local
    shard is written in place. Attributes set on the meta parameters (e.g. DeepSpeed's
    `tensor_model_parallel`) are carried over to the new parameter objects that to_empty creates.
    """
    module = pm.module
    assert not has_buffers(module), "build.py builds models with buffers materialised"
    attrs = {name: dict(vars(p)) for name, p in module.named_parameters()}
    module.to_empty(device=pm.ctx.device)
    done = 0
    for name, param in module.named_parameters():
        assert name in shapes, f"{name}: not a parameter of the unsplit model"
        for key, value in attrs[name].items():
            if not hasattr(param, key):
                setattr(param, key, value)
        local = pm.local_tensor(name, init_value(name, shapes[name], seed))
        target = local_part(param)
        source = local_part(local)
        assert target.shape == source.shape, (name, tuple(target.shape), tuple(source.shape))
        target.copy_(source.to(device=target.device, dtype=target.dtype))
        done += 1
    assert done == len(attrs) and not is_meta(module), "a parameter was left uninitialised"
    return done
