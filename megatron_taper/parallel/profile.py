"""Measured per-layer forward+backward times, for parallel.pp_balance=profile and
tools/plan_pipeline.py --profile (timing lives here, not in the training step)."""
from __future__ import annotations

import contextlib
import copy
import statistics
import time

import torch
from torch import nn

from megatron_taper.models.layers import cross_entropy


def profile_layer_times(model: nn.Module, micro_batch: int, seq_len: int, device, warmup: int = 2, iters: int = 5,
                        autocast=None) -> tuple[list[float], float, float]:
    """Measured forward+backward seconds of each block, of the embedding and of norm + head + loss.

    One forward through `model` (blocks in `model.layers`) records each block's real inputs; then
    each piece is timed alone on `device`: `warmup` rounds, then the median of `iters` rounds. Generic over
    families whose blocks take positional tensors. Measurements differ per rank: pipeline.py
    measures on one rank and broadcasts, so every rank balances the same numbers.
    """
    autocast = autocast or contextlib.nullcontext
    model = model.to(device)
    vocab = model.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=gen).to(device)
    inputs: dict[str, tuple] = {}

    def capture(name):
        def hook(_module, args):
            inputs[name] = tuple(a.detach() if torch.is_tensor(a) else a for a in args)
        return hook

    handles = [block.register_forward_pre_hook(capture(name)) for name, block in model.layers.items()]
    if model.norm is not None:
        handles.append(model.norm.register_forward_pre_hook(capture("norm")))
    with torch.no_grad(), autocast():
        model(tokens[:, :-1])
    for h in handles:
        h.remove()

    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def timed_once(fn) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    def run_block(name):
        args = inputs[name]
        x = args[0].clone().requires_grad_(True)
        with autocast():
            out = model.layers[name](x, *args[1:])
        out.float().sum().backward()

    def run_embedding():
        if model.tok_embeddings is None:
            return
        with autocast():
            out = model.tok_embeddings(tokens[:, :-1])
        out.float().sum().backward()

    def run_head():
        x = inputs["norm"][0].clone().requires_grad_(True)
        with autocast():
            h = model.norm(x)
            logits = model.output(h) if model.output is not None else h @ model.tok_embeddings.weight.t()
            loss = cross_entropy(logits, tokens[:, 1:])
        loss.backward()

    # Rounds over all pieces (not piece after piece), so slow drifts of a shared machine hit
    # every layer alike; the median of the rounds after warm-up.
    pieces = [lambda n=name: run_block(n) for name in model.layers] + [run_embedding, run_head]
    samples: list[list[float]] = [[] for _ in pieces]
    for k in range(warmup + iters):
        for i, fn in enumerate(pieces):
            t = timed_once(fn)
            if k >= warmup:
                samples[i].append(t)
        model.zero_grad(set_to_none=True)
    medians = [statistics.median(x) for x in samples]
    return medians[:-2], medians[-2], medians[-1]


def profile_meta_layer_times(model: nn.Module, micro_batch: int, seq_len: int, device, warmup: int = 2,
                             iters: int = 5, autocast=None) -> tuple[list[float], float, float]:
    """As profile_layer_times, for a model on the meta device, materialising one piece at a time:
    a forward on the meta device records each block's input shapes; then each block (then the
    embedding, then norm + head + loss) alone is copied to `device` with random weights and
    random inputs of those shapes, timed (`warmup` rounds, the median of `iters`) and freed, so
    the peak is one piece, not the model. Pieces are timed one after the other (not in rounds)."""
    autocast = autocast or contextlib.nullcontext
    vocab = model.cfg.vocab_size
    shapes: dict[str, tuple] = {}

    def capture(name):
        def hook(_module, args):
            shapes[name] = tuple((a.shape, a.dtype) if torch.is_tensor(a) else a for a in args)
        return hook

    handles = [block.register_forward_pre_hook(capture(name)) for name, block in model.layers.items()]
    if model.norm is not None:
        handles.append(model.norm.register_forward_pre_hook(capture("norm")))
    with torch.no_grad():
        model(torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta"))
    for h in handles:
        h.remove()
    gen = torch.Generator().manual_seed(0)

    def real(module: nn.Module) -> nn.Module:
        piece = copy.deepcopy(module).to_empty(device=device)
        with torch.no_grad():
            for p in piece.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        return piece

    def inputs(name: str) -> list:
        return [torch.randn(a[0], generator=gen).to(device=device, dtype=a[1])
                if isinstance(a, tuple) and len(a) == 2 and isinstance(a[1], torch.dtype) and a[1].is_floating_point
                else torch.zeros(a[0], dtype=a[1], device=device)
                if isinstance(a, tuple) and len(a) == 2 and isinstance(a[1], torch.dtype) else a
                for a in shapes[name]]

    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def median_time(fn) -> float:
        samples = []
        for k in range(warmup + iters):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if k >= warmup:
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    def block_time(name: str) -> float:
        block, args = real(model.layers[name]), inputs(name)

        def run():
            x = args[0].clone().requires_grad_(True)
            with autocast():
                out = block(x, *args[1:])
            out.float().sum().backward()
        return median_time(run)

    tokens = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=gen).to(device)
    embedding = real(model.tok_embeddings) if model.tok_embeddings is not None else None

    def run_embedding():
        if embedding is not None:
            with autocast():
                out = embedding(tokens[:, :-1])
            out.float().sum().backward()

    blocks = [block_time(name) for name in model.layers]
    embed_s = median_time(run_embedding)
    norm, output = real(model.norm), real(model.output) if model.output is not None else None
    head_args = inputs("norm")

    def run_head():
        x = head_args[0].clone().requires_grad_(True)
        with autocast():
            h = norm(x)
            logits = output(h) if output is not None else h @ embedding.weight.t()
            loss = cross_entropy(logits, tokens[:, 1:])
        loss.backward()

    return blocks, embed_s, median_time(run_head)
