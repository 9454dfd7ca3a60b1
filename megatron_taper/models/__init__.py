"""Model families. Each is single-device code; `build_model` returns it uninitialised."""
from __future__ import annotations

from torch import nn

from megatron_taper.config import ModelConfig


def _transformer(cfg: ModelConfig) -> nn.Module:
    from megatron_taper.models.transformer import Transformer

    return Transformer(cfg)


ARCHITECTURES = {
    "transformer": _transformer,
}


def build_model(cfg: ModelConfig) -> nn.Module:
    return ARCHITECTURES[cfg.arch](cfg)
