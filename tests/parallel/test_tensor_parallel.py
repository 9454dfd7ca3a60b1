"""Tensor parallelism against one process, on a tapered model whose widths do not divide by tp.

Model: 3 layers, d=64, 4 query heads, 2 kv heads (GQA; at tp=4 each kv head is held by two
ranks), MLP widths 115/75/35 = 23/15/7 units of 5 (odd: no width divides by 2 or 4, shards are
uneven), vocab 101 (uneven vocab shards). Each rank also builds the one-process model from the
same seed and compares: logits (its vocabulary slice), loss, every parameter's gradient (gathered
to the logical tensor), then 10 AdamW steps with gradient clipping (losses and grad norms).

Tolerances (fp32): absolute 2e-5 on logits and loss, 1e-5 relative to the largest gradient
entry of each parameter; over 10 steps 1e-5 on the losses and 1e-4 relative on the gradient norms
(Adam amplifies fp32 rounding: measured ~1e-6 and ~1e-5).
"""
from contextlib import nullcontext

import pytest
import torch

from megatron_taper.config import load_config
from megatron_taper.parallel.context import ParallelContext
from megatron_taper.parallel.tp.layers import split_sizes
from megatron_taper.taper import layer_widths
from megatron_taper.training.build import build_run
from tests.helpers.harness import run_distributed

pytestmark = pytest.mark.multiprocess

TINY = ["model.n_layers=3", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
        "model.mlp_width=75", "model.taper.multiple=5", "model.vocab_size=101", "model.seq_len=16",
        "train.seed=7"]
TINY_VOCAB = 101
ATOL, GRAD_RTOL, STEP_ATOL, NORM_RTOL = 2e-5, 1e-5, 1e-5, 1e-4


def _tokens(cfg, step, batch=2):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_len + 1), generator=g)


def _procedure(pm, cfg, rank0):
    """The same measurements on a one-process or a tensor-parallel ParallelModel; logical tensors
    are gathered on every rank (a collective) and returned from rank 0 only."""
    def full(tensors):
        out = {n: pm.full_tensor(n, t).clone() for n, t in tensors}
        return out if rank0 else None

    model = pm.module
    rec = {"init": full((n, p.detach()) for n, p in model.named_parameters())}
    tokens = _tokens(cfg, 0)
    rec["logits"] = model(tokens[:, :-1]).detach()  # [B, S, V_r] this rank's vocabulary slice
    rec["vocab_start"] = pm.loss_fn.keywords["vocab_start"] if hasattr(pm.loss_fn, "keywords") else 0
    rec["loss"] = pm.forward_backward([tokens], nullcontext).item()
    pm.reduce_gradients()
    rec["grads"] = full((n, p.grad) for n, p in model.named_parameters())
    rec["grad_norm"] = pm.clip_gradients(1e9).item()
    # 10 AdamW steps, 2 micro-batches each, with clipping that bites; the same batch every step
    batch, steps = _tokens(cfg, 1), []
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    for _ in range(10):
        opt.zero_grad(set_to_none=True)
        loss = pm.forward_backward([batch[:1], batch[1:]], nullcontext)
        pm.reduce_gradients()
        steps.append((loss.item(), pm.clip_gradients(0.5).item()))
        opt.step()
    rec["steps"] = steps
    rec["final"] = full((n, p.detach()) for n, p in model.named_parameters())
    return rec


def _config(tp, overrides):
    return load_config(None, TINY + [f"parallel.tp={tp}"] + list(overrides))


def _tp_worker(tp, overrides):
    cfg = _config(tp, overrides)
    run = build_run(cfg)
    return _procedure(run.model, cfg, run.ctx.tp_rank == 0)


def _reference(overrides):
    cfg = _config(1, overrides)
    return _procedure(build_run(cfg, ParallelContext(1, 0, 0, 1, 1, 1, torch.device("cpu"))).model, cfg, True)


def _max_rel(got, want):
    return max(((got[n] - w).abs().max() / w.abs().max()).item() for n, w in want.items())


