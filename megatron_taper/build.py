"""build_run(cfg): the one chain from a validated config to a model ready to train.

    preflight(cfg, world size)          every cross-section rule, before any process group
    -> init_parallel                    (pp, dp, tp) mesh, device      (unless a context is given)
    -> seed_everything(train.seed)
    -> build_model -> init_weights      the family's single-device model, split-independent init
    -> parallelize                      pipeline split -> tensor parallel -> ZeRO
    -> build_optimizer                  AdamW (or the engine's, e.g. DeepSpeed's)

Used by the Trainer, the benchmarks and the tests, so they all run the same code path.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from megatron_taper.config import Config
from megatron_taper.models import build_model
from megatron_taper.parallel.context import ParallelContext, init_parallel, uses_bf16, world_size
from megatron_taper.parallel.model import ParallelModel
from megatron_taper.parallel.parallelize import parallelize
from megatron_taper.preflight import Layout, preflight


@dataclass
class BuiltRun:
    cfg: Config
    ctx: ParallelContext
    layout: Layout
    model: ParallelModel
    optimizer: torch.optim.Optimizer
    bf16: bool  # autocast to bf16 (train.precision on this device)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_run(cfg: Config, ctx: ParallelContext | None = None) -> BuiltRun:
    """The chain above; `ctx` when the caller already joined the process group."""
    layout = preflight(cfg, ctx.world_size if ctx is not None else world_size())
    ctx = ctx or init_parallel(cfg.parallel, cfg.train.device)
    seed_everything(cfg.train.seed)
    model = build_model(cfg.model)
    model.init_weights(cfg.train.seed)
    pm = parallelize(model, ctx, cfg.model, cfg.parallel, cfg.train)
    optimizer = pm.build_optimizer(cfg.train)
    return BuiltRun(cfg, ctx, layout, pm, optimizer, uses_bf16(cfg.train.precision, ctx.device))
