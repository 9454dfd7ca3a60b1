"""Context parallelism (contiguous split, parallel/cp/state.py) for Hope-attention, the tree LM and
the memory bridge, against one process.

Models: 2 layers (the tree: 1), d=64, 4 query heads over 2 kv heads, vocab 101, seq_len 64, so
cp rank 1 holds positions 32-63: Hope's levels update every 8 and 16 tokens (4 and 2 updates
per slice, the fast weights of both crossing the slice boundary), the tree's slices are blocks of
32, the bridge's segments of 8 (4 per slice; one case 32: a single segment per slice). Each layout
runs the cp harness's 3 AdamW steps of 2 micro-batches of 2 sequences (tests/helpers/cp_harness.py),
with carry_state carrying each row's state from step to step.

Tolerances (fp32): the harness's defaults (tests/parallel/test_context_parallel.py's reasoning:
the same sums in another order, a few float32 roundings of values of order 1 to 10): losses 2e-5
absolute (measured <= 4.8e-7), gradients 1e-5 relative to each parameter's largest entry (tree,
bridge: measured <= 3.6e-6; Hope 3e-5, HOPE_TOL: its outer gradients pass back through every
update of the fast weights, sums over a chunk of products of activations, measured <= 7.9e-6), gradient
norms 1e-4 (measured <= 2.5e-7), final parameters 2e-5 (measured <= 4.7e-6); the bridge's below
(BRIDGE_TOL). The carried state each cp rank would checkpoint equals the one-process state within
1e-5 absolute (values of order 1).
"""
import re

import pytest
import torch

from megatron_taper.config import load_config
from megatron_taper.cost.preflight import preflight
from megatron_taper.models import build_model
from megatron_taper.models.tree.cost import SweepCount
from megatron_taper.models.tree.cp import prefixes_after
from megatron_taper.models.tree.sweeps import tree_prefixes, up_sweep
from megatron_taper.training.build import build_run
from megatron_taper.validation import ConfigError
from tests.helpers.cp_harness import Tolerances, compare, reference, train
from tests.helpers.harness import run_distributed

BASE = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.mlp_width=96",
        "model.taper.multiple=16", "model.vocab_size=101", "model.seq_len=64", "train.seed=11",
        "train.global_batch=4", "train.micro_batch=2", "train.lr=3e-3", "train.warmup_steps=0",
        "train.grad_clip=0.5", "train.eps=1e-5"]
HOPE = ["model.arch=hope_attention", "model.hope.chunk_size=8", "model.hope.chunk_growth=2", "model.hope.online_lr=2.0"]

BRIDGE = ["model.arch=bridge", "model.bridge.slots=4", "model.bridge.segment=8"]

# the bridge's read projection starts at zero: after 3 steps its largest entry is about 3 lr, and
# entries whose gradient is near AdamW's eps move by lr x g / (|g| + eps), which turns gradient
# rounding into a larger share of so small a weight (measured 5.7e-5 on read.wo, everything else < 5e-6).
# With carry_state the carried state's slots have become nearly equal (the GRU contracts their
# differences, the write's attention being nearly uniform at this init), so the read's wq and wk
# gradients are zero up to rounding (largest entries 1e-11 against 1e-3 to 1e-1 elsewhere): gradients
# are compared relative to at least 1e-5 (measured 2e-11 absolute there)
BRIDGE_TOL = Tolerances(final=2e-4, grad_floor=1e-5)
HOPE_TOL = Tolerances(grad=3e-5)

