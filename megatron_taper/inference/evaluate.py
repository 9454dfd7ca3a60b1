"""Held-out loss and perplexity of a model, at one or several sequence lengths.

`evaluate_lengths` runs the Trainer's evaluation loop (megatron_taper/training/held_out.py) once per
sequence length on fresh held-out sources (`data.path`'s val split, or the tail of a .npy token
file; under `data.mix` each source's val split separately, and their losses weighted by the
mixture). `evaluate_checkpoint` does everything `tools/evaluate.py` does: read a checkpoint's
config, build the model at the layout given by the overrides (`parallel.*`; default one process,
no ZeRO) through `build.build_run`, load only the model weights of this rank's pieces (no
optimizer state), evaluate, and return one JSON-ready object. RoPE tables are computed for any
length, so lengths beyond the training `model.seq_len` are allowed (that measures length
extrapolation). A run trained with data.document_mask is evaluated with it (attention inside each
document of the held-out windows; `data.document_mask=false` overrides it).
"""
from __future__ import annotations

import contextlib
import copy
from typing import TYPE_CHECKING, Callable

import torch

from megatron_taper.config import Config, ParallelConfig, apply_override
from megatron_taper.inference.load import CheckpointRef, load_parallel_weights, open_checkpoint
from megatron_taper.parallel.context import init_parallel, shutdown, world_size
from megatron_taper.training.held_out import EvalResult, combined_loss, evaluate_source
from megatron_taper.validation import ConfigError

if TYPE_CHECKING:
    from megatron_taper.data import BatchSource
    from megatron_taper.parallel.model import ParallelModel


def held_out_samples(source: BatchSource) -> int | None:
    """Samples in a held-out source before it repeats (token files: `count`, MDS: one epoch)."""
    for attr in ("count", "samples_per_epoch"):
        value = getattr(source, attr, None)
        if isinstance(value, int):
            return value
    return None


def evaluate_lengths(pm: ParallelModel, cfg: Config, seq_lens: list[int], batch_size: int, batches: int,
                     autocast: Callable = contextlib.nullcontext) -> dict[int, dict[str, EvalResult]]:
    """evaluate_source at every sequence length, each on fresh held-out sources of `cfg.data`:
    {seq_len: {"": the result, and under data.mix each source's by name ("" then holds the losses
    weighted by the mixture, tokens and batches summed)}}. `batches` is lowered where a held-out
    split has fewer samples (nothing is counted twice)."""
    from megatron_taper.data.sources import build_sources

    ctx = pm.ctx
    out = {}
    for seq_len in seq_lens:
        _, held_out = build_sources(cfg.data, seq_len=seq_len, micro_batch=batch_size, seed=cfg.train.seed,
                                    vocab_size=cfg.model.vocab_size, dp_rank=ctx.dp_rank, dp_size=ctx.dp)
        if not held_out:
            what = "data.mix has no source with" if cfg.data.mix else f"data.path={cfg.data.path!r} has no"
            raise ValueError(f"{what} held-out split (an MDS folder needs val/, a .npy file data.eval_fraction "
                             f"> 0); pass --data with held-out data")
        results = {}
        for h in held_out:
            source = h.make()
            available = held_out_samples(source)
            n = batches if available is None else max(1, min(batches, available // (batch_size * ctx.dp)))
            results[h.name] = evaluate_source(pm, source, n, autocast)
        if cfg.data.mix:
            results[""] = EvalResult(combined_loss(results, held_out), sum(r.tokens for r in results.values()),
                                     sum(r.batches for r in results.values()))
        out[seq_len] = results
    return out


def evaluation_config(ref: CheckpointRef, overrides: list[str], batch_size: int, data: str = "") -> Config:
    """The checkpoint's run config made for evaluation: the parallel section reset to its
    defaults (one process, no ZeRO), then `overrides`; batch settings that preflight accepts for
    `batch_size` sequences per micro-batch; no activation checkpointing or compile. The model
    section cannot be overridden (the weights fix it)."""
    cfg = copy.deepcopy(ref.config)
    cfg.parallel = ParallelConfig()
    for item in overrides:
        apply_override(cfg, item)
    if data:
        cfg.data.path, cfg.data.mix = data, []
    cfg.validate()
    if cfg.model.architecture_dict() != ref.config.model.architecture_dict():
        raise ConfigError("model.*: the model of a checkpoint is fixed by its weights and cannot be overridden")
    if cfg.parallel.zero == "deepspeed":
        raise ConfigError("parallel.zero=deepspeed: evaluation builds no DeepSpeed engine; use parallel.zero=none "
                          "or fsdp2 (a DeepSpeed checkpoint's logical records load at any layout)")
    p, t = cfg.parallel, cfg.train
    dp = max(1, world_size() // (p.tp * p.pp))
    t.micro_batch = batch_size
    t.global_batch = batch_size * dp * p.pp  # pp > 1: pp micro-batches per step, as 1F1B requires
    p.microbatches = 0
    t.activation_checkpointing, t.compile = "none", False
    return cfg.validate()


def evaluate_checkpoint(checkpoint: str, overrides: list[str] = (), seq_lens: list[int] | None = None,
                        batches: int | None = None, batch_size: int | None = None, data: str = "") -> dict:
    """tools/evaluate.py: {checkpoint, step, layout, data, results: {seq_len: {loss, ppl, tokens,
    batches}}}. Under torchrun (or in processes that already joined a process group) every rank
    calls it and gets the same object; the process group is left at the end."""
    from megatron_taper.cost.preflight import preflight
    from megatron_taper.training.build import build_run

    ref = open_checkpoint(checkpoint)
    batch_size = batch_size or ref.config.train.micro_batch
    cfg = evaluation_config(ref, list(overrides), batch_size, data)
    preflight(cfg, world_size())  # before joining: a bad layout fails alike on every rank
    ctx = init_parallel(cfg.parallel, cfg.train.device)
    ok = False
    try:
        run = build_run(cfg, ctx)  # with data.document_mask (as the run trained): attention inside each document
        load_parallel_weights(run.model, ref)
        lengths = seq_lens or [cfg.model.seq_len]
        results = evaluate_lengths(run.model, cfg, lengths, batch_size, batches or cfg.train.eval_batches,
                                   _autocast(run))
        ok = True
    finally:
        shutdown(ctx, barrier=ok)
    return {"checkpoint": ref.path, "step": ref.step,
            "layout": {"pp": ctx.pp, "dp": ctx.dp, "tp": ctx.tp, "zero": cfg.parallel.zero},
            "data": cfg.data.path or cfg.data.mix or "(built-in corpus)",
            "results": {str(n): {**_as_dict(r[""]), **({"sources": {k: _as_dict(v) for k, v in r.items() if k}}
                                                          if len(r) > 1 else {})}
                        for n, r in results.items()}}


def _as_dict(r: EvalResult) -> dict:
    return {"loss": r.loss, "ppl": r.ppl, "tokens": r.tokens, "batches": r.batches}


def _autocast(run) -> Callable:
    if run.bf16:
        return lambda: torch.autocast(run.ctx.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext
