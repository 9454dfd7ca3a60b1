"""Titans under context parallelism (models/titans/cp.py) against one process.

Model: 2 layers, d=32, 2 query heads over 1 kv head, vocab 101, seq_len 64 (32 tokens per cp rank),
sliding window / MAC segment 8, memory chunks of 16 rows behind P=4 persistent tokens: rank 1's
slice starts 4 rows into a chunk (36 = 2 x 16 + 4), so it scans that chunk again from its starting
state with the 4 rows rank 0 sent. Cases (one 2-process launch): MAG (deep memory, convolution of
4 taps, momentum and forgetting at their defaults); MAC (deep memory; segment pasts and the
retrieval queries' convolution carried over the boundary); MAG with a chunk of 48 rows and a
window of 40 tokens, both longer than a slice (the chunk spans both ranks and reaches into the
persistent tokens; the window's halo is all 32 tokens of rank 0); MAL with a linear memory, no
convolution and 16 persistent tokens (chunks aligned with the slice: only the memory state and
the window's halo pass, the empty tails are not sent) under full activation checkpointing (the
recomputed forward replays what the chain received). Each runs 3 AdamW steps of 2 micro-batches
of 2 sequences (tests/helpers/cp_harness.py).

Tolerances (fp32): the cp run computes the same sums in another order (a chunk's terms with the
rows of the previous rank computed again, attention blocks laid out from the halo's start, the
loss as a sum of per-rank shares), a few float32 roundings of quantities of order 1 to 10. At the
first step every gradient is within 6.5e-7 of one process (relative to the parameter's largest
entry; losses within 1e-6 at every step). AdamW (train.eps=1e-5, as in
tests/parallel/test_context_parallel.py) then carries those roundings into the next steps'
parameters, where the memory's inner updates amplify them more than in the Transformer: measured
at most 8.7e-6 on the gradients of steps 2-3 (the memory's gate bias) and 6.7e-6 on the final
parameters. Tolerances: losses 2e-5 absolute, gradients 3e-5 relative, gradient norms 1e-4
relative, final parameters 5e-5 relative. (With model.titans.max_lr=0.3 instead of the default
0.003 the first step still agrees within 1.3e-6, but by the third the gradients differ by 1.6e-2:
the fast inner learning makes the model that sensitive to its parameters, so the test keeps the
default.)
"""
import re

import pytest

from megatron_taper.config import load_config
from megatron_taper.cost.preflight import preflight
from megatron_taper.validation import ConfigError
from tests.helpers.cp_harness import Tolerances, compare, reference, worker
from tests.helpers.harness import run_distributed

pytestmark = pytest.mark.multiprocess

MODEL = ["model.arch=titans", "model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1",
         "model.mlp_width=64", "model.taper.multiple=16", "model.vocab_size=101", "model.seq_len=64",
         "model.titans.window=8", "model.titans.chunk_size=16", "model.titans.persistent_tokens=4",
         "train.seed=11", "train.global_batch=4", "train.micro_batch=2", "train.lr=3e-3",
         "train.warmup_steps=0", "train.grad_clip=0.5", "train.eps=1e-5"]

TOLERANCES = Tolerances(loss=2e-5, grad=3e-5, norm=1e-4, final=5e-5)

CASES = {"mag": ["model.titans.variant=mag"],
         "mac": ["model.titans.variant=mac"],
         "mag chunk and window over the slice": ["model.titans.variant=mag", "model.titans.chunk_size=48",
                                                 "model.titans.window=40"],
         "mal linear, no conv, aligned chunks, full checkpointing": [
             "model.titans.variant=mal", "model.titans.memory_depth=1", "model.titans.conv_kernel=0",
             "model.titans.persistent_tokens=16", "train.activation_checkpointing=full"]}


def _worker(layouts):
    return worker([MODEL + list(o) for o in layouts])


def test_cp2_every_variant_matches_one_process():
    """Every case above at cp=2 in one 2-process launch, each against its one-process run."""
    got = run_distributed(_worker, 2, [["parallel.cp=2", *o] for o in CASES.values()], timeout=180)[0]
    for (label, overrides), rec in zip(CASES.items(), got):
        compare(rec, reference(MODEL + overrides), f"titans cp=2 {label}", TOLERANCES)


@pytest.mark.parametrize("overrides,message", [
    (["model.titans.variant=mac", "model.titans.window=12"],
     "model.titans.variant='mac' at parallel.cp=2: each cp rank's slice, model.seq_len / parallel.cp = 64 / 2 = 32 "
     "tokens, must hold whole segments of model.titans.window=12 tokens"),
    (["model.titans.memory_depth=31"],
     "model.titans.memory_depth=31 at parallel.cp=2: a block's state message would hold more than 64 tensors"),
])
def test_refuses_what_the_split_cannot_hold(overrides, message):
    """MAC's segments must not span two cp ranks; a block's message has at most 64 tensors."""
    cfg = load_config(None, MODEL + overrides + ["parallel.cp=2"])
    with pytest.raises(ConfigError, match=re.escape(message)):
        preflight(cfg, 2)
