"""Measured per-layer forward+backward times, for parallel.pp_balance=profile and
tools/plan_pipeline.py --profile (timing lives here, not in the training step)."""
from __future__ import annotations

import contextlib
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
