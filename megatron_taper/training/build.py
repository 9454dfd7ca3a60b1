"""build_run(cfg): the one chain from a validated config to a model ready to train.

    preflight(cfg, world size)          every cross-section rule, before any process group
                                        (skipped when the caller ran it and passes its Layout)
    -> init_parallel                    (pp, dp, cp, tp) mesh, device      (unless a context is given)
    -> seed_everything(train.seed)
    -> build_model on the meta device   the family's single-device model, without storage
    -> parallelize                      pipeline split -> tensor parallel -> block options
                                        (checkpointing, compile) -> ZeRO, on meta
    -> materialise                      this rank's parameters on its device, each set to its part
                                        of the family's init_value (parallel/meta_init.py)
    -> attach_data_parallel             zero=none, dp x cp > 1: torch DDP (parallel/dp/ddp.py)
    -> document_end                     data.document_mask: the data's end-of-document id, from which
                                        each batch's doc_start is derived (ParallelModel.batch_inputs)
    -> build_optimizer                  AdamW (or the engine's, e.g. DeepSpeed's)

Each rank allocates only its pipeline stage and its tp / fsdp2 shards, plus one full parameter at
a time while initialising; the weights equal the one-process model's (`init_weights`) for every
layout. Where meta is not used:
- parallel.zero=deepspeed: materialised before deepspeed.initialize (at build_optimizer), which
  partitions real tensors, so each rank briefly holds its whole tp-local stage (full / tp) in fp32.
- parallel.pp_balance=profile: rank 0's tp group materialises one piece (a block, the embedding,
  the head) at a time, its own tp shard of it, to time it (parallel/pp/schedule.py make_plan), and
  frees it before the next piece and before its stage is materialised.
- a model that registers buffers (none here): to_empty cannot recreate their values, so such a model
  is built and initialised whole on every rank, then parallelised.

Used by the Trainer, the benchmarks and the tests, so they all run the same code path.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from megatron_taper.config import Config
from megatron_taper.cost.preflight import Layout, preflight
from megatron_taper.data.sources import document_end_id
from megatron_taper.models import build_model
from megatron_taper.models.layers import Attention, sdpa_backend
from megatron_taper.parallel.context import ParallelContext, has_bf16, init_parallel, world_size
from megatron_taper.parallel.meta_init import has_buffers, logical_shapes, materialise
from megatron_taper.parallel.model import ParallelModel
from megatron_taper.parallel.parallelize import parallelize


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


def build_run(cfg: Config, ctx: ParallelContext | None = None, layout: Layout | None = None) -> BuiltRun:
    """The chain above; `ctx` when the caller already joined the process group, `layout` when it
    already ran preflight (train.run does, before joining: preflight runs once per process)."""
    if layout is None:
        layout = preflight(cfg, ctx.world_size if ctx is not None else world_size())
    ctx = ctx or init_parallel(cfg.parallel, cfg.train.device)
    seed_everything(cfg.train.seed)
    with torch.device("meta"):
        model = build_model(cfg.model)
    if has_buffers(model):
        model = build_model(cfg.model)
        model.init_weights(cfg.train.seed)
        pm = parallelize(model, ctx, cfg.model, cfg.parallel, cfg.train)
    else:
        shapes, init_value = logical_shapes(model), model.init_value
        pm = parallelize(model, ctx, cfg.model, cfg.parallel, cfg.train)
        materialise(pm, shapes, init_value, cfg.train.seed)
    if cfg.parallel.zero == "none" and ctx.dp * ctx.cp > 1:
        pm.attach_data_parallel(cfg.parallel.ddp_bucket_mb)
    if cfg.data.document_mask:
        pm.document_end = document_end_id(cfg.data, cfg.model.vocab_size)
    optimizer = pm.build_optimizer(cfg.train)
    return BuiltRun(cfg, ctx, layout, pm, optimizer, cfg.train.uses_bf16(has_bf16(ctx.device)))


def attention_kernel_line(run: BuiltRun) -> str | None:
    """Which kernel torch's SDPA picks for the run's attention blocks (flash, cuDNN, efficient or
    math: models/layers.py sdpa_backend) at its micro-batch, heads per tp rank and precision, as
    the Trainer prints it at start; None without such blocks or under context parallelism (whose
    attention runs its own split: parallel/cp/split.py)."""
    m, train, ctx = run.cfg.model, run.cfg.train, run.ctx
    if ctx.cp > 1 or not any(isinstance(x, Attention) for x in run.model.module.modules()):
        return None
    dtype = torch.bfloat16 if run.bf16 else torch.float32
    heads, kv_heads = -(-m.n_heads // ctx.tp), -(-m.kv_heads // ctx.tp)
    alibi = m.position_encoding == "alibi"
    backend = sdpa_backend(train.micro_batch, heads, kv_heads, m.seq_len, m.head_dim, dtype, ctx.device, alibi)
    return (f"attention: SDPA runs {backend} (torch's choice for q [{train.micro_batch}, {heads}, {m.seq_len}, "
            f"{m.head_dim}] {str(dtype).removeprefix('torch.')}, {'ALiBi bias' if alibi else 'causal'}, "
            f"on {ctx.device.type})")

