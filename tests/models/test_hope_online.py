"""The online CMS level's scan (models/hope_attention/online.py: dual form, hand-written backward) against
the definition of its math, tests/helpers/hope_reference.py's chunked_reference_level (the
per-chunk loop on materialised fast weights, autograd through it).

float64: outputs, end weights and the gradients by w1, w3, w2, raw_step and the input (and by
batched start weights) agree within 1e-10 relative to the largest entry of each (measured: below
1e-14), for sequences that are a multiple of the chunk and not, chunks of 1 to 7 tokens, groups
of one to several chunks (GROUP_TOKENS patched small), the context-parallel slice's end update,
tensor parallelism's code path (two width shards in two threads with a summing all-reduce), and
the whole HopeAttention model forward and backward.
fp32: the scan and the reference, each in fp32, against the float64 reference: the scan's errors
stay within FP32_TOL = 1e-5 relative to the largest entry (raw_step: relative to max(1, |value|));
measured <= 3e-7, the reference's own fp32 errors <= 2e-7 (at 127 updates of one group, 7e-7 and
5e-7; raw_step's gradient, a sum of terms that partly cancel, 3e-6 and 4e-6 of its value).
"""
from __future__ import annotations

import math
import threading

import pytest
import torch
import torch.nn.functional as F

from megatron_taper.config import load_config
from megatron_taper.models import build_model
from megatron_taper.models.hope_attention import cost as hope_cost
from megatron_taper.models.hope_attention.model import ContinuumLevel
from megatron_taper.models.hope_attention.online import online_scan
from tests.helpers.hope_reference import chunked_reference_level

TOL64, FP32_TOL = 1e-10, 1e-5
D, W = 8, 12


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


def _case(bsz: int, seq: int, seed: int = 0, dtype=torch.float64, batched: bool = False):
    g = torch.Generator().manual_seed(seed)
    lead = (bsz,) if batched else ()
    w1, w3 = (torch.randn(*lead, W, D, generator=g, dtype=dtype) * 0.3 for _ in range(2))
    w2 = torch.randn(*lead, D, W, generator=g, dtype=dtype) * 0.2
    raw = torch.tensor([math.log(math.expm1(0.7))], dtype=dtype)
    n = F.rms_norm(torch.randn(bsz, seq, D, generator=g, dtype=dtype), (D,))
    return [t.requires_grad_() for t in (w1, w3, w2, raw, n)]


def _grads(outputs, inputs, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype)).sum() for o in outputs)
    return torch.autograd.grad(loss, inputs)


def _scan(w1, w3, w2, raw, n, period, send_end=False, sum_partial=None):
    w13 = torch.cat((w1, w3), dim=-2)
    out = online_scan(n, w13, w2, F.softplus(raw), period, sum_partial, send_end)
    return out if send_end else (out,)


def _reference(w1, w3, w2, raw, n, period, send_end=False):
    batched = w1.dim() == 3
    out = chunked_reference_level(w1, w3, w2, raw, n, period, w13=torch.cat((w1, w3), 1) if batched else None,
                                  w2_start=w2 if batched else None, end_update=send_end)
    return out if send_end else (out,)


CASES = {  # seq, period, group tokens, send_end, batched start weights
    "multiple": (24, 4, 8, False, False), "not_multiple": (23, 4, 8, False, False),
    "one_group": (23, 4, 1024, False, False), "chunk_per_group": (17, 3, 1, False, False),
    "token_chunks": (9, 1, 4, False, False), "long_chunks": (20, 7, 14, False, False),
    "two_chunks": (9, 5, 1024, False, False), "end_update": (24, 4, 8, True, False),
    "received_weights": (23, 4, 8, False, True), "received_and_end": (16, 4, 8, True, True),
}


@pytest.mark.parametrize("case", CASES)
def test_scan_matches_the_chunked_definition_float64(case, monkeypatch):
    seq, period, group, send_end, batched = CASES[case]
    monkeypatch.setattr(hope_cost, "GROUP_TOKENS", group)
    inputs = _case(2, seq, batched=batched)
    got, ref = _scan(*inputs, period, send_end), _reference(*inputs, period, send_end)
    errors = {f"out{i}": _relative(a, b) for i, (a, b) in enumerate(zip(got, ref))}
    names = ("w1", "w3", "w2", "raw_step", "input")
    errors.update(zip(names, map(_relative, _grads(got, inputs), _grads(ref, inputs))))
    print(case, ", ".join(f"{k}={v:.0e}" for k, v in errors.items()))
    assert max(errors.values()) < TOL64, errors


