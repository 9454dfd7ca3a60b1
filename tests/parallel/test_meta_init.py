"""Meta-device construction (build.py + parallel/meta_init.py): each rank materialises only its
pieces, and the logical weights equal the one-process model's exactly.

Every layout is built by build_run on gloo processes and compared, parameter by parameter through
ParallelModel.full_tensor (tp gather, fsdp2 all-gather), with torch.equal against
build_model + init_weights in the same process. Layouts: pp=2 (1f1b, interleaved, profile
balance), tp=2 (GQA, MLP widths and vocabulary that split unevenly; transformer, titans,
gated_attention, hope_attention), fsdp2 dp=2 (uneven dp shards); on 4 ranks tp=2 x fsdp2 dp=2 and
tp=2 x pp=2 with profile balance (timed per tp shard).
One-process checks: no parameter is left with to_empty's memory, and a model with buffers is
built materialised.
"""
from __future__ import annotations

import pytest
import torch

from megatron_taper.config import load_config
from tests.helpers.harness import run_distributed

pytestmark = pytest.mark.multiprocess

# 3 layers; widths are multiples of 5 that split unevenly over tp=2; vocabulary 255 splits
# unevenly over tp and dp; 4 query heads over 2 kv heads
MODEL = ["model.n_layers=3", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.mlp_width=75",
         "model.taper.multiple=5", "model.vocab_size=255", "model.seq_len=16", "train.global_batch=4",
         "train.micro_batch=1", "train.device=cpu", "train.seed=11"]


def _compare(layouts: list[list[str]]) -> list[dict]:
    """Per layout: the parameter names this rank compared, those that differ from the one-process
    model, and this rank's local element count next to the whole model's."""
    from megatron_taper.models import build_model
    from megatron_taper.parallel.model import local_part
    from megatron_taper.training.build import build_run

    out = []
    for overrides in layouts:
        cfg = load_config(None, MODEL + overrides)
        pm = build_run(cfg).model
        ref = build_model(cfg.model)
        ref.init_weights(cfg.train.seed)
        ref_params = dict(ref.named_parameters())
        names, differ, local = [], [], 0
        for name, param in pm.module.named_parameters():
            full = pm.full_tensor(name, param.detach())  # collective over tp and dp
            names.append(name)
            if not torch.equal(full, ref_params[name]):
                differ.append(name)
            local += local_part(param).numel()
        out.append({"names": names, "differ": differ, "local": local,
                    "total": sum(p.numel() for p in ref.parameters()), "all": sorted(ref_params)})
    return out


def _check(results: list[list[dict]], layouts: list[list[str]], sharded: bool) -> None:
    for i, overrides in enumerate(layouts):
        per_rank = [r[i] for r in results]
        assert all(not r["differ"] for r in per_rank), (overrides, [r["differ"] for r in per_rank])
        assert sorted({n for r in per_rank for n in r["names"]}) == per_rank[0]["all"], overrides
        if sharded:  # every rank holds less than the whole model
            assert all(r["local"] < r["total"] for r in per_rank), (overrides, [r["local"] for r in per_rank])


PP = [["parallel.pp=2"], ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "model.n_layers=4"],
      ["parallel.pp=2", "parallel.pp_balance=profile"]]
TP = [["parallel.tp=2"], ["parallel.tp=2", "model.arch=titans"], ["parallel.tp=2", "model.arch=gated_attention"],
      ["parallel.tp=2", "model.arch=hope_attention", "model.n_kv_heads=1"]]
DP = [["parallel.zero=fsdp2"], ["parallel.zero=fsdp2", "model.arch=titans"]]


def test_pp_tp_fsdp2_weights_equal_one_process():
    layouts = PP + TP + DP
    _check(run_distributed(_compare, 2, layouts, timeout=120), layouts, sharded=True)


def test_tp_x_fsdp2_weights_equal_one_process():
    layouts = [["parallel.tp=2", "parallel.zero=fsdp2"],
               ["parallel.tp=2", "parallel.pp=2", "parallel.pp_balance=profile"]]
    _check(run_distributed(_compare, 4, layouts, timeout=120), layouts, sharded=True)


def _one_process_run(overrides: list[str]):
    from megatron_taper.parallel.context import ParallelContext
    from megatron_taper.training.build import build_run

    return build_run(load_config(None, MODEL + overrides), ParallelContext(1, 0, 0, 1, 1, 1, torch.device("cpu")))


