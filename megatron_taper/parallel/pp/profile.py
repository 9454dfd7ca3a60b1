"""Measured per-layer forward+backward times, for parallel.pp_balance=profile and
tools/plan_pipeline.py --profile (timing lives here, not in the training step)."""
from __future__ import annotations

import contextlib
import copy
import functools
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from megatron_taper.models.layers import cross_entropy
from megatron_taper.parallel.tp.layers import vocab_parallel_cross_entropy
from megatron_taper.parallel.tp.plan import apply_tp


def _record_block_inputs(model: nn.Module, tokens: torch.Tensor, keep: Callable[[torch.Tensor], Any],
                         autocast: Callable) -> dict[str, tuple]:
    """One forward of `model` on `tokens`: each block's (and the final norm's, as "norm") positional
    inputs, tensors passed through `keep`."""
    inputs: dict[str, tuple] = {}

    def capture(name):
        def hook(_module, args):
            inputs[name] = tuple(keep(a) if torch.is_tensor(a) else a for a in args)
        return hook

    handles = [block.register_forward_pre_hook(capture(name)) for name, block in model.layers.items()]
    if model.norm is not None:
        handles.append(model.norm.register_forward_pre_hook(capture("norm")))
    with torch.no_grad(), autocast():
        model(tokens)
    for h in handles:
        h.remove()
    return inputs


def _block_run(block: nn.Module, args: tuple, autocast: Callable) -> Callable[[], None]:
    def run():
        x = args[0].clone().requires_grad_(True)
        with autocast():
            out = block(x, *args[1:])
        out.float().sum().backward()
    return run


def _embedding_run(embedding: nn.Module | None, tokens: torch.Tensor, autocast: Callable) -> Callable[[], None]:
    def run():
        if embedding is not None:
            with autocast():
                out = embedding(tokens[:, :-1])
            out.float().sum().backward()
    return run


def _head_run(norm: nn.Module, output: nn.Module | None, embedding: nn.Module | None, args: tuple,
              tokens: torch.Tensor, autocast: Callable, loss_fn: Callable = cross_entropy) -> Callable[[], None]:
    def run():  # norm + head (or the tied embedding) + loss
        x = args[0].clone().requires_grad_(True)
        with autocast():
            h = norm(x)
            logits = output(h) if output is not None else h @ embedding.weight.t()
            loss = loss_fn(logits, tokens[:, 1:])
        loss.backward()
    return run


def _timer(device) -> Callable[[Callable[[], None]], float]:
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def timed_once(fn) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0
    return timed_once


def profile_layer_times(model: nn.Module, micro_batch: int, seq_len: int, device, warmup: int = 2, iters: int = 5,
                        autocast=None) -> tuple[list[float], float, float]:
    """Measured forward+backward seconds of each block, of the embedding and of norm + head + loss.

    One forward through `model` (blocks in `model.layers`) records each block's real inputs; then
    each piece is timed alone on `device`: `warmup` rounds, then the median of `iters` rounds. Generic over
    families whose blocks take positional tensors. Measurements differ per rank: pipeline.py
    measures on rank 0 (or its tp group) and broadcasts, so every rank balances the same numbers.
    """
    autocast = autocast or contextlib.nullcontext
    model = model.to(device)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.cfg.vocab_size, (micro_batch, seq_len + 1), generator=gen).to(device)
    inputs = _record_block_inputs(model, tokens[:, :-1], torch.Tensor.detach, autocast)
    timed_once = _timer(device)
    # Rounds over all pieces (not piece after piece), so slow drifts of a shared machine hit
    # every layer alike; the median of the rounds after warm-up.
    pieces = [_block_run(block, inputs[name], autocast) for name, block in model.layers.items()]
    pieces += [_embedding_run(model.tok_embeddings, tokens, autocast),
               _head_run(model.norm, model.output, model.tok_embeddings, inputs["norm"], tokens, autocast)]
    samples: list[list[float]] = [[] for _ in pieces]
    for k in range(warmup + iters):
        for i, fn in enumerate(pieces):
            t = timed_once(fn)
            if k >= warmup:
                samples[i].append(t)
        model.zero_grad(set_to_none=True)
    medians = [statistics.median(x) for x in samples]
    return medians[:-2], medians[-2], medians[-1]