def test_tensor_parallel_path_float64(monkeypatch):
    """Two width shards, one thread each, their per-chunk all-reduces summing over both: the
    shards' outputs are the whole level's, their weight gradients its slices, and the input and
    step gradients (summed over ranks where they enter, as tp's f does) its gradients."""
    monkeypatch.setattr(hope_cost, "GROUP_TOKENS", 8)
    period, send_end = 4, False
    w1, w3, w2, raw, n = _case(2, 23)
    ref = _reference(w1, w3, w2, raw, n, period)
    ref_grads = _grads(ref, [w1, w3, w2, raw, n])
    barrier, slots = threading.Barrier(2), [None, None]

    def all_reduce(rank):
        def reduce(t):
            slots[rank] = t.clone()
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            return t.copy_(total)
        return reduce

    results = [None, None]

    def shard(rank):
        rows = slice(rank * W // 2, (rank + 1) * W // 2)
        params = [w1[rows].detach().requires_grad_(), w3[rows].detach().requires_grad_(),
                  w2[:, rows].detach().requires_grad_(), raw.detach().requires_grad_(), n.detach().requires_grad_()]
        out = _scan(*params, period, send_end, sum_partial=all_reduce(rank))
        results[rank] = (out, _grads(out, params))

    threads = [threading.Thread(target=shard, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (out0, g0), (out1, g1) = results
    assert _relative(out0[0], ref[0]) < TOL64 and _relative(out1[0], ref[0]) < TOL64
    half = W // 2
    for got, ref_grad in ((torch.cat((g0[0], g1[0])), ref_grads[0]), (torch.cat((g0[1], g1[1])), ref_grads[1]),
                          (torch.cat((g0[2], g1[2]), 1), ref_grads[2]), (g0[3] + g1[3], ref_grads[3]),
                          (g0[4] + g1[4], ref_grads[4])):
        assert _relative(got, ref_grad) < TOL64
    assert g0[0].shape[0] == half


def test_fp32_against_float64():
    period = 4
    inputs64 = _case(3, 30, seed=2)
    ref64 = _reference(*inputs64, period)
    grads64 = _grads(ref64, inputs64)
    inputs32 = [t.detach().float().requires_grad_() for t in inputs64]
    errors = {}
    for name, fn in (("scan", _scan), ("reference", _reference)):
        out = fn(*inputs32, period)
        grads = _grads(out, inputs32)
        errors[name] = [_relative(out[0].double(), ref64[0])] + [
            ((a.double() - b).abs().max() / (b.abs().max().clamp(min=1) if i == 3 else b.abs().max())).item()
            for i, (a, b) in enumerate(zip(grads, grads64))]
    print({k: [f"{e:.0e}" for e in v] for k, v in errors.items()})
    assert max(errors["scan"]) < FP32_TOL, errors


def _model_config(chunk: int, growth: int):
    return load_config(None, ["model.arch=hope_attention", "model.n_layers=2", "model.d_model=16",
                              "model.n_heads=2", "model.mlp_width=32", "model.vocab_size=64", "model.seq_len=30",
                              "model.taper.multiple=8", f"model.hope.chunk_size={chunk}",
                              f"model.hope.chunk_growth={growth}"]).model


def _reference_online(self, n, weights):
    return chunked_reference_level(self.w1, self.w3, self.w2, self.raw_step, n, self.period)


@pytest.mark.parametrize("group", [6, 1024])
@pytest.mark.parametrize("chunks", [(3, 3), (4, 2)], ids=lambda c: f"C{c[0]}x{c[1]}")
def test_model_forward_backward_matches_the_definition(chunks, group, monkeypatch):
    """HopeAttention over 30 tokens (levels of 3 and 9 or 4 and 8 tokens per chunk) in float64 with
    its levels' scans, and with ContinuumLevel.online replaced by the chunked definition."""
    monkeypatch.setattr(hope_cost, "GROUP_TOKENS", group)
    model = build_model(_model_config(*chunks)).double()
    model.init_weights(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".raw_step"):
                p.fill_(math.log(math.expm1(1.5)))  # large enough steps that the updates matter
    tokens = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(0))
    runs = []
    for online in (None, _reference_online):
        if online is not None:
            monkeypatch.setattr(ContinuumLevel, "online", online)
        model.zero_grad()
        logits = model(tokens)
        logits.logsumexp(-1).mean().backward()
        runs.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (logits, grads), (ref_logits, ref_grads) = runs
    assert _relative(logits, ref_logits) < TOL64
    for name in ref_grads:
        scale = ref_grads[name].abs().max().clamp(min=1e-30 if not name.endswith("raw_step") else 1)
        assert ((grads[name] - ref_grads[name]).abs().max() / scale).item() < TOL64, name
    assert any(ref_grads[n].abs().max() > 0 for n in ref_grads if n.endswith("cms.1.raw_step"))
