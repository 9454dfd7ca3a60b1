"""The fsdp2 unit / reshard / prefetch rule (parallel/dp/fsdp2.py, cost/memory.py fsdp_units,
docs/zero.md): the grouping arithmetic, and the rule observed on 2 gloo processes through what
FSDP2 exposes: which blocks' parameters are sharded DTensors after a forward, and the profiler's
`FSDP::forward_prefetch for <unit>` records (torch's names for the all-gathers it issues ahead).
Numerics do not depend on the rule (the parity tests of test_zero.py and test_hsdp.py).
"""
import re

import pytest

from megatron_taper.cost.memory import FSDP_UNIT_CAP, fsdp_units
from tests.helpers.harness import run_distributed
from tests.parallel.test_zero import MODEL, TRAIN

pytestmark = pytest.mark.multiprocess

# 3 blocks of 2.21M, 1.62M and 1.03M parameters (cosine taper): at dp_shard=2 a unit needs 2M
WIDER = ["model.d_model=384", "model.mlp_width=1024", "model.taper.multiple=64"]


def test_units_grow_with_dp_shard_up_to_the_cap():
    small = [0.5e6] * 8
    assert fsdp_units(small, 1) == [[0, 1], [2, 3], [4, 5], [6, 7]]  # 1M elements per unit
    assert fsdp_units(small, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # 2M: each rank's share stays 1M
    assert fsdp_units(small, 1000) == [list(range(8))]  # capped at 40M elements: all 4M in one
    assert fsdp_units([FSDP_UNIT_CAP + 1.0] * 3, 4096) == [[0], [1], [2]]  # a large block is a unit alone
    assert fsdp_units([2.21e6, 1.62e6, 1.03e6], 2) == [[0], [1, 2]]  # the last unit takes what is left
    assert fsdp_units([], 2) == []


def test_memory_model_counts_the_gathered_units():
    """At block l's backward: l's unit and the unit before it, gathered (fp32: 4 + 4 bytes per
    parameter, weight and unsharded gradient), and the head's unsharded gradient (the root's are
    reduce-scattered at the end of the backward); at the head's: the last unit's weights."""
    from megatron_taper.config import load_config
    from megatron_taper.cost.memory import MemorySetup, model_memory

    cfg = load_config(None, MODEL + WIDER).model
    fsdp, none = model_memory(cfg, MemorySetup(zero="fsdp2", dp=2)), model_memory(cfg, MemorySetup())
    p = [layer.params for layer in fsdp.layers]
    extra = [f.peak - n.peak for f, n in zip(fsdp.layers, none.layers)]
    head_grad = 4 * fsdp.head.params
    assert extra == pytest.approx([8 * p[0] + head_grad, 8 * sum(p) + head_grad, 8 * sum(p) + head_grad])
    assert fsdp.head.peak - none.head.peak == pytest.approx(4 * (p[1] + p[2]))


def _forward_backward_observed(overrides):
    import torch
    from torch.distributed.tensor import DTensor
    from torch.profiler import profile

    from megatron_taper.config import load_config
    from megatron_taper.training.build import build_run

    pm = build_run(load_config(None, overrides)).model
    tokens = torch.randint(0, 256, (1, 17), generator=torch.Generator().manual_seed(0))
    with profile() as prof:
        loss = pm.loss_fn(pm.module(tokens[:, :-1]), tokens[:, 1:])
        gathered = [name for name, block in pm.module.layers.items()
                    if not any(isinstance(p, DTensor) for p in block.parameters())]
        loss.backward()
    names = {e.name.split(" for ", 1)[1] for e in prof.events() if e.name.startswith("FSDP::forward_prefetch for ")}
    blocks = sorted(n for n in names if all(re.fullmatch(r"layers\.\d+", x) for x in n.split(", ")))
    return gathered, blocks, sorted(names - set(blocks))


@pytest.mark.parametrize("extra", [[], ["train.precision=bf16", "train.activation_checkpointing=full"]],
                         ids=["fp32", "bf16_ac"])
def test_last_unit_stays_gathered_and_the_next_unit_is_prefetched(tmp_path, extra):
    args = MODEL + TRAIN + WIDER + ["parallel.zero=fsdp2", f"run.dir={tmp_path}", *extra]
    for gathered, units, matmul_units in run_distributed(_forward_backward_observed, 2, args, timeout=120):
        assert gathered == ["1", "2"]  # the last unit: its backward comes next
        assert units == ["layers.0", "layers.1, layers.2"]  # each prefetched by the piece before it
        # bf16: the matmul-only layers of each unit are a unit of their own, prefetched with it
        assert [n.split(".", 2)[1] for n in matmul_units] == (["0", "1"] if extra else [])