CASES = {
    "hope": [*HOPE],
    # level 0 (C_0 = 16) chained, level 1 (C_1 = 64 = S) never updated within the sequence: not chained
    "hope, one level unchained": [*HOPE[:2], "model.hope.chunk_size=16", "model.hope.chunk_growth=4"],
    # the ring over the contiguous split; level 1 (C_1 = 32) has one chunk per slice: rank 0 updates
    # it once (its last chunk, for rank 1), rank 1 not at all
    "hope, ring attention": [*HOPE, "model.hope.chunk_size=16", "parallel.cp_attention=ring"],
    # the recomputed forward replays what each receive got; recomputed sends send nothing
    "hope, full checkpointing": [*HOPE, "train.activation_checkpointing=full"],
    "tree": ["model.arch=tree", "model.n_layers=1", "model.tree.cell_width=48"],
    "bridge aux next_hidden": [*BRIDGE, "model.bridge.aux_weight=0.5"],
    "bridge aux random, one segment per slice": [*BRIDGE[:-1], "model.bridge.segment=32", "model.bridge.aux_weight=0.5",
                                                 "model.bridge.aux_target=random"],
    "bridge carry_state": [*BRIDGE, "model.bridge.carry_state=true"],
    "bridge carry_state, full checkpointing": [*BRIDGE, "model.bridge.carry_state=true", "model.bridge.aux_weight=0.5",
                                               "train.activation_checkpointing=full"],
}


def _worker(layouts):
    """Each layout in turn; every rank's records (the carried states are every rank's own)."""
    out = []
    for overrides in layouts:
        run = build_run(load_config(None, list(overrides)))
        out.append(train(run, True))
    return out


@pytest.mark.multiprocess
def test_cp2_matches_one_process():
    """Every case at cp=2 in one 2-process launch against one process."""
    got = run_distributed(_worker, 2, [[*BASE, "parallel.cp=2", *o] for o in CASES.values()], timeout=120)
    for case, (label, overrides) in enumerate(CASES.items()):
        ref = reference([*BASE, *overrides])
        tol = BRIDGE_TOL if label.startswith("bridge") else HOPE_TOL if label.startswith("hope") else None
        compare(got[0][case], ref, f"cp=2 {label}", tol)
        for rank in range(2):  # what each rank's checkpoint saves: the one-process state
            for mine, want in zip(got[rank][case]["carried"], ref["carried"], strict=True):
                for a, b in zip(mine["states"], want["states"], strict=True):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_tree_slices_fold_into_the_whole_sequence_tree(cp):
    """The tree's cp arithmetic in one process, every rank of cp = 2, 3, 4 (the chain-free fold
    over the gathered roots; rank r >= 2 folds a start state through the down-sweep): each slice's
    prefixes equal the whole sequence's within 1e-5 (fp32 cell compositions in another grouping
    of the same tree, values of order 1: measured 5e-7)."""
    cfg = load_config(None, [*BASE, "model.arch=tree", "model.n_layers=1", f"model.seq_len={16 * cp}"]).model
    model = build_model(cfg)
    model.init_weights(0)
    cell = model.layers["0"].cell
    leaves = torch.randn(2, 16 * cp, cfg.d_model, generator=torch.Generator().manual_seed(cp))
    with torch.no_grad():
        whole = tree_prefixes(cell, leaves)
        nodes = [up_sweep(cell, piece, SweepCount()) for piece in leaves.split(16, dim=1)]
        roots = torch.stack([n[-1][:, 0] for n in nodes], dim=1)  # [B, cp, D]
        for rank in range(cp):
            got = prefixes_after(cell, nodes[rank], roots[:, :rank + 1], SweepCount())
            torch.testing.assert_close(got, whole[:, 16 * rank:16 * (rank + 1)], rtol=0, atol=1e-5)


@pytest.mark.parametrize("overrides,message", [
    ([*HOPE, "model.seq_len=48"], "parallel.cp=2: each rank's slice of model.seq_len=48 (24 tokens) must hold whole "
                                  "chunks of CMS level 1 (C_1 = model.hope.chunk_size x model.hope.chunk_growth^1"),
    (["model.arch=tree", "model.n_layers=1", "model.seq_len=48"],
     "parallel.cp=2: model.arch='tree' needs each rank's slice model.seq_len / parallel.cp = 48/2 = 24 tokens to be a "
     "power of two"),
    ([*BRIDGE, "model.bridge.segment=12"], "parallel.cp=2: each rank's slice of model.seq_len=64 (32 tokens) must hold "
                                           "whole segments of model.bridge.segment=12"),
])
def test_layouts_that_cut_the_state_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        preflight(load_config(None, [*BASE, "parallel.cp=2", *overrides]), 2)
