"""A CMS level's fast-weight pieces shared by the block (model.py) and its cp chain (cp.py): the
tensor-parallel hooks of a level, the weights' shape, and a SwiGLU's activations with the
derivative the online step needs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class LevelComm:
    """Where a CMS level meets the other tensor-parallel ranks: the identity on one device; a tp
    plan (tp_plan_hope_attention_block) puts the collectives of parallel/tp/layers.py in place."""

    enter: Callable[[torch.Tensor], torch.Tensor] = identity  # block input -> the shard's input (f)
    sum_partial: Callable[[torch.Tensor], torch.Tensor] = identity  # partial sums -> whole (all-reduce)
    reenter: Callable[[torch.Tensor], torch.Tensor] = identity  # whole -> used again by the shard (f)
    leave: Callable[[torch.Tensor], torch.Tensor] = identity  # whole output -> the block's layout
    leave_partial: Callable[[torch.Tensor], torch.Tensor] = identity  # partial output -> block's layout


Weights = tuple[torch.Tensor, torch.Tensor]  # w13 = [w1; w3] [2W, D] and w2 [D, W]; [B, ...] once updated


@dataclass(frozen=True)
class SwiGLUActivations:
    """A SwiGLU's hidden activations for inputs n [B, C, D], each [B, C, W]: s = silu(w1 n),
    h = s * (w3 n), and dh_da = (w3 n) * silu'(w1 n), the derivative of h by w1 n."""

    s: torch.Tensor
    h: torch.Tensor
    dh_da: torch.Tensor

    @classmethod
    def of(cls, n: torch.Tensor, w13: torch.Tensor) -> "SwiGLUActivations":
        a, g = (n @ w13.transpose(-1, -2)).chunk(2, dim=-1)  # one matmul for w1 and w3
        sig = torch.sigmoid(a)
        s = a * sig
        return cls(s, s * g, g * sig * (1 + a * (1 - sig)))  # silu'(a) = sig (1 + a (1 - sig))
