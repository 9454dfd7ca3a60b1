"""The Triton kernels of the Titans / deep-memory write loop (models/kernels/memory_write_triton.py)
against the torch loops (models/titans/neural_memory.py write_loop_torch, reverse_loop), on CPU under
TRITON_INTERPRET=1.

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when the module is first imported,
so the comparisons run in a subprocess with TRITON_INTERPRET=1 (as tests/models/test_state_passing.py
does; the kernels have no autotuning to skip). Sizes: E = 16, hidden 32, chunks of C = 16 over 40
tokens (3 chunks, the last of 8 tokens), B*H = 4, depths 1 and 2, every chunk writing and the
trailing partial chunk read only (`whole_chunks`); more cases at depth 2 with a hidden width of 80
(two tiles of 64, the second masked): chunks of 7 tokens (padded to 16), and 5 tokens with
`whole_chunks` (one partial chunk: nothing written); two with bfloat16 inputs.

Compared: every output WriteLoop.forward returns and every tensor its backward keeps (the forward
kernel against write_loop_torch on the same terms), and the reads, final state and gradients of
every parameter, feature and starting-state leaf through NeuralMemory.scan_features with
MEGATRON_TAPER_KERNELS=triton (both kernels; the calls are counted) against =torch. Tolerances,
relative to each tensor's largest entry: float64 within 1e-12 (the kernels sum in another order:
measured <= 3.3e-15); float32 within 1e-5 of the float32 torch loops (float32 rounding, eps
1.2e-7, over sums of up to ~C + E terms through 3 chunks of a recurrence whose gradients reach
~1e4: measured <= 1.0e-6), and within 2e-4 of the float64 loops, as tests/models/test_titans_scan.py
asks of the torch loops in float32 (measured 6.2e-6 with the kernels, 6.6e-6 with the torch
loops). Bfloat16 inputs (the forward only): within 5e-2 of the float64 loop (the state passed on
between chunks is rounded to bf16, and the interpreter truncates: measured <= 2.2e-2; the torch
loop in bf16 2.7e-2). Under CPU bf16 autocast (float32 features and state, depths 1 and 2) the scan
with the kernels and with the torch loops each within 5e-2 of the float32 scan without autocast,
as test_titans_scan.py asks of the torch loops (measured 0.9e-2 and 1.9e-2 with the kernels, 1.3e-2
and 3.0e-2 with the torch loops), the state staying float32. A second subprocess compiles both
kernels for sm_90 (no GPU needed) and checks that every scalar pointer offset is int64. Never run
on a GPU yet.
"""
from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch

from megatron_taper.models.kernels.state_passing import KERNELS_ENV
from tests.models.test_state_passing import run_python
from tests.models.test_titans_scan import case, memory

NEEDS_TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (launch/install.sh installs triton==3.9.0)")

