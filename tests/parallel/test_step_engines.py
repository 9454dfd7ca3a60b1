"""The training step's engines against one process: DDP, activation checkpointing, compile.

Every run is the Trainer on gloo processes from the harness: 10 steps of a 4-layer d=64 model with
the cosine taper (MLP widths 240, 208, 112, 80: uneven over tp=2 in units of 16), byte tokens of
real text, 4 micro-batches of 2 sequences per step at one process (2 per dp rank at dp=2, so DDP
accumulates under no_sync before its reduction), AdamW with gradient clipping at 0.5, fp32.

Tolerance: every per-step loss and the final eval loss within LOSS_ATOL = 2e-5 absolute of the
one-process run, grad norms within 1e-4 relative. fp32 reduction orders (the dp average of DDP's
buckets, tp's split matmuls, inductor's fused kernels) move a loss by ~1e-6 over 10 steps;
a real error (a missing dp average, a recompute that differs, a dropped gradient) moves it by 1e-3 or
more from the first step on. Checkpointing that recomputes the same ops is bit-identical at one
process; it is compared to the plain layout of the same parallelism where that holds.

Launches: the one-process runs in this process; every 2-process layout in one 2-process launch and
every 4-process layout in one 4-process launch (tests/helpers/sessions.py), run once per module.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_taper.config import load_config
from tests.helpers.runner import REPO
from tests.helpers.sessions import run_cases

pytestmark = pytest.mark.multiprocess

LOSS_ATOL, NORM_RTOL = 2e-5, 1e-4
MODEL = ["model.n_layers=4", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.mlp_width=160",
         "model.vocab_size=256", "model.seq_len=32", "model.taper.multiple=16", "train.device=cpu",
         "train.precision=fp32"]
TRAIN = ["train.steps=10", "train.global_batch=8", "train.micro_batch=2", "train.lr=3e-3",
         "train.warmup_steps=3", "train.grad_clip=0.5", "train.log_interval=1", "train.eval_batches=2",
         "run.tensorboard=false", "checkpoint.interval=0", "checkpoint.keep=1"]


def _fit(overrides: list[str]) -> dict:
    """Train with the Trainer (in this process group); rank 0's loss series, and which blocks of
    this rank were recomputed / compiled."""
    from megatron_taper.training.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load_config(None, MODEL + TRAIN + overrides)
    trainer = Trainer(cfg)
    module = trainer.pm.module
    wrapped = {"ddp": type(trainer.pm.dp_module).__name__ if trainer.pm.dp_module is not None else None,
               "recomputed": sorted(int(k) for k, b in module.layers.items() if "recompute" in b.options),
               "compiled": sorted(int(k) for k, b in module.layers.items() if "compile" in b.options)}
    trainer.fit()
    # behind DDP the gradients stay views into its buckets between steps (zeroed in place), so no
    # backward allocates a second fp32 copy of them beside the buckets
    wrapped["grads_in_buckets"] = all(p.grad is not None and p.grad._base is not None for p in module.parameters())
    if int(os.environ.get("RANK", 0)) != 0:
        return wrapped
    with open(os.path.join(cfg.run.dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {**wrapped, "loss": [r["loss"] for r in records if "loss" in r],
            "grad_norm": [r["grad_norm"] for r in records if "grad_norm" in r],
            "eval_loss": [r["eval_loss"] for r in records if "eval_loss" in r]}


def _assert_close(got: dict, ref: dict, dp: int = 1) -> float:
    """(eval batches are per dp rank, so the eval loss is compared at dp = 1 only)"""
    assert len(got["loss"]) == len(ref["loss"]) == 10 and len(got["eval_loss"]) == len(ref["eval_loss"]) == 1
    keys = ("loss", "eval_loss") if dp == 1 else ("loss",)
    diff = max(abs(a - b) for key in keys for a, b in zip(got[key], ref[key]))
    assert diff < LOSS_ATOL, (diff, got["loss"], ref["loss"])
    norm = max(abs(a - b) / b for a, b in zip(got["grad_norm"], ref["grad_norm"]))
    assert norm < NORM_RTOL, ("grad_norm", norm)
    return diff


def _run(tmp_path, data: str, *extra: str) -> dict:
    """One process, in this process."""
    return _fit([f"data.path={data}", f"run.dir={tmp_path}", *extra])


DDP_LAYOUTS = {"dp2": ["parallel.tp=1"], "dp2_tp2": ["parallel.tp=2"], "dp2_pp2": ["parallel.pp=2"],
               "dp2_pp2_zbv": ["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.microbatches=4"]}
CHECKPOINTING_LAYOUTS = {"tp2_pp2": ["parallel.tp=2", "parallel.pp=2"], "fsdp2_dp2": ["parallel.zero=fsdp2"]}
MODES = ("full", "selective", "op")
# every multi-process run by name: its overrides (world size 4 with tp=2 or pp=2, else 2)
LAUNCHED = {**{f"ddp_{name}": layout for name, layout in DDP_LAYOUTS.items()},
            **{f"checkpointing_{mode}_{name}": [*layout, f"train.activation_checkpointing={mode}"]
               for mode in MODES for name, layout in CHECKPOINTING_LAYOUTS.items()},
            "checkpointing_deepspeed": ["parallel.zero=deepspeed", "train.activation_checkpointing=full"]}


def _world(overrides: list[str]) -> int:
    return 4 if "parallel.tp=2" in overrides or "parallel.pp=2" in overrides else 2


@pytest.fixture(scope="module")
def launched(byte_tokens, tmp_path_factory) -> dict:
    """Rank 0's result of every LAUNCHED run: one launch per world size."""
    root = tmp_path_factory.mktemp("launched")
    ext = os.environ.get("TORCH_EXTENSIONS_DIR") or str(REPO / ".cache" / "torch_extensions")  # DeepSpeed's ops
    out = {}
    for world in (2, 4):
        names = [name for name, overrides in LAUNCHED.items() if _world(overrides) == world]
        cases = [(_fit, ([f"data.path={byte_tokens}", f"run.dir={root / name}", *LAUNCHED[name]],)) for name in names]
        out.update({name: ranks[0] for name, ranks in zip(names, run_cases(world, cases, timeout=300,
                                                                            env={"TORCH_EXTENSIONS_DIR": ext}))})
    return out


