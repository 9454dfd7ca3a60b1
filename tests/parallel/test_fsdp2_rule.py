"""The fsdp2 unit / reshard / prefetch rule (parallel/zero.py, docs/zero.md), observed on 2 gloo
processes through what FSDP2 exposes: which blocks' parameters are sharded DTensors after a
forward, and the profiler's `FSDP::forward_prefetch for <unit>` records (torch's names for the
all-gathers it issues ahead). Numerics are unchanged by the rule (test_zero.py, test_hsdp.py).
"""
import pytest

from tests.helpers.harness import run_distributed
from tests.parallel.test_zero import MODEL, TRAIN

pytestmark = pytest.mark.multiprocess


def _forward_backward_observed(overrides):
    import torch
    from torch.distributed.tensor import DTensor
    from torch.profiler import profile

    from megatron_taper.build import build_run
    from megatron_taper.config import load_config

    pm = build_run(load_config(None, overrides)).model
    tokens = torch.randint(0, 256, (1, 17), generator=torch.Generator().manual_seed(0))
    with profile() as prof:
        loss = pm.loss_fn(pm.module(tokens[:, :-1]), tokens[:, 1:])
        gathered = [name for name, block in pm.module.layers.items()
                    if not any(isinstance(p, DTensor) for p in block.parameters())]
        loss.backward()
    prefetched = {e.name.split(" for ")[1].split(".")[1] for e in prof.events()
                  if e.name.startswith("FSDP::forward_prefetch for layers.")}
    return gathered, sorted(prefetched)


@pytest.mark.parametrize("extra", [[], ["train.precision=bf16", "train.activation_checkpointing=full"]],
                         ids=["fp32", "bf16_ac"])
def test_last_block_stays_gathered_and_the_next_block_is_prefetched(tmp_path, extra):
    args = MODEL + TRAIN + ["parallel.zero=fsdp2", f"run.dir={tmp_path}", *extra]
    for gathered, prefetched in run_distributed(_forward_backward_observed, 2, args, timeout=120):
        assert gathered == ["2"]  # the last of 3 blocks: its backward comes next
        assert prefetched == ["0", "1", "2"]  # each by the piece before it (block 0 by the root)