INTERPRETED = """
import json, os, time
import torch
from megatron_taper.config import load_config
from megatron_taper.models import build_model
from megatron_taper.models.titans import neural_memory as nm
from megatron_taper.models.kernels import memory_write_triton as mwt
from megatron_taper.models.kernels.state_passing import KERNELS_ENV
from tests.models.test_titans_scan import BASE, case, memory, outputs_and_grads

SEQ, CHUNK = 40, 16  # 3 chunks, the last of 8 tokens


def diffs(got, ref):
    assert [a is None for a in got] == [b is None for b in ref]
    assert [a.shape for a in got if a is not None] == [b.shape for b in ref if b is not None]
    return [[(a.double() - b.double()).abs().max().item(), b.abs().max().item()] for a, b in zip(got, ref)
            if a is not None]


def loop_inputs(mem, feats, state, chunk, dtype):
    b, h = feats[0].shape[:2]
    feats = tuple(f.detach().to(dtype) for f in feats)
    init = [w.detach().to(dtype).expand(b, -1, -1, -1).reshape(b * h, *w.shape[1:]) for w in mem.mem_w]
    loop, _ = nm.chunk_terms(feats, init[0], chunk, len(init) > 1)
    w, s = ([t.detach().to(dtype).reshape(b * h, *t.shape[2:]) for t in ts] for ts in state)
    return init, w, s, loop


def forward(mem, feats, state, chunk, last, dtype=None):  # the kernel on the terms in dtype, the torch loop on them
    n = len(mem.mem_w)
    with torch.no_grad():
        got = kernel(n, last, *loop_inputs(mem, feats, state, chunk, dtype or feats[0].dtype))
        ref = nm.write_loop_torch(n, last, True, *loop_inputs(mem, feats, state, chunk, feats[0].dtype))
    return diffs([t for ts in got for t in ts], [t for ts in ref for t in ts])


calls = {"forward": [], "backward": []}  # WriteLoop's kernel calls: their memory depths
kernel, backward = mwt.write_loop_triton, mwt.write_loop_backward_triton
mwt.write_loop_triton = lambda *a: calls["forward"].append(a[0]) or kernel(*a)
mwt.write_loop_backward_triton = lambda *a: calls["backward"].append(a[0]) or backward(*a)
start, out = time.time(), {}
for depth in (1, 2):
    for whole in (False, True):
        mem64 = memory(depth, torch.float64)
        feats64, state64 = case(mem64, SEQ, "carried")
        for dtype in (torch.float64, torch.float32):
            mem = memory(depth, dtype)
            feats = tuple(f.detach().to(dtype).requires_grad_() for f in feats64)
            state = tuple([t.detach().to(dtype).requires_grad_() for t in ts] for ts in state64)
            name = f"depth {depth} {str(dtype)[6:]} whole_chunks={whole}"
            out[f"forward {name}"] = forward(mem, feats, state, CHUNK, 2 if whole else 3)
            results = {}
            for choice in ("triton", "torch"):
                os.environ[KERNELS_ENV] = choice
                outs, grads = outputs_and_grads(nm.NeuralMemory.scan_features, mem, feats, state,
                                                state[0] + state[1], chunk_size=CHUNK, whole_chunks=whole)
                results[choice] = outs + list(grads)
            out[f"scan {name}"] = diffs(results["triton"], results["torch"])
            if dtype == torch.float32:
                os.environ[KERNELS_ENV] = "torch"
                outs, grads = outputs_and_grads(nm.NeuralMemory.scan_features, mem64, feats64, state64,
                                                state64[0] + state64[1], chunk_size=CHUNK, whole_chunks=whole)
                out[f"scan {name} against float64"] = diffs(results["triton"], outs + list(grads))
cfg = load_config(None, BASE + ["model.arch=titans", "model.titans.memory_expansion=5"]).model
model = build_model(cfg)
model.init_weights(0)
mem = model.layers["0"].memory.double()
feats, state = case(mem, 30, "carried")
out["forward depth 2 float64 hidden 80, chunk 7"] = forward(mem, feats, state, 7, 5)
for seq, chunk, whole in ((30, 7, False), (5, 16, True)):  # the second: one partial chunk, nothing written
    feats, state = case(mem, seq, "carried")
    results = []
    for choice in ("triton", "torch"):
        os.environ[KERNELS_ENV] = choice
        outs, grads = outputs_and_grads(nm.NeuralMemory.scan_features, mem, feats, state, state[0] + state[1],
                                        chunk_size=chunk, whole_chunks=whole)
        results.append(outs + list(grads))
    out[f"scan depth 2 float64 hidden 80, {seq} tokens, chunk {chunk}, whole_chunks={whole}"] = diffs(*results)
for depth in (1, 2):
    mem64 = memory(depth, torch.float64)
    out[f"forward depth {depth} bfloat16 against float64"] = forward(mem64, *case(mem64, SEQ, "carried"), CHUNK, 3,
                                                                     torch.bfloat16)
for depth in (1, 2):  # under bf16 autocast, float32 features and state, against the float32 scan without it
    mem = memory(depth, torch.float32)
    feats, state = case(mem, SEQ, "carried")
    os.environ[KERNELS_ENV] = "torch"
    outs, grads = outputs_and_grads(nm.NeuralMemory.scan_features, mem, feats, state, state[0] + state[1],
                                    chunk_size=CHUNK)
    for choice in ("triton", "torch"):
        os.environ[KERNELS_ENV] = choice
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, got_grads = outputs_and_grads(nm.NeuralMemory.scan_features, mem, feats, state,
                                               state[0] + state[1], chunk_size=CHUNK)
        assert {t.dtype for t in got[1:]} == {torch.float32}, choice  # the state keeps its dtype
        out[f"autocast depth {depth} {choice} against float32"] = diffs(got + list(got_grads), outs + list(grads))
print(json.dumps({"seconds": time.time() - start, "kernel_calls": calls, "cases": out}))
"""


