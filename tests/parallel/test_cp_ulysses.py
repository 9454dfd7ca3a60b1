"""All-to-all (Ulysses) context parallelism, parallel.cp_attention=ulysses (parallel/cp/ulysses.py),
against one process.

The kernel alone: q [2, 4, 48, 8] over k, v [2, 2, 48, 8] (GQA: one kv head per cp rank at cp=2),
RoPE-style causal and ALiBi, over the load-balanced split (chunks 0 and 3 on rank 0: the all-to-all
must restore the sequence's order) and the contiguous one, and over k, v [2, 1, 48, 8] (one kv head,
repeated to two so that each cp rank gets one; its gradient sums both copies); each rank's output and q, k, v gradients
equal its slices of SDPA over the whole sequence within 2e-6 (fp32 sums of up to 48 terms of
order 1, the same kernel on the same heads; measured <= 5e-7).

Training: the cp harness's model and steps (tests/helpers/cp_harness.py; tests/parallel/
test_context_parallel.py's MODEL: 2 layers, d=64, 4 heads over 2 kv heads, seq_len 64, 3 AdamW
steps of 2 micro-batches) for every family that has Ulysses: the Transformer with RoPE and ALiBi,
Gated Attention, Hope-attention and the memory bridge (their attention goes all-to-all, their
state keeps its chain), and Titans MAG and MAL (test_cp_titans.py's model: 2 heads, memory chunks
of 16 rows behind 4 persistent tokens; each rank scans the whole sequence for one head, no chain),
also under full activation checkpointing (the recompute repeats the all-to-alls in backward, in the
same order on every rank). Tolerances: the harness's, and the reasoning of test_context_parallel.py
(the same fp32 sums in another order); Hope's, the bridge's and Titans' those of their cp tests
(HOPE_TOL, BRIDGE_TOL, test_cp_titans.py's TOLERANCES). Measured at most: loss 9.5e-7, gradients
2.3e-5 (Hope; the others <= 7.4e-6), final parameters 4.4e-5 (the bridge's read projection).
Then 4 processes: cp=2 x dp=2 under fsdp2 (shards over dp x cp), cp=2 x pp=2 (1F1B: each stage's
[b, S / 2] slices), cp=2 x tp=2 (each tp rank's 2 heads split over cp, its one kv head repeated to
one per cp rank) and cp=4 (4 heads, 2 kv heads repeated to 4).
"""
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_taper.config import load_config
from megatron_taper.cost.cp import ALLTOALL, cp_messages, ulysses_bytes
from megatron_taper.cost.preflight import preflight
from megatron_taper.models.layers import alibi_slopes, causal_mask_at
from megatron_taper.parallel.cp.split import SequenceSplit
from megatron_taper.validation import ConfigError
from tests.helpers.cp_harness import compare, merge_stages, reference, stage_worker, worker
from tests.helpers.harness import run_distributed
from tests.parallel.test_context_parallel import MODEL
from tests.parallel.test_cp_hope_tree_bridge import BASE, BRIDGE, BRIDGE_TOL, HOPE, HOPE_TOL
from tests.parallel.test_cp_titans import MODEL as TITANS
from tests.parallel.test_cp_titans import TOLERANCES as TITANS_TOL

pytestmark = pytest.mark.multiprocess

ULYSSES = ["parallel.cp=2", "parallel.cp_attention=ulysses"]
KERNEL_CASES = [(position, balanced, 2) for position in ("rope", "alibi") for balanced in (True, False)]
KERNEL_CASES += [("rope", True, 1), ("alibi", False, 1)]  # one kv head: repeated to one per cp rank
TRAINING_CASES = {
    "transformer rope": (MODEL + ["model.position=rope"], None),
    "transformer alibi": (MODEL + ["model.position=alibi"], None),
    "gated_attention": (MODEL + ["model.arch=gated_attention"], None),
    "transformer, full checkpointing": (MODEL + ["train.activation_checkpointing=full"], None),
    "hope_attention": (BASE + HOPE, HOPE_TOL),
    "bridge": (BASE + BRIDGE + ["model.bridge.aux_weight=0.5"], BRIDGE_TOL),
    # the memory scanned whole for one head per rank, its chunks crossing the slice boundary; the
    # window's halo from the rank before (previous_rows)
    "titans mag": (TITANS + ["model.titans.variant=mag"], TITANS_TOL),
    "titans mal linear, no conv, full checkpointing": (
        TITANS + ["model.titans.variant=mal", "model.titans.memory_depth=1", "model.titans.conv_kernel=0",
                  "model.titans.persistent_tokens=16", "train.activation_checkpointing=full"], TITANS_TOL),
}


