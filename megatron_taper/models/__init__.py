"""Model families and their registry (this module imports no torch; family code is imported on first use).

A family is a FamilyCard (torch-free: name, options section, positions, test cases; built-in
ones in models/cards.py) plus a FamilySpec (card + behaviour) in the tuple `SPECS` of the card's
module (models/spec.py). `cards()` maps `model.arch` to the card and is all that config.py needs;
`family(arch)` imports the family's module the first time it is asked and returns its spec (cost
model, TP plan, layout checks, decoding state, Hugging Face adapter); a built-in family's spec
loads no torch until its model is built.

Families outside this package: the environment variable MEGATRON_TAPER_FAMILIES may name
modules (comma-separated, importable, each defining `SPECS`, a tuple of FamilySpec) that are
registered after the built-in ones; those modules are imported when the registry is first read
(in that process: torchrun's workers inherit the variable).

The registry and cards: spec.py (FamilyCard, FamilySpec, lazy), cards.py (built-in cards and
options). Shared layers: layers.py (RMSNorm, RoPE, ALiBi, attention, SwiGLU), moe.py (the
mixture-of-experts MLP, model.moe), documents.py (the documents of a packed window: doc_start from
end-of-document tokens, FlexAttention's document block mask), local_attention.py (sliding window
behind persistent tokens), init.py (split-independent initialisation), decoding.py (KV cache).
Hugging Face: hf_llama.py (the adapter), modeling_tapered_llama.py (the modelling file exports
carry). kernels/: the loop-free and Triton forms of the recurrences.

One folder per family, each the same shape: `__init__.py` (its SPECS, nothing else), model.py (the
modules, single-device), cost.py (its cost terms and context-parallel message sizes) and parallel.py
(its TP plan and layout checks), both torch-free and on the cost model's floor, cp.py (its
context-parallel code, where it has one; the model calls it when `context` is set), and what only
that family uses: transformer/, gated_attention/, titans/ (neural_memory.py: the neural memory, also
the deep Memory Caching base), hope_attention/ (online.py: the online levels' scan), memory_caching/
(linear_memory.py, its linear base; both the linear_memory and deep_memory families), bridge/, tree/
(sweeps.py: the tree's up- and down-sweeps).
"""
from __future__ import annotations

import functools
import importlib
import os
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping

from megatron_taper.models.cards import BUILTIN_CARDS
from megatron_taper.models.spec import FamilyCard, FamilySpec
from megatron_taper.validation import ConfigError, did_you_mean

if TYPE_CHECKING:
    from torch import nn

    from megatron_taper.config import ModelConfig

FAMILIES_ENV = "MEGATRON_TAPER_FAMILIES"


def _module_specs(name: str, where: str) -> tuple[FamilySpec, ...]:
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise ConfigError(f"{where}: cannot import model family module {name!r} ({e})") from None
    specs = getattr(module, "SPECS", None)
    if not isinstance(specs, tuple) or not specs or not all(isinstance(s, FamilySpec) for s in specs):
        raise ConfigError(f"{where}: module {name!r} defines no SPECS = (FamilySpec(...), ...)")
    return specs


@functools.cache
def _registry(env: str) -> Mapping[str, FamilyCard]:
    cards = list(BUILTIN_CARDS)
    for name in filter(None, (m.strip() for m in env.split(","))):
        cards += [spec.card for spec in _module_specs(name, FAMILIES_ENV)]
    registry: dict[str, FamilyCard] = {}
    sections: dict[str, str] = {}
    for card in cards:
        if card.name in registry:
            raise ConfigError(f"{FAMILIES_ENV}: model family {card.name!r} is registered twice")
        if card.section and card.section in sections:
            raise ConfigError(f"model families {sections[card.section]!r} and {card.name!r} both use the options "
                              f"section model.{card.section}")
        registry[card.name] = card
        if card.section:
            sections[card.section] = card.name
    return MappingProxyType(registry)


def cards() -> Mapping[str, FamilyCard]:
    """model.arch -> FamilyCard of every registered family (built-in, then MEGATRON_TAPER_FAMILIES), read-only."""
    return _registry(os.environ.get(FAMILIES_ENV, ""))


def family_card(arch: str) -> FamilyCard:
    """The card of `model.arch`; ConfigError naming the key for an unknown family."""
    card = cards().get(arch)
    if card is None:
        raise ConfigError(f"model.arch={arch!r} is not one of: {', '.join(cards())}{did_you_mean(arch, cards())}")
    return card


def family(arch: str) -> FamilySpec:
    """The spec of `model.arch` (imports the family's module on first use)."""
    card = family_card(arch)
    for spec in _module_specs(card.module, f"model.arch={arch}"):
        if spec.name == arch:
            assert spec.card is card, f"{card.module}: the spec of {arch!r} carries another card"
            return spec
    raise ConfigError(f"model.arch={arch!r}: module {card.module!r} has no FamilySpec named {arch!r}")


def build_model(cfg: ModelConfig) -> nn.Module:
    """The uninitialised single-device model of `cfg.arch` (call its init_weights(seed) next, or
    build it under torch.device("meta") and materialise it per rank as build.py does)."""
    return family(cfg.arch).build(cfg)
