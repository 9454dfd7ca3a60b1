"""Memory Caching (linear and deep memory, every caching variant) under context parallelism
(models/memory_caching/cp.py) against one process.

Model: 2 layers, d=64, 4 heads of 16, vocab 101, seq_len 64 in segments of 16: at cp=2 rank 0
holds segments 0-1 and rank 1 segments 2-3, which read the 2 and 3 end states cached before them
(ssc's top-2 then chooses among 3); chunks of 8 (linear_chunk, titans.chunk_size); the causal
convolutions' 4 taps reach 3 tokens into rank 0's slice.

- float64, the model alone: every variant x write mode x memory at cp=2 (and four cases at cp=4,
  one segment per slice), logits and every parameter's
  gradient of a fixed weighting of the logits (2 sequences), against the whole sequence in one
  process. The cp run computes the same values in another order (the linear memory's state at a
  slice start as a fold of per-segment updates instead of the chunked scan; the deep memory's
  chain hands over the very tensors one process uses), so they agree to float64 rounding: 1e-12
  relative to the largest entry (measured at most 6.1e-16 on the logits, 1.8e-14 on the gradients).
- fp32 training (tests/helpers/cp_harness.py: 3 AdamW steps of 2 micro-batches of 2 sequences with
  clipping that bites, each rank building its layout from the same seed): linear grm, deep soup,
  and under full activation checkpointing (its recompute replays what the chain received and the
  prefix gathered) linear ssc and deep residual with independent writes (2 processes); linear ssc
  and deep soup at cp=2 x tp=2 (4 processes). The first step's gradients agree to 5e-7 relative (linear)
  and 5e-6 (the deep memory's soup: W_u's gradient, a sum of cancelling terms); AdamW (eps 1e-5)
  turns those roundings into update differences of up to lr x 1e-3 for small-gradient entries,
  so later gradients and the final parameters differ by up to 1.4e-5 and 2.3e-5 relative
  (measured): tolerances 5e-5 on both, the Transformer's on the losses (2e-5 absolute, measured
  4.8e-7) and norms (1e-4 relative, measured 2e-7).
"""
import re

import pytest
import torch
import torch.distributed as dist

from megatron_taper.config import load_config
from megatron_taper.cost.preflight import preflight
from megatron_taper.models import build_model
from megatron_taper.parallel.cp.split import SequenceSplit, apply_context_parallel
from megatron_taper.validation import ConfigError
from tests.helpers.cp_harness import Tolerances, compare, reference, worker
from tests.helpers.harness import run_distributed

pytestmark = pytest.mark.multiprocess

MODEL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.mlp_width=96", "model.taper.multiple=16",
         "model.vocab_size=101", "model.seq_len=64", "model.memory_caching.segment=16",
         "model.memory_caching.linear_chunk=8", "model.titans.chunk_size=8", "model.memory_caching.top_k=2",
         "train.seed=11", "train.global_batch=4", "train.micro_batch=2", "train.lr=3e-3", "train.warmup_steps=0",
         "train.grad_clip=0.5", "train.eps=1e-5"]
TOL = Tolerances(grad=5e-5, final=5e-5)
EXACT = 1e-12


def _case(arch, variant, *more):
    return [f"model.arch={arch}", f"model.memory_caching.variant={variant}", *more]


EXACT_CASES = [_case(arch, variant, f"model.memory_caching.write_mode={mode}")
               for arch in ("linear_memory", "deep_memory") for variant in ("none", "residual", "grm", "soup", "ssc")
               for mode in ("checkpoint", "independent")]
TRAIN_CASES = {
    "linear_memory grm": _case("linear_memory", "grm"),
    "deep_memory soup": _case("deep_memory", "soup"),
    "linear_memory ssc, full checkpointing": _case("linear_memory", "ssc", "train.activation_checkpointing=full"),
    "deep_memory residual independent, full checkpointing": _case(
        "deep_memory", "residual", "model.memory_caching.write_mode=independent",
        "train.activation_checkpointing=full"),
}


def _tokens():
    return torch.randint(0, 101, (2, 64), generator=torch.Generator().manual_seed(1))


