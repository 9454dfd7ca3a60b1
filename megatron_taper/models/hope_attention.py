"""Hope-attention (Nested Learning, arXiv 2512.24695): attention followed by a Continuum Memory
System (CMS), a chain of MLP levels whose parameters change at different frequencies.

    x = x + attn(norm(x))
    for level l = 0 .. L_cms - 1:
        x = x + MLP_l(norm_l(x))          SwiGLU of this block's tapered width w

Without online updates (`model.hope.online=false`, the default) every level changes only with
the outer optimizer, i.e. the CMS is a chain of residual SwiGLUs. With online updates, level l
also learns inside the forward pass: every C_l = chunk_size * chunk_growth**l tokens its output
projection takes one gradient step (size `online_lr`, per sequence) on the local
auto-associative loss mean_t ||w2 h_t - norm_l(x)_t||^2 over the chunk just finished, where
h_t = silu(w1 n_t) * w3 n_t. The step only affects later chunks, so the block stays causal; the
outer gradient flows through the updates. The taper applies to the CMS widths: every level of
block i has width w_i, so tapered and uniform twins have equal parameter counts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taper.models.costs import Cost, attention_cost, swiglu_cost
from megatron_taper.models.layers import RMSNorm, SwiGLU
from megatron_taper.models.spec import FamilySpec
from megatron_taper.models.transformer import Transformer, TransformerBlock
from megatron_taper.validation import ConfigError, check_range

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig, ParallelConfig
    from megatron_taper.parallel.tp_plan import TPBuilder


@dataclass
class HopeConfig:
    """model.hope"""

    levels: int = 2  # MLP levels of the Continuum Memory System after each attention
    chunk_size: int = 16  # update period (tokens) of the fastest level when online
    chunk_growth: int = 4  # level l updates every chunk_size * chunk_growth**l tokens
    online: bool = False  # update the levels inside the forward pass (off: plain MLP chain)
    online_lr: float = 0.01  # step size of the online updates

    def validate(self, prefix: str) -> None:
        for key in ("levels", "chunk_size", "chunk_growth"):
            check_range(f"{prefix}.{key}", getattr(self, key), 1, None)
        check_range(f"{prefix}.online_lr", self.online_lr, 0.0, None, open_low=True)


class HopeAttentionBlock(TransformerBlock):
    def __init__(self, cfg: ModelConfig, mlp_width: int):
        super().__init__(cfg, mlp_width)
        del self.mlp_norm, self.mlp
        hope = cfg.hope
        self.cms_norms = nn.ModuleList(RMSNorm(cfg.d_model, cfg.norm_eps) for _ in range(hope.levels))
        self.cms = nn.ModuleList(SwiGLU(cfg.d_model, mlp_width) for _ in range(hope.levels))
        self.online = hope.online
        self.online_lr = hope.online_lr
        self.periods = [hope.chunk_size * hope.chunk_growth**level for level in range(hope.levels)]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        for norm, mlp, period in zip(self.cms_norms, self.cms, self.periods):
            n = norm(x)
            x = x + (online_mlp(mlp, n, period, self.online_lr) if self.online else mlp(n))
        return x


def online_mlp(mlp: SwiGLU, n: torch.Tensor, period: int, lr: float) -> torch.Tensor:
    """SwiGLU whose output projection takes a gradient step after every `period` tokens.

    n: [B, S, D] (the level's normalised input, also the regression target). Returns [B, S, D].
    """
    h = F.silu(mlp.w1(n)) * mlp.w3(n)  # [B, S, W]
    w = mlp.w2.weight.t().expand(n.shape[0], -1, -1)  # [B, W, D], one copy per sequence
    outs = []
    for start in range(0, n.shape[1], period):
        hc, target = h[:, start:start + period], n[:, start:start + period]
        out = hc @ w  # [B, C, D], read with the state at the chunk's start
        outs.append(out)
        grad = hc.transpose(1, 2) @ (2.0 * (out - target)) / hc.shape[1]  # d mean_t ||.||^2 / dw
        w = w - lr * grad
    return torch.cat(outs, dim=1)


class HopeAttention(Transformer):
    block_class = HopeAttentionBlock


def hope_attention_layer_cost(cfg: ModelConfig, width: int, causal: bool = True) -> Cost:
    attn = attention_cost(cfg, causal)
    mlp = swiglu_cost(cfg, width)
    levels = cfg.hope.levels
    flops = attn.flops + levels * mlp.flops
    if cfg.hope.online:  # per token: its share of the chunk's weight gradient h^T (out - n)
        flops += levels * 2 * width * cfg.d_model
    return Cost(attn.params + levels * mlp.params, flops, attn.act_bytes + levels * mlp.act_bytes)


def tp_plan_hope_attention_block(block: HopeAttentionBlock, prefix: str, cfg: ModelConfig, tp: TPBuilder) -> None:
    """Attention as in the Transformer; every CMS level a SwiGLU split like the MLP."""
    tp.replicated(block.attn_norm, f"{prefix}.attn_norm")
    tp.attention(block.attn, f"{prefix}.attn", cfg.n_heads, cfg.kv_heads, cfg.rope_theta)
    for level, (norm, mlp) in enumerate(zip(block.cms_norms, block.cms)):
        tp.replicated(norm, f"{prefix}.cms_norms.{level}")
        tp.swiglu(mlp, f"{prefix}.cms.{level}", cfg.taper.multiple)


def check_hope_layout(mcfg: ModelConfig, pcfg: ParallelConfig) -> None:
    if mcfg.hope.online and pcfg.tp > 1:
        raise ConfigError(f"model.hope.online=true is not supported with parallel.tp={pcfg.tp} (the online "
                          f"update needs each level's whole output); set model.hope.online=false or parallel.tp=1")


SPEC = FamilySpec(name="hope_attention", build=HopeAttention, layer_cost=hope_attention_layer_cost,
                  tp_block_plan=tp_plan_hope_attention_block, check_layout=check_hope_layout,
                  section="hope", options=HopeConfig)
