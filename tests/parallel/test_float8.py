"""train.float8 (parallel/float8.py): torchao float8 linears in emulation, against bf16 and across layouts.

Model: 2 blocks, d_model 64, 4 heads, MLP widths tapered from 160 in units of 16 (240, 80), vocab
256, 4 sequences of 64 tokens per step in micro-batches of 2, the same two batches alternating, AdamW lr 3e-3, clipping
at 1.0, bf16 autocast on the CPU; 20 steps.

Tolerance against bf16 (derived): float8 e4m3 keeps 3 mantissa bits, a relative rounding error of
at most u = 2^-4 per matmul operand (bf16: 2^-8), independent from element to element, so a
block's matmul outputs move by about u / sqrt(3) ~ 4% each in a random direction. The first loss
depends on the forward alone: a mean over 256 tokens of per-token changes that are first order in
those perturbations and of random sign, so it moves by about u / sqrt(256) = 4e-3 at most
(measured 1.2e-4): FIRST_ATOL = 4e-3. Afterwards the perturbed gradients (e5m2 output gradients,
u = 2^-3) change AdamW's steps, whose size is set by lr, not by the gradient's scale: the
difference grows with the steps taken; bounded at 20 steps by 1% of the initial loss ln(256) =
5.5: STEP_ATOL = 0.055 (measured 5.6e-3). A float8 path that was not active would differ by 0;
one that broke a matmul (a wrong scale) differs by more than 0.5 from the first step.

fsdp2 dp=2 with float8 (fp32, weights gathered in fp32 and cast after the gather: gloo has no
float8 all-gather) against one process with float8 accumulating the same micro-batches: the
mean of the two ranks' losses against the one-process loss. The dynamic float8 scales are per
tensor and per micro-batch (amax of the micro-batch's activations, of the whole weight), so with
the same micro-batches both round the same values the same way and only fp32 sums differ in
order: the project's fp32 tolerance, FSDP_ATOL = 2e-5 per step over 10 steps (measured 2.4e-7,
one ulp at loss ~4). A float8 rounding that flipped because of those last bits would move a
loss by 1e-4 or more; with fixed data and seeds it either happens on every run or never.
(Compared with one process on the whole 4-sequence batch at once the first loss already differs
by 4e-5: the activations' scale is the amax of another set of sequences.)
"""
import contextlib

import pytest
import torch

from megatron_taper.config import load_config
from megatron_taper.cost.preflight import preflight
from megatron_taper.parallel.context import ParallelContext
from megatron_taper.training.build import build_run
from megatron_taper.validation import ConfigError
from tests.helpers.harness import run_distributed

FIRST_ATOL, STEP_ATOL, FSDP_ATOL = 4e-3, 0.055, 2e-5
MODEL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.mlp_width=160", "model.taper.multiple=16",
         "model.vocab_size=256", "model.seq_len=64", "train.device=cpu", "train.float8_min_dim=16", "train.seed=3",
         "train.lr=3e-3", "train.warmup_steps=0", "train.grad_clip=1.0", "train.micro_batch=2", "train.global_batch=4"]


def _losses(overrides: list[str], steps: int, ctx: ParallelContext | None = None) -> tuple[list[float], int]:
    """Per-step losses of this rank (its share of every 4-sequence batch, in micro-batches of 2
    sequences) and its float8 linears."""
    from torchao.float8.float8_linear import Float8Linear

    torch.set_num_threads(1)
    cfg = load_config(None, MODEL + overrides)
    run = build_run(cfg, ctx)
    pm, rank, dp = run.model, run.ctx.dp_rank, run.ctx.dp
    optimizer = pm.build_optimizer(cfg.train)
    data = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(0))
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if run.bf16 else contextlib.nullcontext
    out = []
    for step in range(steps):
        batch = data[(step % 2) * 4:(step % 2) * 4 + 4]
        rows = batch[rank * 4 // dp:(rank + 1) * 4 // dp]
        micro = [rows[i:i + 2] for i in range(0, len(rows), 2)]  # the same micro-batches at any dp
        out.append(pm.forward_backward(micro, autocast).item())
        pm.optimizer_step(optimizer, cfg.train.grad_clip)
    return out, sum(isinstance(m, Float8Linear) for m in pm.module.modules())


def _one_process() -> ParallelContext:
    return ParallelContext(1, 0, 0, 1, 1, 1, torch.device("cpu"))


def test_float8_emulation_tracks_bf16():
    bf16, plain = _losses(["train.precision=bf16"], 20, _one_process())
    f8, converted = _losses(["train.precision=bf16", "train.float8=true"], 20, _one_process())
    assert plain == 0 and converted == 2 * 7  # wq, wk, wv, wo, w1, w3, w2 of both blocks
    diffs = [abs(a - b) for a, b in zip(f8, bf16)]
    print(f"float8 vs bf16 over 20 steps: first {diffs[0]:.1e}, max {max(diffs):.1e}")
    assert diffs[0] < FIRST_ATOL and max(diffs) < STEP_ATOL, diffs
    assert max(diffs) > 0  # float8 rounding is active
    assert f8[-1] < f8[0] - 1.0  # it trains


def _fsdp_worker():
    return _losses(["train.precision=fp32", "train.float8=true", "parallel.zero=fsdp2"], 10)


@pytest.mark.multiprocess
def test_float8_with_fsdp2_matches_one_process():
    ranks = run_distributed(_fsdp_worker, 2, timeout=180)
    ref, _ = _losses(["train.precision=fp32", "train.float8=true"], 10, _one_process())
    got = [(a + b) / 2 for a, b in zip(ranks[0][0], ranks[1][0])]
    assert ranks[0][1] == 14
    diff = max(abs(a - b) for a, b in zip(got, ref))
    print(f"float8 fsdp2 dp=2 vs one process: max |loss difference| = {diff:.1e}")
    assert diff < FSDP_ATOL, (got, ref)


@pytest.mark.parametrize("overrides,message", [
    (["parallel.tp=2"], "train.float8=true with parallel.tp=2"),
    (["model.taper.multiple=8"], "model.taper.multiple (=8"),
])
def test_float8_refuses_illegal_layouts(overrides, message):
    cfg = load_config(None, MODEL + ["train.float8=true"] + overrides)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        preflight(cfg, 2)