@NEEDS_TRITON
def test_write_kernel_interpreted_matches_the_torch_loop():
    result = json.loads(run_python(INTERPRETED, {"TRITON_INTERPRET": "1"}))
    expected = [1] * 4 + [2] * 4 + [2, 2, 1, 2]  # every scan with =triton took the kernels, both ways
    assert result["kernel_calls"] == {"forward": expected, "backward": expected}
    cases = result["cases"]
    assert len(cases) == 29
    for name, diffs in cases.items():
        limit = (5e-2 if "bfloat16" in name or "autocast" in name else 2e-4 if "against" in name
                 else 1e-12 if "float64" in name else 1e-5)
        for i, (diff, scale) in enumerate(diffs):
            assert diff <= limit * scale, f"{name}, tensor {i}: {diff} > {limit} x {scale}"


def test_deeper_memories_keep_the_torch_loop(monkeypatch):
    """With MEGATRON_TAPER_KERNELS=triton on CPU tensors and no interpreter, the kernel choice refuses
    (so a depth-2 scan, which asks it, raises) while a depth-3 scan runs the torch loop without asking."""
    monkeypatch.setenv(KERNELS_ENV, "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for depth in (2, 3):
        mem = memory(depth)
        features, state = case(mem, 12, "initial")
        if depth == 3:
            reads, _ = mem.scan_features(features, state, 6)
            assert torch.isfinite(reads).all()
        else:
            with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
                mem.scan_features(features, state, 6)


COMPILE = """
import json
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megatron_taper.models.kernels.memory_write_triton import _write_bwd_kernel, _write_fwd_kernel
out = {}
for depth, dtype, acc in ((1, "fp32", tl.float32), (2, "bf16", tl.float32), (2, "fp64", tl.float64)):
    consts = {"E": 16, "HID": 48 * depth, "C": 12, "EP": 16, "CP": 16, "BT": 32, "DEPTH": depth, "ACC": acc}
    for fn in (_write_fwd_kernel, _write_bwd_kernel):
        sig = {a: "constexpr" if a in consts else "i32" if a in ("N", "LAST") else f"*{dtype}" for a in fn.arg_names}
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                                  target=GPUTarget("cuda", 90, 32))
        out[f"{fn.__name__} depth {depth} {dtype}"] = {"cubin": len(compiled.asm["cubin"]),
                                                       "ttir": compiled.asm["ttir"]}
print(json.dumps(out))
"""


@NEEDS_TRITON
def test_write_kernel_compiles_for_cuda_with_int64_offsets(tmp_path):
    compiled = json.loads(run_python(COMPILE, {"TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"}))
    assert len(compiled) == 6
    for name, result in compiled.items():
        assert result["cubin"] > 0, name
        scalar_offsets = re.findall(r"tt\.addptr [^:\n]*: !tt\.ptr<\w+>, (i\d+)", result["ttir"])
        assert scalar_offsets and set(scalar_offsets) == {"i64"}, (name, scalar_offsets)


def test_operator_count_with_the_write_kernel():
    """cost/op_count.py with `write_kernel`: a Titans 125M block's forward and backward each drop by
    the write loop's ~27-28 operators per chunk of 64 (measured at 256 -> 512 tokens: forward
    33.4 -> 6.4, backward 34.1 -> 6.1; what is left is the block's other per-chunk operators)."""
    from megatron_taper.config import load_config
    from megatron_taper.cost.op_count import dispatched_ops, narrowed
    from tests.helpers.runner import REPO

    cfg = load_config(str(REPO / "configs/titans_125m_taper.yaml"), []).model
    per_chunk = {}
    for kernel in (False, True):
        (f1, all1), (f2, all2) = (dispatched_ops(narrowed(cfg, 1, seq), kernel) for seq in (256, 512))
        per_chunk[kernel] = ((f2 - f1) / 4, (all2 - f2 - all1 + f1) / 4)  # forward, backward per chunk
    assert per_chunk[True][0] <= per_chunk[False][0] - 25
    assert per_chunk[True][1] <= per_chunk[False][1] - 25