def _exact_run(overrides, split=None):
    """float64 logits of the model (or of this rank's slice) and the gradients of sum(logits x w)."""
    model = build_model(load_config(None, MODEL + overrides).model)
    model.init_weights(3)
    model.double()
    tokens = _tokens()
    if split is not None:
        apply_context_parallel(model, split)
        tokens = split.split(tokens)
    logits = model(tokens)
    (logits * torch.linspace(-1, 1, logits.shape[-1], dtype=logits.dtype)).sum().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def _exact_worker(cases):
    """The float64 runs of `cases` split over all processes: the logits gathered in rank order and
    the gradients summed."""
    cp = dist.get_world_size()
    split = SequenceSplit(cp, dist.get_rank(), dist.group.WORLD, balanced=False)
    out = []
    for overrides in cases:
        logits, grads = _exact_run(overrides, split)
        parts = [torch.empty_like(logits) for _ in range(cp)]
        dist.all_gather(parts, logits)
        for g in grads.values():
            dist.all_reduce(g)
        out.append((torch.cat(parts, dim=1), grads))
    return out


def _check_exact(cases, got):
    for overrides, (logits, grads) in zip(cases, got):
        want_logits, want = _exact_run(overrides)
        errors = ((logits - want_logits).abs().max() / want_logits.abs().max(),
                  max((grads[n] - g).abs().max() / g.abs().max() for n, g in want.items()))
        print(f"float64 {overrides}: logits {errors[0]:.1e}, gradients {errors[1]:.1e}")
        assert max(errors) < EXACT, (overrides, errors)


def _worker():
    """Rank 0: the float64 runs, then the training records."""
    return _exact_worker(EXACT_CASES), worker([MODEL + ["parallel.cp=2", *o] for o in TRAIN_CASES.values()])


def test_cp2_matches_one_process():
    """Every variant x write mode x memory in float64, and the training cases, at cp=2 (one launch)."""
    exact, trained = run_distributed(_worker, 2, timeout=180)[0]
    _check_exact(EXACT_CASES, exact)
    for (label, overrides), rec in zip(TRAIN_CASES.items(), trained):
        compare(rec, reference(MODEL + overrides), f"cp=2 {label}", TOL)


CP4_CASES = [_case("linear_memory", "grm"),
             _case("linear_memory", "ssc", "model.memory_caching.write_mode=independent"),
             _case("deep_memory", "soup"), _case("deep_memory", "none")]
TP_CASES = {"linear_memory ssc": _case("linear_memory", "ssc"), "deep_memory soup": _case("deep_memory", "soup")}


def _four_worker():
    """cp=4 in float64 (the prefix folds 3 ranks' summaries, the chain runs 3 hops), then cp=2 x tp=2 training."""
    return _exact_worker(CP4_CASES), worker([MODEL + ["parallel.cp=2", "parallel.tp=2", *o] for o in TP_CASES.values()])


def test_cp4_and_cp2_with_tp2_match_one_process():
    """4 processes: cp=4 (one segment per slice; the last reads the 3 cached before it) in float64,
    and cp=2 x tp=2 training, where the handover, its summaries and the chain hold each tp rank's
    heads (the memory, W_u and the halo's projections split by head); tolerances as above."""
    exact, trained = run_distributed(_four_worker, 4, timeout=180)[0]
    _check_exact(CP4_CASES, exact)
    for (label, overrides), rec in zip(TP_CASES.items(), trained):
        compare(rec, reference(MODEL + overrides), f"cp=2 x tp=2 {label}", TOL)


@pytest.mark.parametrize("overrides,message", [
    (_case("linear_memory", "grm", "model.memory_caching.segment=24"),
     "parallel.cp=2 splits model.seq_len=64 into slices of 32 tokens, which model.memory_caching.segment=24 does "
     "not divide"),
    (_case("deep_memory", "none", "model.titans.chunk_size=24"),
     "parallel.cp=2 splits model.seq_len=64 into slices of 32 tokens, which model.titans.chunk_size=24 does not "
     "divide"),
    (_case("linear_memory", "none", "model.memory_caching.linear_conv_kernel=34"),
     "parallel.cp=2: model.memory_caching.linear_conv_kernel=34 reaches 33 tokens back"),
])
def test_layouts_the_split_cannot_serve_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        preflight(load_config(None, MODEL + overrides + ["parallel.cp=2"]), 2)
