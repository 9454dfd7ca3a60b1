"""One-process comparison of context-parallel training (tests/parallel/test_context_parallel.py
and the families' cp tests).

Every layout builds its model from the same seed (the weights are layout-free) and runs STEPS AdamW
steps of 2 micro-batches on the same token rows at every step (so the loss must fall); `compare`
checks the losses, every parameter's logical gradient at every step, the gradient norms and the
final parameters against the one-process run. Each test module states why its tolerances hold.
A layout with data.document_mask=true trains on rows that hold END_OF_DOCUMENT at fixed positions
(documents that cross cp slices and micro-batch rows), and its ParallelModel derives doc_start
from them, as the Trainer's does from the data's end-of-document id.
"""
import dataclasses
import importlib.util
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_taper.config import load_config
from megatron_taper.models import family
from megatron_taper.parallel.context import ParallelContext
from megatron_taper.training.build import build_run
from megatron_taper.training.carried import CarriedRows
from tests.helpers.runner import REPO

STEPS = 3
END_OF_DOCUMENT = 2  # data.document_mask layouts: the end-of-document id (the project's tokenizer's EOS)


@dataclass(frozen=True)
class Tolerances:
    loss: float = 2e-5  # absolute, on each step's loss
    grad: float = 1e-5  # relative to each parameter's largest gradient entry, every step
    norm: float = 1e-4  # relative, on the gradient norms
    final: float = 2e-5  # relative to each parameter's largest entry, after the last step
    # the smallest largest-gradient-entry `grad` is relative to (a gradient that is zero up to rounding
    # in exact arithmetic, e.g. attention over equal keys, is compared absolutely at grad x grad_floor)
    grad_floor: float = 1e-30


def batch(cfg, dp_rank=0, dp=1, rows=4):
    """[rows, S + 1] tokens, the same at every step; dp rank d trains rows d::dp."""
    g = torch.Generator().manual_seed(500)
    tokens = torch.randint(0, cfg.model.vocab_size, (rows, cfg.model.seq_len + 1), generator=g)
    if cfg.data.document_mask:  # documents end at 5/16, 7/16 and 3/4 of even rows, 3/8 of odd ones
        tokens[tokens == END_OF_DOCUMENT] = END_OF_DOCUMENT + 1
        s = cfg.model.seq_len
        tokens[0::2, [5 * s // 16, 7 * s // 16, 3 * s // 4]] = END_OF_DOCUMENT
        tokens[1::2, 3 * s // 8] = END_OF_DOCUMENT
    return tokens[dp_rank::dp]


def train(run, rank0, steps=STEPS):
    """`steps` optimizer steps of 2 micro-batches; losses, grad norms, every parameter's logical
    gradient at each step and its final value (gathered over tp: every rank calls full_tensor).
    A model that carries a state (models/spec.py CarriedState) carries it from each step's rows to
    the same rows at the next step, as the trainer does (carry.state_dict() after every step)."""
    pm, optimizer, ctx = run.model, run.optimizer, run.ctx
    if run.cfg.data.document_mask:
        pm.document_end = END_OF_DOCUMENT
    rec = {"loss": [], "norm": [], "grads": [], "carried": []}
    carried = family(run.cfg.model.arch).carried_state
    carry = (CarriedRows(carried, pm.module, 2, ctx.dp, ctx.dp_rank, ctx.device)
             if carried is not None and carried.enabled(run.cfg.model) else None)
    for step in range(steps):
        rows = batch(run.cfg, ctx.dp_rank, ctx.dp)
        half = rows.shape[0] // 2
        micro = [rows[:half], rows[half:]]
        if carry is not None:  # a carried state: each step's rows continue the previous step's
            micro = carry.split([(m, torch.full((m.shape[0],), step > 0)) for m in micro])
        loss = pm.forward_backward(micro, nullcontext, carry)
        if carry is not None:
            rec["carried"].append(carry.state_dict())
        pm.reduce_gradients()
        grads = {n: pm.full_tensor(n, p.grad).clone() for n, p in pm.module.named_parameters()}
        # the rest of pm.optimizer_step, which would reduce a second time (sequence parallelism's
        # tp sums of the norms' gradients are not idempotent)
        norm = pm.clip_gradients(run.cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=pm.dp_module is None)
        if ctx.dp > 1:  # the step's loss: the mean over dp ranks (as the Trainer's)
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=ctx.dp_group)
        rec["loss"].append(float(loss))
        rec["norm"].append(float(norm))
        rec["grads"].append(grads)
    rec["final"] = {n: pm.full_tensor(n, p.detach()).clone() for n, p in pm.module.named_parameters()}
    return rec if rank0 else None


def build(overrides, ctx: ParallelContext | None = None):
    """build_run of the config of `overrides`; with data.document_mask the end-of-document id is this
    harness's (`train` sets it: there is no data folder whose stats.json build_run would read)."""
    cfg = load_config(None, list(overrides))
    run = build_run(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, document_mask=False)), ctx)
    return dataclasses.replace(run, cfg=cfg)


