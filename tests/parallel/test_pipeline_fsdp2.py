"""Several pipeline chunks per rank under fsdp2 (each chunk its own FSDP root) on gloo against one
process, at pp=2 x dp=2 (4 processes, each dp rank on its own half of every batch).

Model and data of test_pipeline.py (5 layers, cosine taper, d=64, byte tokens), fp32.
- interleaved_1f1b, driven by the Trainer for 6 steps (checkpoint at step 3 and 6): per-step
  losses, grad norms and the eval loss within test_pipeline's tolerance (2e-5 absolute; grad norm
  1e-4 relative) of the one-process run, and the step-6 weights (the checkpoint files, logical
  tensors) within 1e-5 absolute (AdamW turns gradient differences of ~1e-7 from the changed
  reduction order into weight differences of that size; measured ~5e-7). Its step-3 checkpoint
  resumes in one process, and the one process's step-3 checkpoint resumes into the chunks; both
  continue as the one-process run does (losses within 2e-5).
- zbv (ZB-V: split input / weight backward, V placement), through the ParallelModel for 3 steps:
  losses, grad norms, eval loss and the gathered weights, same tolerances; and a trace of one
  step: every FSDP unit of a chunk reduce-scatters exactly once, after the chunk's last weight
  gradient of the step (no reduction per micro-batch, none before the gradients are complete),
  the first chunk's while the other chunk still has backwards to run, and the wait for them
  (FSDP's end-of-backward callback) only after the step's last backward.
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

from megatron_taper.config import load_config
from tests.helpers.harness import run_distributed
from tests.parallel.test_pipeline import LOSS_ATOL, MODEL, NORM_RTOL, TRAIN, _batches, _fit, _series

pytestmark = pytest.mark.multiprocess

WEIGHT_ATOL = 1e-5
SHORT = ["train.steps=6", "checkpoint.interval=3"]
FSDP2 = ["parallel.pp=2", "parallel.zero=fsdp2"]


def _loop_dp(overrides: list[str], steps: int = 3, trace: bool = False) -> dict:
    """`steps` steps on batches split over the dp ranks; the dp-mean losses, grad norms, an eval
    loss, the logical weights of this rank's stage and (trace) the backward / reduce-scatter events
    of the last step."""
    from megatron_taper.training.build import build_run

    torch.set_num_threads(1)
    run = build_run(load_config(None, MODEL + TRAIN + overrides))
    cfg, pm, opt = run.cfg, run.model, run.optimizer
    dp, rank = pm.ctx.dp, pm.ctx.dp_rank
    out: dict = {"loss": [], "grad_norm": [], "events": []}
    for step in range(steps):
        mbs = _batches(step, cfg)
        mine = mbs[rank * len(mbs) // dp: (rank + 1) * len(mbs) // dp]
        with _traced(pm, out["events"]) if trace and step == steps - 1 else contextlib.nullcontext():
            loss = pm.forward_backward(mine, contextlib.nullcontext)
        if dp > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=pm.ctx.dp_group)
        out["loss"].append(float(loss))
        out["grad_norm"].append(float(pm.optimizer_step(opt, cfg.train.grad_clip)[0]))
    out["eval_loss"] = [float(pm.evaluate(_batches(99, cfg)[0], contextlib.nullcontext))]
    out["weights"] = pm.logical_state(opt)[0]
    if pm.ctx.pp > 1:
        out["units"] = {c: _param_groups(chunk) for c, chunk in zip(pm.chunk_ids, pm.chunks)}
    out["microbatches"] = len(mine)
    return out


def _param_groups(chunk) -> int:
    """FSDP units with parameters in `chunk` (a root over blocks only has none of its own; a
    unit of several blocks is one state on each of them)."""
    from torch.distributed.fsdp import FSDPModule

    states = {id(s): s for s in (m._get_fsdp_state() for m in chunk.modules() if isinstance(m, FSDPModule))}
    return sum(len(s._fsdp_param_groups) for s in states.values())


@contextlib.contextmanager
def _traced(pm, events: list):
    """Record ("grad", stage) for every backward that produces weight gradients, ("rs", stage)
    for every FSDP reduce-scatter and ("wait", stage) for FSDP's end-of-backward callback of a
    chunk root in its last-backward mode (the compute stream's wait for its reduce-scatters):
    torch's stage and FSDP2 functions, wrapped for one step."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as group_mod
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    from torch.distributed.pipelining.stage import _PipelineStageBase

    owner = {id(m): c for c, chunk in zip(pm.chunk_ids, pm.chunks) for m in chunk.modules()}
    saved = (group_mod.foreach_reduce, _PipelineStageBase.backward_one_chunk,
             _PipelineStageBase.backward_weight_one_chunk, FSDPState._root_post_backward_final_callback)
    reduce, backward, weight, final = saved

    def traced_reduce(fsdp_params, *args, **kwargs):
        events.append(("rs", owner[id(fsdp_params[0]._module_info.module)]))
        return reduce(fsdp_params, *args, **kwargs)

    def traced_final(state):
        if state._state_ctx.is_last_backward:  # (after every backward it runs, without waiting)
            events.append(("wait", owner[id(state._modules[0])]))
        return final(state)

    def traced_backward(stage, *args, full_backward=True, **kwargs):
        if full_backward:
            events.append(("grad", stage.stage_index))
        return backward(stage, *args, full_backward=full_backward, **kwargs)

    def traced_weight(stage, *args, **kwargs):
        events.append(("grad", stage.stage_index))
        return weight(stage, *args, **kwargs)

    group_mod.foreach_reduce = traced_reduce
    _PipelineStageBase.backward_one_chunk = traced_backward
    _PipelineStageBase.backward_weight_one_chunk = traced_weight
    FSDPState._root_post_backward_final_callback = traced_final
    try:
        yield
    finally:
        (group_mod.foreach_reduce, _PipelineStageBase.backward_one_chunk,
         _PipelineStageBase.backward_weight_one_chunk, FSDPState._root_post_backward_final_callback) = saved


def _chunked_runs(byte_tokens: str, run_dir: str, resume_dir: str) -> dict:
    interleaved = FSDP2 + SHORT + ["parallel.pp_schedule=interleaved_1f1b", f"data.path={byte_tokens}"]
    return {"interleaved": _fit(interleaved + [f"run.dir={run_dir}"]),
            "resumed": _fit(interleaved + [f"run.dir={resume_dir}"]),  # one process's step-3 checkpoint
            "zbv": _loop_dp(FSDP2 + ["parallel.pp_schedule=zbv"], trace=True)}


def _close(got: dict, ref: dict, steps: int) -> None:
    assert len(got["loss"]) == len(ref["loss"]) == steps
    for key in ("loss", "eval_loss"):
        assert max(abs(a - b) for a, b in zip(got[key], ref[key])) < LOSS_ATOL, (key, got[key], ref[key])
    assert max(abs(a - b) / b for a, b in zip(got["grad_norm"], ref["grad_norm"])) < NORM_RTOL


def _weights_close(got: dict, ref: dict) -> None:
    assert got and set(got) <= set(ref)
    diff = max((got[k] - ref[k]).abs().max().item() for k in got)
    assert diff < WEIGHT_ATOL, diff


def _saved_weights(run_dir) -> dict:
    """The logical weights of a run's step-6 checkpoint (written by every rank, its own pieces)."""
    import json

    from megatron_taper.checkpoint.files import CheckpointReader, iter_full_tensors

    folder = run_dir / "checkpoints" / "step-6"
    meta = json.loads((folder / "meta.json").read_text())
    return dict(iter_full_tensors(CheckpointReader(str(folder), meta["tensors"], meta["files"])))


def test_chunks_sharded_with_fsdp2_match_one_process(byte_tokens, tmp_path):
    ref_dir, dist_dir = tmp_path / "ref", tmp_path / "pp2_dp2"
    # train.eval_batches is per dp rank: the 2 x 2 held-out batches of dp=2 are one process's 4
    ref = _series(_fit(SHORT + ["train.eval_batches=4", f"data.path={byte_tokens}", f"run.dir={ref_dir}"]))
    ref_loop = _loop_dp([])
    into_chunks = tmp_path / "resume_pp2_dp2"
    (into_chunks / "checkpoints").mkdir(parents=True)
    os.symlink(ref_dir / "checkpoints" / "step-3", into_chunks / "checkpoints" / "step-3")
    results = run_distributed(_chunked_runs, 4, byte_tokens, str(dist_dir), str(into_chunks), timeout=240)

    # interleaved 1F1B + fsdp2 under the Trainer: metrics, then the weights it saved
    _close(_series(results[0]["interleaved"]), ref, 6)
    saved, expected = _saved_weights(dist_dir), _saved_weights(ref_dir)
    assert set(saved) == set(expected)
    _weights_close(saved, expected)

    # one process's step-3 checkpoint resumed into the chunks (each rank reads its chunks' shards)
    into = _series(results[0]["resumed"])
    assert len(into["loss"]) == 3
    assert max(abs(a - b) for a, b in zip(into["loss"], ref["loss"][3:])) < LOSS_ATOL

    # the step-3 checkpoint written by the 4 ranks, resumed in one process
    resumed = tmp_path / "resume_pp1"
    (resumed / "checkpoints").mkdir(parents=True)
    os.symlink(dist_dir / "checkpoints" / "step-3", resumed / "checkpoints" / "step-3")
    after = _series(_fit(SHORT + [f"data.path={byte_tokens}", f"run.dir={resumed}"]))
    assert len(after["loss"]) == 3
    assert max(abs(a - b) for a, b in zip(after["loss"], ref["loss"][3:])) < LOSS_ATOL

    # ZB-V + fsdp2: numbers, and when each chunk's gradients are reduce-scattered
    for r in results:
        got = r["zbv"]
        _close(got, ref_loop, 3)
        _weights_close(got["weights"], ref_loop["weights"])
        events, n_micro = got["events"], got["microbatches"]
        assert len(got["units"]) == 2
        last_grad = max(i for i, e in enumerate(events) if e[0] == "grad")
        for chunk, units in got["units"].items():
            grads = [i for i, e in enumerate(events) if e == ("grad", chunk)]
            reductions = [i for i, e in enumerate(events) if e == ("rs", chunk)]
            assert len(grads) == n_micro and len(reductions) == units, (chunk, events)
            assert min(reductions) > max(grads), (chunk, events)
            # the wait for a chunk's reduce-scatters comes after every backward of the step
            assert [i for i, e in enumerate(events) if e == ("wait", chunk)] > [last_grad], (chunk, events)
        # the chunk finished first reduce-scatters while the other still has backwards to run
        assert min(i for i, e in enumerate(events) if e[0] == "rs") < last_grad, events
