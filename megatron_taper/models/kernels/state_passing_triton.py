"""Triton kernels for the states a chunked linear recurrence passes between chunks (CUDA, or CPU
under TRITON_INTERPRET=1).

    S_0 = initial,   S_{n+1} = exp(g_n) S_n + U_n,   n = 0 .. N-1

One program per (batch x head, E block, F block) loops over the chunks with its [BE, BF] block of
the state in registers: O(N E F) work and one launch for the forward, one for the backward. The
state is accumulated in float32 (float64 for float64 inputs) whatever the input dtype; every S_n is
stored in the input dtype. The backward runs the loop in reverse with dS in registers:
    dS_N = dOut_N,   dS_n = dOut_n + exp(g_n) dS_{n+1},   dU_n = dS_{n+1},   d initial = dS_0,
    d g_n = exp(g_n) <dS_{n+1}, S_n>   (from the stored states)
and writes the E/F blocks' partial sums of d g_n, which torch reduces (deterministic, no atomics).

This module imports triton at the top: state_passing.py imports it only when the Triton path is
chosen. TRITON_INTERPRET is read by triton when the kernels below are decorated, i.e. when this
module is first imported. Block sizes are fixed (no autotuning, so the interpreter runs as is).
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

MAX_BLOCK = 64


@triton.jit
def _states_fwd_kernel(u_ptr, g_ptr, s0_ptr, out_ptr, N, E: tl.constexpr, F: tl.constexpr,
                       BE: tl.constexpr, BF: tl.constexpr, ACC: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BE + tl.arange(0, BE)
    cols = tl.program_id(2) * BF + tl.arange(0, BF)
    mask = (rows[:, None] < E) & (cols[None, :] < F)
    block = rows[:, None] * F + cols[None, :]  # [BE, BF] offsets inside one [E, F] state
    # u [BH, N, E, F], g [BH, N], s0 [BH, E, F], out [BH, N+1, E, F], all contiguous
    state = tl.load(s0_ptr + bh * (E * F) + block, mask=mask, other=0.0).to(ACC)
    tl.store(out_ptr + bh * (N + 1) * (E * F) + block, state.to(out_ptr.dtype.element_ty), mask=mask)
    for n in range(N):
        chunk = bh * N + n  # int64
        decay = tl.exp(tl.load(g_ptr + chunk).to(ACC))
        update = tl.load(u_ptr + chunk * (E * F) + block, mask=mask, other=0.0).to(ACC)
        state = decay * state + update
        tl.store(out_ptr + (chunk + bh + 1) * (E * F) + block, state.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _states_bwd_kernel(dout_ptr, g_ptr, s_ptr, du_ptr, ds0_ptr, dg_ptr, N, E: tl.constexpr, F: tl.constexpr,
                       BE: tl.constexpr, BF: tl.constexpr, ACC: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BE + tl.arange(0, BE)
    cols = tl.program_id(2) * BF + tl.arange(0, BF)
    mask = (rows[:, None] < E) & (cols[None, :] < F)
    block = rows[:, None] * F + cols[None, :]
    n_blocks = tl.num_programs(1) * tl.num_programs(2)
    block_id = tl.program_id(1) * tl.num_programs(2) + tl.program_id(2)
    # dout, s [BH, N+1, E, F]; du [BH, N, E, F]; ds0 [BH, E, F]; dg partial sums [BH, N, n_blocks] in ACC
    grad = tl.load(dout_ptr + (bh * (N + 1) + N) * (E * F) + block, mask=mask, other=0.0).to(ACC)  # dS_N
    for i in range(N):
        n = N - 1 - i
        chunk = bh * N + n  # int64; the state S_n sits at row chunk + bh of [BH * (N+1)]
        decay = tl.exp(tl.load(g_ptr + chunk).to(ACC))
        tl.store(du_ptr + chunk * (E * F) + block, grad.to(du_ptr.dtype.element_ty), mask=mask)
        state = tl.load(s_ptr + (chunk + bh) * (E * F) + block, mask=mask, other=0.0).to(ACC)
        tl.store(dg_ptr + (chunk * n_blocks + block_id), decay * tl.sum(tl.sum(grad * state, axis=1), axis=0))
        grad = decay * grad + tl.load(dout_ptr + (chunk + bh) * (E * F) + block, mask=mask, other=0.0).to(ACC)
    tl.store(ds0_ptr + bh * (E * F) + block, grad.to(ds0_ptr.dtype.element_ty), mask=mask)


def _blocks(e: int, f: int) -> tuple[int, int]:
    return min(MAX_BLOCK, triton.next_power_of_2(e)), min(MAX_BLOCK, triton.next_power_of_2(f))


def _on_device(t: torch.Tensor):
    """Launch on the tensors' GPU (triton launches on the current CUDA device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


class _ChunkStates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, updates: torch.Tensor, log_decays: torch.Tensor, initial: torch.Tensor) -> torch.Tensor:
        b, h, n, e, f = updates.shape
        u = updates.reshape(b * h, n, e, f).contiguous()
        g = log_decays.reshape(b * h, n).contiguous()
        s0 = initial.reshape(b * h, e, f).contiguous()
        out = torch.empty(b, h, n + 1, e, f, dtype=updates.dtype, device=updates.device)
        be, bf = _blocks(e, f)
        with _on_device(u):
            _states_fwd_kernel[(b * h, triton.cdiv(e, be), triton.cdiv(f, bf))](
                u, g, s0, out, n, E=e, F=f, BE=be, BF=bf, ACC=_acc(updates.dtype))
        ctx.save_for_backward(g, out)
        return out

    @staticmethod
    def backward(ctx, d_states: torch.Tensor):
        g, states = ctx.saved_tensors
        b, h, n1, e, f = states.shape
        n = n1 - 1
        dout = d_states.reshape(b * h, n + 1, e, f).contiguous()
        be, bf = _blocks(e, f)
        grid = (b * h, triton.cdiv(e, be), triton.cdiv(f, bf))
        acc = torch.float64 if states.dtype == torch.float64 else torch.float32
        du = torch.empty(b * h, n, e, f, dtype=states.dtype, device=states.device)
        ds0 = torch.empty(b * h, e, f, dtype=states.dtype, device=states.device)
        dg = torch.empty(b * h, n, grid[1] * grid[2], dtype=acc, device=states.device)
        with _on_device(dout):
            _states_bwd_kernel[grid](dout, g, states, du, ds0, dg, n, E=e, F=f, BE=be, BF=bf, ACC=_acc(acc))
        return du.view(b, h, n, e, f), dg.sum(-1).view(b, h, n).to(g.dtype), ds0.view(b, h, e, f)


def chunk_states_triton(updates: torch.Tensor, log_decays: torch.Tensor, initial: torch.Tensor) -> torch.Tensor:
    """updates [B, H, N, E, F], log_decays [B, H, N] (or broadcastable to it), initial [B, H, E, F] ->
    [B, H, N+1, E, F], as state_passing.chunk_states, with the Triton kernels (differentiable)."""
    b, h, n, e, f = updates.shape
    dtype = torch.promote_types(updates.dtype, initial.dtype)
    return _ChunkStates.apply(updates.to(dtype), log_decays.expand(b, h, n), initial.to(dtype))