def worker(layouts):
    """Each layout (a list of config overrides) in turn on these processes; rank 0's records."""
    out = []
    for overrides in layouts:
        run = build(overrides)
        out.append(train(run, run.ctx.rank == 0))
    return out


def stage_worker(layouts, steps=STEPS):
    """As `worker`, also for layouts with pp > 1: the records of each pipeline stage's first rank
    (dp, cp and tp rank 0; None on the others), to be joined by `merge_stages`."""
    out = []
    for overrides in layouts:
        run = build(overrides)
        ctx = run.ctx
        out.append(train(run, ctx.dp_rank == 0 and ctx.cp_rank == 0 and ctx.tp_rank == 0, steps))
    return out


def merge_stages(per_rank):
    """run_distributed's per-rank results of `stage_worker` -> one record per layout: losses and
    norms (the same on every rank) from the first stage, gradients and final values of every stage."""
    merged = []
    for layout in range(len(per_rank[0])):
        recs = [r[layout] for r in per_rank if r[layout] is not None]
        grads = [{n: g for part in step for n, g in part.items()} for step in zip(*(rec["grads"] for rec in recs))]
        merged.append({"loss": recs[0]["loss"], "norm": recs[0]["norm"], "grads": grads,
                       "final": {n: w for rec in recs for n, w in rec["final"].items()}})
    return merged


def reference(overrides, steps=STEPS):
    """The one-process records of the layout's model (its parallel.* overrides are left out)."""
    model_only = [o for o in overrides if not o.startswith("parallel.")]
    run = build(model_only, ParallelContext(1, 0, 0, 1, 1, 1, torch.device("cpu")))
    return train(run, True, steps)


def compare(got, ref, label, tol: Tolerances | None = None):
    """Assert `got` (a layout's records) equals `ref` (one process) within `tol` (default: the
    Transformer's, Tolerances()); prints the errors."""
    tol = tol or Tolerances()
    rel = lambda a, b, floor=1e-30: ((a - b).abs().max() / b.abs().max().clamp(min=floor)).item()  # noqa: E731
    errors = {
        "loss": max(abs(a - b) for a, b in zip(got["loss"], ref["loss"])),
        "grad_rel": max(rel(g[n], r[n], tol.grad_floor) for g, r in zip(got["grads"], ref["grads"]) for n in r),
        "norm_rel": max(abs(a - b) / b for a, b in zip(got["norm"], ref["norm"])),
        "final_rel": max(rel(got["final"][n], w) for n, w in ref["final"].items()),
    }
    print(f"{label}: " + ", ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    assert got["grads"][0].keys() == ref["grads"][0].keys()
    assert errors["loss"] < tol.loss and errors["grad_rel"] < tol.grad, errors
    assert errors["norm_rel"] < tol.norm and errors["final_rel"] < tol.final, errors
    assert ref["loss"][-1] < ref["loss"][0]  # it trains


def c10d_counter():
    """benchmarks/context_parallel.py's count of the c10d calls this rank makes while active (a
    context manager; `.bytes` per kind: collective buffers, point-to-point sends)."""
    spec = importlib.util.spec_from_file_location("context_parallel", REPO / "benchmarks" / "context_parallel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.p2p_counter()
