"""The states a chunked linear recurrence passes between chunks (models/kernels/state_passing.py):
the loop-free torch form and the Triton kernels against a plain Python loop.

Tolerances: the torch form in float64 within 1e-12 abs of the loop on states and on the gradients
of updates, log decays and initial state (measured <= 2e-14), also at N=64 with g ~ -5, where
decays reach exp(-320). The Triton kernels run on CPU under TRITON_INTERPRET=1 in a subprocess
(triton reads the flag when the kernels are decorated, i.e. at import): float64 within 1e-12 abs
of the loop (measured <= 2e-14); float32 within 1e-5 x max(1, largest entry) of the torch form
(both accumulate in float32, in different orders: eps 1.2e-7 times up to ~E*F terms for d g;
measured <= 2e-7 x largest entry); bfloat16 inputs within 2^-7 (states, d updates, d initial:
one bf16 rounding of a float32 accumulation, which the interpreter truncates: up to one ulp) and
1e-2 (d g, a sum of products with bf16 states) of the float64 loop, relative to the largest entry
(measured 4e-3, 6e-3, 4e-3 and 3e-3). A second subprocess compiles both kernels for sm_90 (no GPU
needed) and checks that every scalar pointer offset is int64.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_taper.models.kernels.state_passing import (
    KERNELS_ENV,
    chunk_states,
    chunk_states_torch,
    kernel_choice,
    triton_importable,
)

REPO = Path(__file__).resolve().parents[2]
NEEDS_TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (launch/install.sh installs triton==3.9.0)")
SHAPES = [(2, 3, 1, 16, 16), (2, 3, 5, 12, 16), (1, 2, 5, 16, 12), (1, 1, 3, 70, 12)]  # B, H, N, E, F


def loop_states(updates: torch.Tensor, log_decays: torch.Tensor, initial: torch.Tensor) -> torch.Tensor:
    states = [initial]
    for n in range(updates.shape[2]):
        states.append(log_decays[:, :, n, None, None].exp() * states[-1] + updates[:, :, n])
    return torch.stack(states, dim=2)


def inputs(b: int, h: int, n: int, e: int, f: int, dtype: torch.dtype = torch.float64, g_low: float = -2.0,
           g_high: float = 0.0, g_batch: int | None = None, seed: int = 0) -> list[torch.Tensor]:
    """updates, log decays in [g_low, g_high], initial state, and the loss weights w of sum(w * states)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(b, h, n, e, f, generator=gen, dtype=torch.float64)
    g = torch.rand(b if g_batch is None else g_batch, h, n, generator=gen, dtype=torch.float64)
    g = g_low + (g_high - g_low) * g
    s0 = torch.randn(b, h, e, f, generator=gen, dtype=torch.float64)
    w = torch.randn(b, h, n + 1, e, f, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (u, g, s0, w)]


def compare(fn, ref, u, g, s0, w, ref_dtype: torch.dtype | None = None) -> list[list[float]]:
    """[max |fn - ref|, max |ref|] for the states and the gradients of sum(w * states) w.r.t. the
    updates, log decays and initial state; ref runs on the inputs cast to ref_dtype (default: as given)."""
    results = []
    for f, dtype in ((fn, None), (ref, ref_dtype)):
        args = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (u, g, s0)]
        states = f(*args)
        grads = torch.autograd.grad((states * w.to(states.dtype)).sum(), args)
        results.append([t.detach().double() for t in (states, *grads)])
    return [[(a - b).abs().max().item(), b.abs().max().item()] for a, b in zip(*results)]


@pytest.mark.parametrize("shape", SHAPES)
def test_torch_form_matches_loop(shape):
    for diff, _ in compare(chunk_states_torch, loop_states, *inputs(*shape)):
        assert diff < 1e-12


def test_torch_form_strongly_decaying_long_sequence():
    u, g, s0, w = inputs(2, 2, 64, 8, 4, g_low=-5.5, g_high=-4.5)
    for diff, _ in compare(chunk_states_torch, loop_states, u, g, s0, w):
        assert diff < 1e-12
    for dtype in (torch.float32, torch.float64):  # the whole decay underflows to 0, no inf or nan
        states = chunk_states_torch(u.to(dtype), (g * 10).to(dtype), s0.to(dtype))
        assert torch.isfinite(states).all()
        torch.testing.assert_close(states[:, :, 1:], u.to(dtype), atol=1e-12, rtol=0)


