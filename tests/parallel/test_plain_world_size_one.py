"""fsdp2 at world size 1 (parallel/dp/fsdp2.py): nothing to shard, so the model stays the plain module,
no FSDP wrap, plain tensors, and its checkpoint pieces are those of parallel.zero=none (same names,
shapes, offsets, owners). One process, tiny model, built on the CPU."""
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from megatron_taper.config import load_config
from megatron_taper.parallel.context import ParallelContext
from megatron_taper.training.build import build_run

TINY = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.mlp_width=64", "model.taper.multiple=16",
        "model.vocab_size=128", "model.seq_len=16", "train.device=cpu", "train.global_batch=2", "train.micro_batch=2"]


def _pieces(zero: str):
    run = build_run(load_config(None, [*TINY, f"parallel.zero={zero}"]),
                    ParallelContext(1, 0, 0, 1, 1, 1, torch.device("cpu")))
    pm = run.model
    pieces = {name: pm.piece_box(name, p) for name, p in pm.module.named_parameters()}
    return pm, pieces


def test_fsdp2_at_world_size_one_is_the_plain_module():
    pm, pieces = _pieces("fsdp2")
    assert not any(isinstance(m, FSDPModule) for m in pm.module.modules())
    assert not any(isinstance(p, DTensor) for p in pm.module.parameters())
    plain, plain_pieces = _pieces("none")
    assert pieces == plain_pieces and all(owner for _, _, owner in pieces.values())
    assert type(pm.module) is type(plain.module)