@dataclass(frozen=True)
class TPShard:
    """The tensor-parallel group a profile times its pieces under (every member calls the profile)."""

    group: Any  # torch.distributed.ProcessGroup
    rank: int
    size: int
    model_cfg: Any  # ModelConfig
    sequence_parallel: bool


def profile_meta_layer_times(model: nn.Module, micro_batch: int, seq_len: int, device, warmup: int = 2,
                             iters: int = 5, autocast=None, tp: TPShard | None = None
                             ) -> tuple[list[float], float, float]:
    """As profile_layer_times, for a model on the meta device, materialising one piece at a time:
    a forward on the meta device records each block's input shapes; then each block (then the
    embedding, then norm + head + loss) alone is materialised on `device` with random weights and
    random inputs of those shapes, timed (`warmup` rounds, the median of `iters`) and freed, so
    the peak is one piece, not the model. Pieces are timed one after the other (not in rounds).

    With `tp`, every rank of tp.group calls this: a meta copy of the model is sharded by the
    family's tp plan (parallel/tp/plan.py apply_tp), so each rank times its own shard of each piece
    with the run's tp collectives (sequence parallel: block inputs of seq_len / tp positions; head
    loss: the vocab-parallel cross-entropy); each piece's time is the maximum over the tp ranks."""
    autocast = autocast or contextlib.nullcontext
    sp = tp is not None and tp.sequence_parallel
    meta_tokens = torch.zeros(micro_batch, seq_len // tp.size if sp else seq_len, dtype=torch.long, device="meta")
    shapes = _record_block_inputs(model, meta_tokens, lambda a: (a.shape, a.dtype), contextlib.nullcontext)
    gen = torch.Generator().manual_seed(0)
    pieces = copy.deepcopy(model)  # on meta: no storage
    loss_fn = cross_entropy
    if tp is not None:
        plan = apply_tp(pieces, tp.group, tp.rank, tp.size, tp.model_cfg, tp.sequence_parallel)
        loss_fn = functools.partial(vocab_parallel_cross_entropy, group=tp.group, vocab_start=plan.vocab_start)

    def real(module: nn.Module) -> nn.Module:
        module.to_empty(device=device)
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        return module

    def inputs(name: str) -> tuple:
        def value(a):
            if not (isinstance(a, tuple) and len(a) == 2 and isinstance(a[1], torch.dtype)):
                return a
            shape, dtype = a
            if dtype.is_floating_point:
                return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
            return torch.zeros(shape, dtype=dtype, device=device)
        return tuple(value(a) for a in shapes[name])

    timed_once = _timer(device)

    def median_time(fn) -> float:
        samples = [timed_once(fn) for _ in range(warmup + iters)][warmup:]
        return statistics.median(samples)

    tokens = torch.randint(0, model.cfg.vocab_size, (micro_batch, seq_len + 1), generator=gen).to(device)
    embedding = real(pieces.tok_embeddings) if pieces.tok_embeddings is not None else None
    blocks = []
    for name in list(pieces.layers):
        blocks.append(median_time(_block_run(real(pieces.layers[name]), inputs(name), autocast)))
        del pieces.layers[name]  # freed before the next block is materialised
    embed_s = median_time(_embedding_run(embedding, tokens, autocast))
    norm, output = real(pieces.norm), real(pieces.output) if pieces.output is not None else None
    head_s = median_time(_head_run(norm, output, embedding, inputs("norm"), tokens, autocast, loss_fn))
    times = torch.tensor([*blocks, embed_s, head_s], dtype=torch.float64)
    if tp is not None:  # a piece takes as long as its slowest shard
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=tp.group)
    times_list = times.tolist()
    return times_list[:-2], times_list[-2], times_list[-1]
