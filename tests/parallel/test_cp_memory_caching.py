"""Memory Caching (linear and deep memory, every caching variant) under context parallelism
(models/memory_caching_cp.py) against one process.

Model: 2 layers, d=64, 4 heads of 16, vocab 101, seq_len 64 in segments of 16: at cp=2 rank 0
holds segments 0-1 and rank 1 segments 2-3, which read the 2 and 3 end states cached on rank 0 and
before them (ssc's top-2 then chooses among 3); chunks of 8 (linear_chunk, titans.chunk_size), the
causal convolutions' 4 taps reach 3 tokens into rank 0's slice. Each rank builds its layout from
the same seed and runs the harness's 3 AdamW steps of 2 micro-batches of 2 sequences with clipping
that bites (tests/helpers/cp_harness.py); the one-process run does the same.

Tolerances (fp32): the cp run computes the same sums in another order: the linear memory's state
at a slice start as a fold of per-segment updates (one [E, T] x [T, E] matmul per segment) instead
of the chunked scan, the deep memory's the same operations on the same values (the chain hands
over exactly the tensors one process would use), and the loss as a sum of per-rank shares. Each
value differs by a few float32 roundings of quantities of order 1 to 10: the Transformer's
tolerances (Tolerances(): 2e-5 absolute on the losses, 1e-5 relative on each parameter's
gradient, 1e-4 on the norms, 2e-5 on the final parameters); measured at most 1.2e-6 on the
losses, 1.6e-6 on the gradients, 3e-7 on the norms, 1.8e-6 on the final parameters.
"""
import re

import pytest

from megatron_taper.config import load_config
from megatron_taper.preflight import preflight
from megatron_taper.validation import ConfigError
from tests.helpers.cp_harness import compare, reference, worker
from tests.helpers.harness import run_distributed

pytestmark = pytest.mark.multiprocess

MODEL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.mlp_width=96", "model.taper.multiple=16",
         "model.vocab_size=101", "model.seq_len=64", "model.memory_caching.segment=16",
         "model.memory_caching.linear_chunk=8", "model.titans.chunk_size=8", "model.memory_caching.top_k=2",
         "train.seed=11", "train.global_batch=4", "train.micro_batch=2", "train.lr=3e-3", "train.warmup_steps=0",
         "train.grad_clip=0.5", "train.eps=1e-5"]


def _case(arch, variant, *more):
    return [f"model.arch={arch}", f"model.memory_caching.variant={variant}", *more]


CASES = {f"{arch} {variant}": _case(arch, variant)
         for arch in ("linear_memory", "deep_memory") for variant in ("none", "residual", "grm", "soup", "ssc")}
CASES.update({
    "linear_memory grm independent": _case("linear_memory", "grm", "model.memory_caching.write_mode=independent"),
    "deep_memory soup independent": _case("deep_memory", "soup", "model.memory_caching.write_mode=independent"),
    # the recomputed forward replays what the chain received and the prefix gathered
    "linear_memory ssc full checkpointing": _case("linear_memory", "ssc", "train.activation_checkpointing=full"),
    "deep_memory grm full checkpointing": _case("deep_memory", "grm", "train.activation_checkpointing=full"),
})


def _worker(layouts):
    return worker([MODEL + list(o) for o in layouts])


def test_cp2_matches_one_process():
    """Every variant over both memories (and independent writes, and full activation
    checkpointing) at cp=2, in one 2-process launch."""
    got = run_distributed(_worker, 2, [["parallel.cp=2", *o] for o in CASES.values()], timeout=180)[0]
    for (label, overrides), rec in zip(CASES.items(), got):
        compare(rec, reference(MODEL + overrides), f"cp=2 {label}")


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