@pytest.mark.parametrize("tp,overrides", [
    (2, []),
    (4, []),  # kv heads (2) < tp: each kv head on two ranks
    (4, ["parallel.sequence_parallel=true", "model.tie_embeddings=true"]),
    (2, ["train.loss_chunk=7"]),  # chunked vocab-parallel loss against chunked one-process loss
])
def test_tp_matches_one_process(tp, overrides):
    results = run_distributed(_tp_worker, tp, tp, overrides, timeout=180)
    ref = _reference(overrides)
    got = results[0]
    assert got["init"].keys() == ref["init"].keys()
    assert all(torch.equal(got["init"][n], ref["init"][n]) for n in ref["init"])  # init is layout-free
    logit_err = 0.0
    for r in results:
        v0 = r["vocab_start"]
        logit_err = max(logit_err, (r["logits"] - ref["logits"][..., v0:v0 + r["logits"].shape[-1]]).abs().max().item())
    assert sum(r["logits"].shape[-1] for r in results) == TINY_VOCAB
    errors = {
        "logits": logit_err,
        "loss": max(abs(r["loss"] - ref["loss"]) for r in results),
        "grad_rel": _max_rel(got["grads"], ref["grads"]),
        "grad_norm": abs(got["grad_norm"] - ref["grad_norm"]),
        "step_loss": max(abs(a[0] - b[0]) for r in results for a, b in zip(r["steps"], ref["steps"])),
        "step_norm_rel": max(abs(a[1] - b[1]) / b[1] for a, b in zip(got["steps"], ref["steps"])),
        "final_rel": _max_rel(got["final"], ref["final"]),
    }
    print(f"tp={tp} {overrides}: " + ", ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    assert errors["logits"] < ATOL and errors["loss"] < ATOL, errors
    assert errors["grad_rel"] < GRAD_RTOL and errors["grad_norm"] < ATOL, errors
    assert errors["step_loss"] < STEP_ATOL and errors["step_norm_rel"] < NORM_RTOL, errors
    assert errors["final_rel"] < 1e-3, errors
    assert ref["steps"][-1][0] < ref["steps"][0][0] - 0.5  # it trains


def test_widths_do_not_divide_by_tp():
    mcfg = load_config(None, TINY).model
    widths = layer_widths(mcfg)
    assert widths == [115, 75, 35] and all(w % 2 and w % 4 for w in widths)
    assert split_sizes(35, 4, 5) == [10, 10, 10, 5] and split_sizes(115, 2, 5) == [60, 55]


# ---------------------------------------------------------------------------------------------
# Bad layouts are refused by preflight (tests/train/test_preflight.py); the shard arithmetic itself:


def test_split_sizes_refuses_fewer_units_than_ranks():
    with pytest.raises(ValueError, match="fewer than parallel.tp=4"):
        split_sizes(15, 4, 5)


# ---------------------------------------------------------------------------------------------
# The layers and region operations on their own (biases, each input/output mode, scatter)


def _layers_worker():
    import torch.distributed as dist

    from megatron_taper.parallel.tp.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        ShardSpec,
        gather_from_seq_region,
        scatter_to_seq_region,
    )

    group = dist.group.WORLD
    torch.manual_seed(0)  # same full layers and input on every rank
    up, down = torch.nn.Linear(8, 10), torch.nn.Linear(10, 8)
    x = torch.randn(2, 6, 8, requires_grad=True)
    want = down(torch.relu(up(x)))
    want.square().sum().backward()
    sizes = split_sizes(10, 2, 1)
    errors = {}
    for sp in (False, True):
        col = ColumnParallelLinear.from_linear(up, ShardSpec.split(0, sizes), group, "gather_seq" if sp else "copy")
        row = RowParallelLinear.from_linear(down, ShardSpec.split(1, sizes), group,
                                            "reduce_scatter_seq" if sp else "reduce")
        xin = x.detach().clone().requires_grad_()
        h = scatter_to_seq_region(xin, group) if sp else xin
        y = row(torch.relu(col(h)))
        y_full = gather_from_seq_region(y, group) if sp else y
        (y_full.square().sum() / (2 if sp else 1)).backward()  # gather's backward sums both ranks' copies
        gathered = [(ShardSpec.split(0, sizes).gather(col.weight.grad, group), up.weight.grad),
                    (ShardSpec.split(0, sizes).gather(col.bias.grad, group), up.bias.grad),
                    (ShardSpec.split(1, sizes).gather(row.weight.grad, group), down.weight.grad)]
        errors[sp] = max((y_full - want).abs().max().item(), (xin.grad - x.grad).abs().max().item(),
                         *((ours - ref).abs().max().item() for ours, ref in gathered))
        bias_grad = row.bias.grad.clone()
        if sp:  # the replicated bias saw only this rank's sequence chunk
            dist.all_reduce(bias_grad, group=group)
        errors[f"bias{sp}"] = (bias_grad - down.bias.grad).abs().max().item()
    return errors


def test_layers_and_regions_match_dense():
    for errors in run_distributed(_layers_worker, 2, timeout=60):
        assert max(errors.values()) < 1e-5, errors


# ---------------------------------------------------------------------------------------------
# Vocab-parallel cross-entropy ignores target IGNORE_INDEX (-100) exactly as F.cross_entropy


def _cross_entropy_worker():
    import torch.distributed as dist
    import torch.nn.functional as F

    from megatron_taper.models.layers import IGNORE_INDEX
    from megatron_taper.parallel.tp.layers import vocab_parallel_cross_entropy

    group, rank = dist.group.WORLD, dist.get_rank()
    sizes = split_sizes(11, 2, 1)  # [6, 5]: uneven vocabulary shards
    start = sum(sizes[:rank])
    torch.manual_seed(0)  # same full logits and targets on every rank
    logits = torch.randn(3, 5, 11) * 3
    targets = torch.randint(0, 11, (3, 5))
    targets[0, :2] = IGNORE_INDEX
    targets[2, 4] = IGNORE_INDEX
    targets[1, 0], targets[1, 1] = 5, 6  # the last id of shard 0 and the first of shard 1
    out = {}
    for name, t in (("some_ignored", targets), ("none_ignored", targets.clamp(min=0)),
                    ("all_ignored", torch.full_like(targets, IGNORE_INDEX))):
        full = logits.clone().requires_grad_()
        want = F.cross_entropy(full.flatten(0, 1), t.flatten())
        want.backward(torch.tensor(0.7))  # a non-unit upstream gradient (loss scaling, accumulation)
        local = logits[..., start:start + sizes[rank]].clone().requires_grad_()
        got = vocab_parallel_cross_entropy(local, t, group, start)
        got.backward(torch.tensor(0.7))
        out[name] = (got.item(), want.item(), local.grad, full.grad[..., start:start + sizes[rank]])
    return out