def test_kernel_choice(monkeypatch):
    x = torch.zeros(1)
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert kernel_choice(x) == "torch"  # auto on CPU
    assert triton_importable() == (importlib.util.find_spec("triton") is not None)  # auto's test on CUDA
    assert kernel_choice(x, "torch") == "torch"
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        kernel_choice(x, "triton")
    with pytest.raises(ValueError, match="kernel='cuda'"):
        kernel_choice(x, "cuda")
    monkeypatch.setenv(KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match=f"{KERNELS_ENV}='fast'"):
        chunk_states(*inputs(1, 1, 2, 2, 2)[:3])
    monkeypatch.setenv(KERNELS_ENV, "triton")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        chunk_states(*inputs(1, 1, 2, 2, 2)[:3])
    assert kernel_choice(x, "auto") == "torch"  # the argument wins over the environment
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernel_choice(x) == "triton"
    monkeypatch.setenv(KERNELS_ENV, "torch")
    u, g, s0, _ = inputs(1, 2, 3, 4, 5)
    assert torch.equal(chunk_states(u, g, s0), chunk_states_torch(u, g, s0))


INTERPRETED = """
import json, time
import torch
from megatron_taper.models.kernels.state_passing import chunk_states, chunk_states_torch
from tests.models.test_state_passing import SHAPES, compare, inputs, loop_states
triton = lambda u, g, s0: chunk_states(u, g, s0, kernel="triton")
start, out = time.time(), {}
for shape in SHAPES:
    out[f"float64 {shape}"] = compare(triton, loop_states, *inputs(*shape))
    out[f"float32 {shape}"] = compare(triton, chunk_states_torch, *inputs(*shape, dtype=torch.float32))
out["float64 decay -5, N=64"] = compare(triton, loop_states, *inputs(2, 2, 64, 8, 4, g_low=-5.5, g_high=-4.5))
out["float64 g broadcast over B"] = compare(triton, loop_states, *inputs(3, 2, 4, 12, 12, g_batch=1))
u, g, s0, w = inputs(2, 2, 4, 12, 16)
out["float64 non-contiguous"] = compare(triton, loop_states, u.transpose(-1, -2).contiguous().transpose(-1, -2),
                                        g, s0.transpose(-1, -2).contiguous().transpose(-1, -2), w)
out["bfloat16"] = compare(triton, loop_states, *inputs(2, 2, 5, 16, 12, dtype=torch.bfloat16), torch.float64)
print(json.dumps({"seconds": time.time() - start, "cases": out}))
"""


def run_python(code: str, env: dict[str, str]) -> str:
    full = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", KERNELS_ENV)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**full, "OMP_NUM_THREADS": "1", **env},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
                                  f"stderr:\n{proc.stderr[-5000:]}")
    return proc.stdout.strip().splitlines()[-1]


@NEEDS_TRITON
def test_triton_kernels_interpreted_match_loop_and_torch_form():
    cases = json.loads(run_python(INTERPRETED, {"TRITON_INTERPRET": "1"}))["cases"]
    for name, diffs in cases.items():
        for what, (diff, scale) in zip(("states", "d updates", "d log_decays", "d initial"), diffs):
            if name.startswith("float64"):
                limit = 1e-12
            elif name.startswith("float32"):
                limit = 1e-5 * max(scale, 1.0)
            else:
                limit = (1e-2 if what == "d log_decays" else 2 ** -7) * scale
            assert diff <= limit, f"{name} {what}: {diff} > {limit}"


COMPILE = """
import json
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megatron_taper.models.kernels import state_passing_triton as k
kinds = {"u": "*bf16", "g": "*fp32", "s0": "*bf16", "out": "*bf16", "dout": "*fp64", "s": "*fp64", "du": "*fp64",
         "ds0": "*fp64", "dg": "*fp64"}
out = {}
for fn, acc in ((k._states_fwd_kernel, tl.float32), (k._states_bwd_kernel, tl.float64)):
    consts = {"E": 96, "F": 40, "BE": 64, "BF": 64, "ACC": acc}
    names = fn.arg_names
    sig = {a: "constexpr" if a in consts else "i32" if a == "N" else kinds[a.removesuffix("_ptr")] for a in names}
    if acc == tl.float64:
        sig["g_ptr"] = "*fp64"
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
    out[fn.__name__] = {"cubin": len(compiled.asm["cubin"]), "ttir": compiled.asm["ttir"]}
print(json.dumps(out))
"""


@NEEDS_TRITON
def test_triton_kernels_compile_for_cuda_with_int64_offsets(tmp_path):
    compiled = json.loads(run_python(COMPILE, {"TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"}))
    for name, result in compiled.items():
        assert result["cubin"] > 0, name
        scalar_offsets = re.findall(r"tt\.addptr [^:\n]*: !tt\.ptr<\w+>, (i\d+)", result["ttir"])
        assert scalar_offsets and set(scalar_offsets) == {"i64"}, (name, scalar_offsets)
