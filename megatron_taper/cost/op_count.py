"""Operators a training step dispatches: the step-time model's per-op cost (cost/step_time.py).

Eager PyTorch pays a host-side cost per operator (Python, the dispatcher, a kernel launch) whatever
its size. For the chunked recurrent families that cost, not their FLOPs, sets the step: measured on
an H200 (docs/gpu.md), Titans and Hope at 125M run 480k-675k operators per step at 15-18 us each,
190-240x longer than their FLOPs at the profile's MFU.

`count_ops` counts the ATen operators of one forward and one backward (TorchDispatchMode) of the
model at its structure but narrowed widths (d_model 64, 4 heads, MLP width 128, vocabulary 256), on
the CPU, at its sequence length up to CAP tokens and along the line of two counts beyond (see
count_ops): the count depends on the structure (blocks, chunks of the sequence, memory levels), not
on the widths (a family whose checks refuse those widths is counted at 16 per head of its own
heads, else at its own widths: `narrowed`). A model counts in 0.1-3 s here (3 s: Titans 125M, the
most operators). Two builds, of 1 and of 2 blocks, give the ops of one block and of the ends
(embedding, head, loss and any state outside the blocks; the tree is a single block, all of it
counted as its block). Left out: the optimizer's few foreach operators per step, bf16 autocast's
casts, float8's scaling operators, the parallel wrappers' own operators (FSDP's copies, tp's
collectives: each collective is costed by collective_latency_us).

The trace runs the torch forms: the Triton kernels (MEGATRON_TAPER_KERNELS,
models/kernels/state_passing.py; the default until a GPU has checked them is the torch form too)
are not taken on the CPU. With `write_kernel`, the Titans /
deep-memory write loop's chunk loops are counted as the kernels that replace them on CUDA
(models/kernels/memory_write_triton.py, depths 1 and 2): the operators traced inside
titans/neural_memory.write_loop_torch (forward) and .reverse_loop (backward) are left out and
each of their calls counts one launch (the kernel wrappers' allocations and copies are left out too;
the batched torch work before and after the backward's loop is counted as traced). The default
counts what the CPU trace runs, the torch loops.

Compiled blocks (train.compile) launch fewer kernels than eager dispatches operators: inductor
fuses the elementwise work into a few kernels around the matmuls and attention. `compiled_launches`
gives, per family measured, a compiled block's launches per eager operator of it, forward and
forward + backward (cost/speedups.json, measured on the CPU by benchmarks/compiled_launches.py with
a real compile: the Transformer's 225 eager operators per block are 44 launches under bf16
autocast, 0.196); the planner scales the blocks' counts by them (the ends stay eager). A family
without a measurement (the memory families, MoE blocks) keeps its eager count under compile.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from megatron_taper.config import ModelConfig
from megatron_taper.cost.float8 import read_speedups
from megatron_taper.validation import ConfigError

CAP = 1024  # tokens counted at most (attention's arithmetic at the narrow width grows with their square)
NARROW = {"d_model": 64, "n_heads": 4, "n_kv_heads": 0, "mlp_width": 128, "vocab_size": 256}


@dataclass(frozen=True)
class OpCounts:
    """ATen operators per micro-batch (independent of its size)."""

    block_forward: float  # one block's forward (what a recomputed block runs again)
    block: float  # one block's forward and backward
    ends: float  # the embedding, head, loss and state outside the blocks, forward and backward


def compiled_launches(cfg: ModelConfig) -> tuple[float, float]:
    """(forward, forward + backward) launches of one compiled block per eager operator of it
    (speedups.json compiled_launches, module doc); (1, 1) for a family not measured."""
    measured = read_speedups()["compiled_launches"].get(cfg.arch)
    if measured is None or cfg.moe.enabled:
        return 1.0, 1.0
    return float(measured["forward"]), float(measured["block"])


def narrowed(cfg: ModelConfig, n_layers: int, seq_len: int) -> ModelConfig:
    """`cfg` with `n_layers` blocks of `seq_len` tokens (its structure kept) at the first widths its
    family accepts: NARROW's; 16 per head with its own heads; its own (slower to count).
    ConfigError when none is accepted (a block count or length the family refuses)."""
    heads = {"d_model": 16 * cfg.n_heads, "mlp_width": 32 * cfg.n_heads, "vocab_size": 256}
    if cfg.moe.enabled:  # every counted block an MoE one (a dense first layer would leave none in a short stack)
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, first_dense=0, expert_width=0))
    refusal = None
    for widths in (NARROW, heads, {}):
        taper = dataclasses.replace(cfg.taper, multiple=16) if widths else cfg.taper
        narrow = dataclasses.replace(cfg, n_layers=n_layers, seq_len=seq_len, taper=taper, **widths)
        try:
            narrow.validate("model")
            return narrow
        except ConfigError as e:
            refusal = e
    raise refusal


def dispatched_ops(cfg: ModelConfig, write_kernel: bool = False) -> tuple[int, int]:
    """(forward, forward + backward) operators of one micro-batch of one sequence; `write_kernel`:
    the write loop's chunk loops counted as the Triton kernels' launches (module docstring)."""
    import sys

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_taper.models import build_model
    from megatron_taper.models.titans.neural_memory import reverse_loop, write_kernel_handles, write_loop_torch

    loops = (write_loop_torch.__code__, reverse_loop.__code__)

    def kernel_loop():  # the frame of a torch chunk loop a kernel would replace, else None
        frame = sys._getframe(2)
        while frame is not None and frame.f_code not in loops:
            frame = frame.f_back
        return frame if frame is not None and write_kernel_handles(frame.f_locals["n"]) else None

    class Counter(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:  # eager only: no torch._dynamo wrapper (its import is ~2 s of CPU)
            return False

        def __init__(self):
            super().__init__()
            self.n, self.loop = 0, None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            loop = kernel_loop() if write_kernel else None
            if loop is None or loop is not self.loop:  # one per kernel call: its first operator
                self.n += 1
            self.loop = loop  # held, so a later call's frame is a new object
            return func(*args, **(kwargs or {}))

    from unittest import mock

    from megatron_taper.models.kernels.state_passing import KERNELS_ENV

    # the trace runs the torch forms whatever this process selects for its own steps
    with torch.random.fork_rng(devices=[]), mock.patch.dict(os.environ, {KERNELS_ENV: "torch"}):
        torch.manual_seed(0)
        model = build_model(cfg)
        tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))
        counter = Counter()
        with counter:
            out = model(tokens)
            forward = counter.n
            (out if torch.is_tensor(out) else out[0]).float().mean().backward()
    return forward, counter.n


def count_ops(cfg: ModelConfig, seq_len: int | None = None, cap: int = CAP, write_kernel: bool = False) -> OpCounts:
    """Operators per micro-batch of `cfg` at `seq_len` tokens per sequence (default: cfg.seq_len;
    a context-parallel rank's share is seq_len / cp). Beyond `cap` tokens the counts at cap and
    cap / 2 are extended along their line (a chunk loop's operators grow linearly with the tokens;
    attention's do not grow), where the family accepts those lengths; else it counts at seq_len.
    `write_kernel`: the write loop's chunk loops as the Triton kernels (module docstring)."""
    seq = seq_len or cfg.seq_len
    if seq > cap:
        try:
            at_cap, at_half = _counts_at(cfg, cap, write_kernel), _counts_at(cfg, cap // 2, write_kernel)
        except ConfigError:
            return _counts_at(cfg, seq, write_kernel)
        per_half = (seq - cap) / (cap // 2)
        return OpCounts(*(a + (a - b) * per_half for a, b in zip(dataclasses.astuple(at_cap),
                                                                  dataclasses.astuple(at_half))))
    return _counts_at(cfg, seq, write_kernel)


def _counts_at(cfg: ModelConfig, seq: int, write_kernel: bool) -> OpCounts:
    one_forward, one = dispatched_ops(narrowed(cfg, 1, seq), write_kernel)
    try:
        two_forward, two = dispatched_ops(narrowed(cfg, 2, seq), write_kernel)
    except ConfigError:  # a single-block family (the tree)
        return OpCounts(block_forward=one_forward, block=one, ends=0.0)
    return OpCounts(block_forward=two_forward - one_forward, block=two - one, ends=2 * one - two)
