"""Context parallelism (contiguous split, parallel/cp_state.py) for Hope-attention, the tree LM and
the memory bridge, against one process."""
import pytest
import torch

from megatron_taper.build import build_run
from megatron_taper.config import load_config
from tests.helpers.cp_harness import Tolerances, compare, reference, train
from tests.helpers.harness import run_distributed

pytestmark = pytest.mark.multiprocess

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

CASES = {
    "hope": [*HOPE],
    "tree": ["model.arch=tree", "model.n_layers=1", "model.tree.cell_width=48"],
    "bridge": [*BRIDGE],
    "bridge aux next_hidden": [*BRIDGE, "model.bridge.aux_weight=0.5"],
    "bridge aux random, one segment per slice": [*BRIDGE[:-1], "model.bridge.segment=32", "model.bridge.aux_weight=0.5",
                                                 "model.bridge.aux_target=random"],
    "bridge carry_state": [*BRIDGE, "model.bridge.carry_state=true"],
}


def _worker(layouts):
    """Each layout in turn; every rank's records (the carried states are every rank's own)."""
    out = []
    for overrides in layouts:
        run = build_run(load_config(None, list(overrides)))
        out.append(train(run, True))
    return out


def test_cp2_matches_one_process():
    got = run_distributed(_worker, 2, [[*BASE, "parallel.cp=2", *o] for o in CASES.values()], timeout=120)
    for case, (label, overrides) in enumerate(CASES.items()):
        ref = reference([*BASE, *overrides])
        compare(got[0][case], ref, f"cp=2 {label}", BRIDGE_TOL if "bridge" in label else None)
        for rank in range(2):  # what each rank's checkpoint saves: the one-process state
            for mine, want in zip(got[rank][case]["carried"], ref["carried"], strict=True):
                for a, b in zip(mine["states"], want["states"], strict=True):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
