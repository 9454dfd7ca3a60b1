"""A model family defined outside the package, in this one file: registered through
MEGATRON_TAPER_FAMILIES=toy_family (tests/models/test_family_spec.py), it must train, plan a
pipeline and shard at tp=2 with nothing else written.

The block: pre-norm attention, then a squared-ReLU MLP (w2 relu(w1 x)^2, as in Primer) of this
layer's tapered width; `model.toy.squared=false` makes it a plain ReLU MLP.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taper.cost.block import Cost, attention_cost
from megatron_taper.models.spec import FamilyCard, FamilySpec
from megatron_taper.models.transformer.model import Transformer, TransformerBlock
from megatron_taper.validation import ConfigError


@dataclass
class ToyConfig:
    """model.toy"""

    squared: bool = True

    def validate(self, prefix: str) -> None:
        pass


class ReluMLP(nn.Module):
    def __init__(self, d_model: int, width: int, squared: bool):
        super().__init__()
        self.w1 = nn.Linear(d_model, width, bias=False)
        self.w2 = nn.Linear(width, d_model, bias=False)
        self.squared = squared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.w1(x))
        return self.w2(h * h if self.squared else h)


class ToyBlock(TransformerBlock):
    def __init__(self, cfg, mlp_width: int):
        super().__init__(cfg, mlp_width)
        self.mlp = ReluMLP(cfg.d_model, mlp_width, cfg.toy.squared)


class Toy(Transformer):
    block_class = ToyBlock


def toy_layer_cost(cfg, width: int, causal: bool = True) -> Cost:
    d = cfg.d_model
    return attention_cost(cfg, causal) + Cost(2 * d * width + d, 4.0 * d * width, 2.0 * (d + 2 * width))


def tp_plan_toy_block(block: ToyBlock, prefix: str, cfg, tp) -> None:
    tp.replicated(block.attn_norm, f"{prefix}.attn_norm")
    tp.replicated(block.mlp_norm, f"{prefix}.mlp_norm")
    tp.attention(block.attn, f"{prefix}.attn", cfg.n_heads, cfg.kv_heads, cfg.rope_theta)
    rows, cols = tp.width_specs(block.mlp.w1.weight.shape[0], cfg.taper.multiple, f"{prefix}.mlp")
    tp.column(block.mlp, "w1", f"{prefix}.mlp", rows)
    tp.row(block.mlp, "w2", f"{prefix}.mlp", cols)
    tp.enter_region_at_input(block.mlp)


def check_toy_layout(mcfg, pcfg) -> None:
    if pcfg.tp > 2:
        raise ConfigError(f"parallel.tp={pcfg.tp}: the toy family is tested up to parallel.tp=2")


CARD = FamilyCard(name="toy", module=__name__, section="toy", options=ToyConfig,
                  test_cases={"squared": (), "relu": ("model.toy.squared=false",)})
SPECS = (FamilySpec(card=CARD, build=Toy, layer_cost=toy_layer_cost, tp_block_plan=tp_plan_toy_block,
                    check_layout=check_toy_layout),)
