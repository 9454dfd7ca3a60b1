"""Packed windows of several documents against each document alone (the recurrent families' resets).

`forward_with_documents` is Transformer.forward with `doc_start` handed to every block (what the
model-level plumbing does); `packed_against_alone` runs a window of documents packed and each
document alone, from the same weights, and returns the largest differences of the logits and of
every parameter's gradient (loss: a fixed random projection of the logits, summed over the documents).
"""
from __future__ import annotations

import inspect

import torch

from megatron_taper.models.layers import rope_tables


def forward_with_documents(model, tokens: torch.Tensor, doc_start: torch.Tensor | None) -> torch.Tensor:
    h = model.tok_embeddings(tokens)
    if "doc_start" in inspect.signature(model.run_blocks).parameters:  # a family with its own run_blocks
        h = model.run_blocks(h, doc_start=doc_start)
    else:
        cos, sin = rope_tables(h.shape[1], model.cfg.head_dim, model.cfg.rope_theta, h.device)
        for block in model.layers.values():
            h = block(h, cos, sin, doc_start=doc_start)
    h = model.norm(h)
    return model.output(h) if model.output is not None else h @ model.tok_embeddings.weight.t()


def documents_of(doc_start: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per batch row the [start, end) of its documents (row 0 always starts one)."""
    out = []
    for row in doc_start:
        cuts = sorted({0, *row.nonzero().flatten().tolist()}) + [row.shape[0]]
        out.append(list(zip(cuts[:-1], cuts[1:])))
    return out


def grads_of(model, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    got = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(params.items(), got)}


def packed_against_alone(model, tokens: torch.Tensor, doc_start: torch.Tensor) -> tuple[float, float, float]:
    """(max |logits packed - alone|, max |grad packed - grad alone| over every parameter, the largest
    |grad| for scale)."""
    probe = torch.randn(*tokens.shape, model.cfg.vocab_size, generator=torch.Generator().manual_seed(3))
    packed = forward_with_documents(model, tokens, doc_start)
    g_packed = grads_of(model, (packed * probe).sum())
    alone_logits, loss = torch.zeros_like(packed), 0.0
    for b, docs in enumerate(documents_of(doc_start)):
        for start, end in docs:
            logits = model(tokens[b:b + 1, start:end])
            alone_logits[b, start:end] = logits[0].detach()
            loss = loss + (logits[0] * probe[b, start:end]).sum()
    g_alone = grads_of(model, loss)
    logit_diff = (packed.detach() - alone_logits).abs().max().item()
    grad_diff = max((g_packed[n] - g_alone[n]).abs().max().item() for n in g_alone)
    scale = max(g.abs().max().item() for g in g_alone.values())
    return logit_diff, grad_diff, scale


def none_is_today(model, tokens: torch.Tensor) -> bool:
    """doc_start=None gives model(tokens) bitwise, logits and gradients."""
    today = model(tokens)
    g_today = grads_of(model, today.square().sum())
    got = forward_with_documents(model, tokens, None)
    g_got = grads_of(model, got.square().sum())
    return torch.equal(today, got) and all(torch.equal(g_today[n], g_got[n]) for n in g_today)
