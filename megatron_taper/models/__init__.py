"""Model families. Each is single-device code; `build_model` returns it uninitialised."""
from __future__ import annotations

from torch import nn

from megatron_taper.config import ModelConfig


def _transformer(cfg: ModelConfig) -> nn.Module:
    from megatron_taper.models.transformer import Transformer

    return Transformer(cfg)


def _gated_attention(cfg: ModelConfig) -> nn.Module:
    from megatron_taper.models.gated_attention import GatedTransformer

    return GatedTransformer(cfg)


def _titans(cfg: ModelConfig) -> nn.Module:
    from megatron_taper.models.titans import Titans

    return Titans(cfg)


def _hope_attention(cfg: ModelConfig) -> nn.Module:
    from megatron_taper.models.hope_attention import HopeAttention

    return HopeAttention(cfg)


ARCHITECTURES = {
    "transformer": _transformer,
    "gated_attention": _gated_attention,
    "titans": _titans,
    "hope_attention": _hope_attention,
}


def build_model(cfg: ModelConfig) -> nn.Module:
    return ARCHITECTURES[cfg.arch](cfg)
