"""Model families and their registry.

Every family is single-device code in its own file ending with a `SPEC` (models/spec.py:
FamilySpec): how to build it, what one block costs, its tensor-parallel plan and preconditions,
and its options section (`model.<section>`). `FAMILIES` maps `model.arch` to the spec; config.py,
flops.py, parallel/tp_plan.py and preflight.py all read it.

Families outside this package: the environment variable MEGATRON_TAPER_FAMILIES may name
modules (comma-separated, importable, each defining `SPEC`) that are registered after the
built-in ones, when this package is first imported. It is read once; torchrun's workers inherit it.
"""
from __future__ import annotations

import importlib
import os
from types import MappingProxyType
from typing import TYPE_CHECKING

import megatron_taper.models.memory_caching as memory_caching
from megatron_taper.models import gated_attention, hope_attention, memory_bridge, titans, transformer, tree_lm
from megatron_taper.models.spec import FamilySpec
from megatron_taper.validation import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from megatron_taper.config import ModelConfig

FAMILIES_ENV = "MEGATRON_TAPER_FAMILIES"


def _registry() -> MappingProxyType:
    specs = [transformer.SPEC, gated_attention.SPEC, titans.SPEC, hope_attention.SPEC, tree_lm.SPEC,
             memory_bridge.SPEC]
    specs += memory_caching.SPECS  # linear_memory, deep_memory
    for name in filter(None, (m.strip() for m in os.environ.get(FAMILIES_ENV, "").split(","))):
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"{FAMILIES_ENV}: cannot import model family module {name!r} ({e})") from None
        spec = getattr(module, "SPEC", None)
        if not isinstance(spec, FamilySpec):
            raise ConfigError(f"{FAMILIES_ENV}: module {name!r} defines no SPEC = FamilySpec(...)")
        specs.append(spec)
    registry: dict[str, FamilySpec] = {}
    sections: dict[str, str] = {}
    for spec in specs:
        if spec.name in registry:
            raise ConfigError(f"{FAMILIES_ENV}: model family {spec.name!r} is registered twice")
        if spec.section and spec.section in sections:
            raise ConfigError(f"model families {sections[spec.section]!r} and {spec.name!r} both use the options "
                              f"section model.{spec.section}")
        registry[spec.name] = spec
        if spec.section:
            sections[spec.section] = spec.name
    return MappingProxyType(registry)


FAMILIES = _registry()  # model.arch -> FamilySpec, read-only


def family(arch: str) -> FamilySpec:
    """The spec of `model.arch`; ConfigError naming the key for an unknown family."""
    spec = FAMILIES.get(arch)
    if spec is None:
        raise ConfigError(f"model.arch={arch!r} is not one of: {', '.join(FAMILIES)}")
    return spec


def build_model(cfg: ModelConfig) -> nn.Module:
    """The uninitialised single-device model of `cfg.arch` (call its init_weights(seed) next, or
    build it under torch.device("meta") and materialise it per rank as build.py does)."""
    return family(cfg.arch).build(cfg)