def _attention_inputs(position, kv_heads):
    g = torch.Generator().manual_seed(3)
    q, w = (torch.randn(2, 4, 48, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(2, kv_heads, 48, 8, generator=g) for _ in range(2))
    return q, k, v, w, (alibi_slopes(4, 0, 4, torch.device("cpu")) if position == "alibi" else None)


def _kernel_and_training_worker(layouts):
    """The kernel cases, then each training layout: (kernel results, rank 0's training records)."""
    kernel = []
    for position, balanced, kv_heads in KERNEL_CASES:
        q, k, v, w, slopes = _attention_inputs(position, kv_heads)
        split = SequenceSplit(2, dist.get_rank(), dist.group.WORLD, attention="ulysses", balanced=balanced)
        mine = [split.split(t.transpose(1, 2)).transpose(1, 2).clone().requires_grad_() for t in (q, k, v)]
        out = split.attend(*mine, slopes)
        (out * split.split(w.transpose(1, 2)).transpose(1, 2)).sum().backward()
        kernel.append([out.detach()] + [t.grad for t in mine])
    return kernel, worker(layouts)


def test_ulysses_cp2_matches_one_process_for_every_family():
    """One 2-process launch: the kernel cases, then every training case at cp=2 under Ulysses."""
    layouts = [overrides + ULYSSES for overrides, _ in TRAINING_CASES.values()]
    results = run_distributed(_kernel_and_training_worker, 2, layouts, timeout=180)
    for case, (position, balanced, kv_heads) in enumerate(KERNEL_CASES):
        q, k, v, w, slopes = _attention_inputs(position, kv_heads)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        pos = torch.arange(48)
        out = F.scaled_dot_product_attention(*full, attn_mask=causal_mask_at(pos, pos, slopes), enable_gqa=True)
        (out * w).sum().backward()
        want = [out.detach()] + [t.grad for t in full]
        for rank, (kernel, _) in enumerate(results):
            split = SequenceSplit(2, rank, None, balanced=balanced)
            for name, a, b in zip(("out", "dq", "dk", "dv"), kernel[case], want):
                err = (a - split.split(b.transpose(1, 2)).transpose(1, 2)).abs().max().item()
                assert err < 2e-6, (position, balanced, kv_heads, rank, name, err)
    for (label, (overrides, tol)), rec in zip(TRAINING_CASES.items(), results[0][1]):
        compare(rec, reference(overrides), f"ulysses cp=2 {label}", tol)


def test_ulysses_with_fsdp2_pp_and_tp():
    """4 processes: cp=2 x dp=2 with fsdp2 (the Transformer, and Titans MAG: its memory's per-head
    parameters sliced by each cp rank from the gathered FSDP2 shards), cp=2 x pp=2 (1F1B), cp=2 x
    tp=2 (ALiBi slopes of each rank's global heads), cp=4."""
    layouts = {"cp=2 x dp=2 fsdp2": (MODEL + ULYSSES + ["parallel.zero=fsdp2"], None),
               "titans mag cp=2 x dp=2 fsdp2": (TITANS + ULYSSES + ["parallel.zero=fsdp2"], TITANS_TOL),
               "cp=2 x pp=2": (MODEL + ULYSSES + ["parallel.pp=2"], None),
               "cp=2 x tp=2 alibi": (MODEL + ULYSSES + ["parallel.tp=2", "model.position=alibi"], None),
               "cp=4": (MODEL + ULYSSES + ["parallel.cp=4"], None)}  # the later parallel.cp wins
    got = merge_stages(run_distributed(stage_worker, 4, [o for o, _ in layouts.values()], timeout=300))
    for (label, (overrides, tol)), rec in zip(layouts.items(), got):
        compare(rec, reference(overrides), f"ulysses {label}", tol)


@pytest.mark.parametrize("overrides,world,message", [
    (["parallel.cp=4", "parallel.tp=2"], 8, "model.n_heads=4 / parallel.tp=2 = 2 heads per tp rank must divide by "
                                            "parallel.cp=4"),
    (["parallel.cp=8", "model.seq_len=64"], 8, "model.n_heads=4 / parallel.tp=1 = 4 heads per tp rank must divide"),
    (["model.arch=titans", "model.titans.variant=mac"], 2, "model.titans.variant='mac' with "
                                                           "parallel.cp_attention='ulysses': MAC's memory is not "
                                                           "per head"),
    (["model.arch=titans", "model.titans.window=40"], 2, "model.titans.window=40 with parallel.cp_attention='ulysses' "
                                                         "at parallel.cp=2: the window's W - 1 = 39 rows"),
    (["model.arch=tree", "model.n_layers=1"], 2, "model.arch='tree' has no all-to-all form"),
])
def test_preflight_refuses_layouts_ulysses_cannot_split(overrides, world, message):
    cfg = load_config(None, MODEL + ["parallel.cp=2", "parallel.cp_attention=ulysses", *overrides])
    with pytest.raises(ConfigError, match=re.escape(message)):
        preflight(cfg, world)


def test_unknown_cp_attention_suggests_ulysses():
    with pytest.raises(ConfigError, match=re.escape("did you mean 'ulysses'")):
        load_config(None, ["parallel.cp_attention=ulyses"])


def test_ulysses_bytes_count_the_two_all_to_alls():
    """Per attention layer and micro-batch: q, k, v [b, S / cp, H + 2 K', E] and the output
    [b, S / cp, H, E] (MODEL: H = 4, K = 2, E = 16, S = 64, b = 2, fp32); K' = K at cp=2, the kv
    heads repeated to 4 at cp=4."""
    cfg = load_config(None, MODEL).model
    assert ulysses_bytes(cfg, 2, 2) == 2 * 32 * (4 + 2 * 2 + 4) * 16 * 4
    assert ulysses_bytes(cfg, 2, 4) == 2 * 16 * (4 + 2 * 4 + 4) * 16 * 4
    blocks = cp_messages(cfg, 2, 64, 2, attention="ulysses")
    assert [[(m.kind, m.bytes) for m in block] for block in blocks] == [[(ALLTOALL, 2 * 32 * 12 * 16 * 4)]] * 2


@pytest.mark.slow  # over ~20 s alone: two ranks compile their blocks (measured 160 s on 2 shared cores)
def test_ulysses_with_compile():
    """2 processes, 2 steps: cp=2 under Ulysses with train.compile=true (each block compiled, the
    default on CUDA); compiled kernels sum in another order, within the same tolerances."""
    overrides = MODEL + ULYSSES + ["train.compile=true"]
    got = merge_stages(run_distributed(stage_worker, 2, [overrides], 2, timeout=300))[0]
    compare(got, reference(MODEL, steps=2), "ulysses cp=2 compile")


def test_memory_model_keeps_the_ranks_own_elements():
    """cost/memory.py under Ulysses: each block keeps the elements of its seq_len / cp tokens (the
    head-sharded q, k, v and output are as large), plus at cp=4 a second copy of K and V (2 kv
    heads repeated to 4: [b, 2, S / 4, E] x 2 more, fp32); no gathered K and V, no received bytes."""
    from megatron_taper.cost.memory import MemorySetup, model_memory

    def kept(overrides):
        cfg = load_config(None, MODEL + overrides)
        setup = MemorySetup.from_config(cfg.parallel, cfg.train, 1, False)
        return [p.kept for p in model_memory(cfg.model, setup).layers]

    assert kept(ULYSSES) == kept(["model.seq_len=32"])
    repeated = 2 * 2 * 2 * 16 * 16 * 4  # micro_batch 2 x (K and V) x 2 kv heads x head_dim 16 x 16 tokens x fp32
    assert kept([*ULYSSES, "parallel.cp=4"]) == [k + repeated for k in kept(["model.seq_len=16"])]