@pytest.fixture(scope="module")
def reference(byte_tokens, tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("ref"), byte_tokens)


@pytest.mark.parametrize("layout", DDP_LAYOUTS)
def test_ddp_matches_one_process(reference, launched, layout):
    """(under pipelining the chunks are not behind DDP: the step's gradients are averaged after the
    schedule, data_parallel.average_gradients)"""
    got, overrides = launched[f"ddp_{layout}"], DDP_LAYOUTS[layout]
    assert got["ddp"] == (None if "parallel.pp=2" in overrides else "DistributedDataParallel")
    assert got["grads_in_buckets"] == ("parallel.pp=2" not in overrides)
    print(f"DDP {overrides}: max |loss - one process| = {_assert_close(got, reference, dp=2):.1e}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", CHECKPOINTING_LAYOUTS)
def test_activation_checkpointing_matches_one_process(reference, launched, mode, layout):
    got, overrides = launched[f"checkpointing_{mode}_{layout}"], CHECKPOINTING_LAYOUTS[layout]
    nproc = _world(overrides)
    # rank 0 holds blocks 0-1 under pp=2 (the wide ones, by FLOPs), all four otherwise
    expected = {"full": [0, 1, 2, 3], "selective": [0, 2], "op": [0, 1, 2, 3]}[mode]
    assert got["recomputed"] == [b for b in expected if nproc == 2 or b < 2]
    dp = 2 if "parallel.zero=fsdp2" in overrides else 1
    print(f"checkpointing={mode} {overrides}: max |loss - one process| = {_assert_close(got, reference, dp):.1e}")


def test_activation_checkpointing_with_deepspeed(reference, launched):
    got = launched["checkpointing_deepspeed"]
    assert got["recomputed"] == [0, 1, 2, 3]
    print(f"checkpointing=full, DeepSpeed ZeRO-3 dp=2: max |loss - one process| = "
          f"{_assert_close(got, reference, dp=2):.1e}")


def test_compile_matches_one_process(reference, byte_tokens, tmp_path):
    got = _run(tmp_path, byte_tokens, "train.compile=true", "train.activation_checkpointing=selective")
    assert got["compiled"] == [0, 1, 2, 3] and got["recomputed"] == [0, 2]
    print(f"compile + selective checkpointing: max |loss - one process| = {_assert_close(got, reference):.1e}")