def test_every_parameter_is_initialised(monkeypatch):
    """to_empty's memory is filled with NaN first: materialise must overwrite every parameter."""
    from torch import nn

    from megatron_taper.models import build_model

    to_empty = nn.Module.to_empty

    def poisoned(module, *, device, recurse=True):
        out = to_empty(module, device=device, recurse=recurse)
        with torch.no_grad():
            for p in module.parameters():
                p.fill_(float("nan"))
        return out

    monkeypatch.setattr(nn.Module, "to_empty", poisoned)
    for arch in ("transformer", "titans"):
        run = _one_process_run([f"model.arch={arch}"])
        ref = build_model(run.cfg.model)
        ref.init_weights(run.cfg.train.seed)
        got = dict(run.model.module.named_parameters())
        assert got.keys() == dict(ref.named_parameters()).keys()
        for name, p in ref.named_parameters():
            assert torch.equal(got[name], p), (arch, name)


def test_materialise_refuses_a_parameter_it_cannot_place():
    from megatron_taper.models import build_model
    from megatron_taper.parallel.context import ParallelContext
    from megatron_taper.parallel.meta_init import logical_shapes, materialise
    from megatron_taper.parallel.model import ParallelModel

    cfg = load_config(None, MODEL)
    with torch.device("meta"):
        model = build_model(cfg.model)
    shapes = logical_shapes(model)
    del shapes["norm.weight"]
    pm = ParallelModel(model, ParallelContext(1, 0, 0, 1, 1, 1, torch.device("cpu")))
    with pytest.raises(AssertionError, match="norm.weight"):
        materialise(pm, shapes, model.init_value, 0)


def test_model_with_buffers_is_built_materialised(monkeypatch):
    """to_empty cannot recreate buffer values: such a model is built whole, with its buffers."""
    import megatron_taper.training.build as build
    from megatron_taper.models import build_model

    def with_buffer(model_cfg):
        model = build_model(model_cfg)
        model.register_buffer("scale", torch.full((3,), 2.0))
        return model

    monkeypatch.setattr(build, "build_model", with_buffer)
    run = _one_process_run([])
    assert torch.equal(run.model.module.scale, torch.full((3,), 2.0))
    ref = build_model(run.cfg.model)
    ref.init_weights(run.cfg.train.seed)
    got = dict(run.model.module.named_parameters())
    assert all(torch.equal(got[n], p) for n, p in ref.named_parameters())


def test_materialise_keeps_parameter_attributes():
    """to_empty makes new parameter objects; attributes set on the meta ones (DeepSpeed's
    tensor_model_parallel) are carried over."""
    from megatron_taper.models import build_model
    from megatron_taper.parallel.context import ParallelContext
    from megatron_taper.parallel.meta_init import logical_shapes, materialise
    from megatron_taper.parallel.model import ParallelModel

    cfg = load_config(None, MODEL)
    with torch.device("meta"):
        model = build_model(cfg.model)
    model.layers["0"].mlp.w1.weight.tensor_model_parallel = True
    pm = ParallelModel(model, ParallelContext(1, 0, 0, 1, 1, 1, torch.device("cpu")))
    assert materialise(pm, logical_shapes(model), model.init_value, 0) == len(list(model.parameters()))
    assert model.layers["0"].mlp.w1.weight.tensor_model_parallel is True
    assert not hasattr(model.layers["0"].mlp.w3.weight, "tensor_model_parallel")


def test_profile_of_a_meta_model_materialises_one_piece_at_a_time():
    """pp_balance=profile on a meta model: every block, the embedding and the head are timed,
    each materialised alone (the model itself stays on the meta device throughout)."""
    from megatron_taper.models import build_model
    from megatron_taper.parallel.meta_init import is_meta
    from megatron_taper.parallel.pp.profile import profile_meta_layer_times

    cfg = load_config(None, ["model.n_layers=3", "model.d_model=32", "model.n_heads=2", "model.vocab_size=128",
                             "model.seq_len=16"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    materialised = []
    real_to_empty = torch.nn.Module.to_empty

    def spy(module, *args, **kwargs):
        materialised.append(sum(p.numel() for p in module.parameters()))
        return real_to_empty(module, *args, **kwargs)

    torch.nn.Module.to_empty = spy
    try:
        blocks, embedding, head = profile_meta_layer_times(model, 2, 16, torch.device("cpu"), warmup=0, iters=1,
                                                           autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    finally:
        torch.nn.Module.to_empty = real_to_empty
    assert len(blocks) == 3 and all(t > 0 for t in [*blocks, embedding, head])
    assert is_meta(model)
    total = sum(p.numel() for p in model.parameters())
    assert materialised and max(materialised) < total / 2  # never the whole model