def test_vocab_parallel_cross_entropy_ignores_index():
    import math

    for result in run_distributed(_cross_entropy_worker, 2, timeout=60):
        for name, (loss, want, grad, want_grad) in result.items():
            if name == "all_ignored":  # F.cross_entropy: NaN loss (0 / 0), zero gradient
                assert math.isnan(loss) and math.isnan(want), (loss, want)
                assert torch.equal(grad, torch.zeros_like(grad)) and torch.equal(want_grad, grad)
                continue
            # float32 sums (softmax denominator, mean) reduced in a different order: measured loss
            # error <= 4.8e-7 (one float32 ulp at loss ~4), gradient error <= 1e-8
            assert abs(loss - want) <= 1e-6 * abs(want), (name, loss, want)
            assert (grad - want_grad).abs().max().item() < 1e-6, name
        ignored = result["some_ignored"][2][0, :2]
        assert torch.equal(ignored, torch.zeros_like(ignored))  # ignored positions: exactly 0 gradient


# ---------------------------------------------------------------------------------------------
# The dtype each tp collective moves under bf16 autocast (docs/precision.md)


def _collective_dtypes_worker(sp):
    from torch.utils._python_dispatch import TorchDispatchMode

    kinds = {"allreduce_": ("all_reduce", 0), "_allgather_base_": ("all_gather", 0),
             "_reduce_scatter_base_": ("reduce_scatter", 1)}  # c10d op -> (kind, full-size argument)
    seen = {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name.split("::")[-1]
            if func.namespace == "c10d" and name in kinds:
                kind, idx = kinds[name]
                t = args[idx][0] if isinstance(args[idx], (list, tuple)) else args[idx]  # allreduce_: a list
                key = (kind, str(t.dtype), t.numel())
                seen[key] = seen.get(key, 0) + 1
            return func(*args, **(kwargs or {}))

    cfg = _config(2, ["train.precision=bf16", "train.device=cpu", f"parallel.sequence_parallel={sp}"])
    run = build_run(cfg)
    assert run.bf16
    with Record():
        run.model.forward_backward([_tokens(cfg, 0)], lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    return seen


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_bf16_activation_collectives_move_bf16(sp):
    """Every [B, S, d] activation collective of a forward + backward moves bf16 (row-parallel
    outputs, the matmul inputs entering the region, their gradients), except the vocab-parallel
    embedding's, which stays fp32 (one per direction under SP: its reduce-scatter and its
    gradient's all-gather)."""
    n, act = 3, 2 * 16 * 64  # TINY: layers, B * S * d
    seen = run_distributed(_collective_dtypes_worker, 2, sp, timeout=120)[0]
    for kind in ("reduce_scatter", "all_gather") if sp else ("all_reduce",):
        assert seen.get((kind, "torch.bfloat16", act)) == 4 * n + 1, (kind, seen)
        assert seen.get((kind, "torch.float32", act)) == 1, (kind, seen)
    assert not any(numel == act and kind not in (("reduce_scatter", "all_gather") if sp else ("all_reduce",))
                   for kind, _, numel in seen), seen


def _in_place_sum_worker():
    import torch.distributed as dist

    from megatron_taper.parallel.tp.layers import reduce_from_tp_region

    group, out = dist.group.WORLD, {}
    w = torch.full((3, 3), 0.5, requires_grad=True)
    partial = w @ w  # a new tensor that no op saved: summed in place
    total = reduce_from_tp_region(partial, group)
    total.sum().backward()
    out["in_place"] = total is partial
    out["sum"] = total[0, 0].item()
    out["grad"] = w.grad[0, 0].item()
    saved = torch.sigmoid(torch.zeros(3, requires_grad=True))  # sigmoid saved its output for backward
    try:
        reduce_from_tp_region(saved, group).sum().backward()
        out["saved"] = "no error"
    except RuntimeError as e:
        out["saved"] = str(e)
    return out


def test_g_sums_in_place_and_refuses_a_saved_tensor():
    """g takes over a fresh partial sum (no clone); a tensor another op saved for backward is
    refused at backward instead of being read summed."""
    for got in run_distributed(_in_place_sum_worker, 2, timeout=60):
        assert got["in_place"] and got["sum"] == pytest.approx(2 * 0.75)  # two ranks of 3 x 0.25
        assert got["grad"] == pytest.approx(3.0)  # d/dw00 sum(w @ w) = sum_j w0j + sum_i wi0 = 3 x 0.5 x 2
        assert "modified by an inplace operation" in got["saved"], got["saved"]
