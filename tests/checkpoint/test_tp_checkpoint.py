"""Checkpoints hold logical tensors: a tp=2 checkpoint resumes at tp=1 and a tp=1 one at tp=2.

The Trainer runs inside the harness (tp=2 on 2 gloo processes, tp=1 on one); each interrupted
run stops with a checkpoint after 3 of 6 steps (train.exit_after) and is resumed at the other tp
size in the same run folder. Its 6 logged losses must match the uninterrupted tp=1 run within
5e-5 (fp32 differences between layouts are ~1e-6; model, AdamW state, schedule and data
position all have to carry over for that).
"""
import json
from pathlib import Path

import pytest

from tests.helpers.harness import run_distributed

pytestmark = pytest.mark.multiprocess

MODEL = ["model.n_layers=3", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
         "model.mlp_width=75", "model.taper.multiple=5", "model.vocab_size=256", "model.seq_len=16"]
TRAIN = ["train.steps=6", "train.global_batch=4", "train.micro_batch=2", "train.lr=3e-3",
         "train.warmup_steps=2", "train.log_interval=1", "train.eval_batches=1", "train.device=cpu",
         "run.tensorboard=false", "checkpoint.keep=0"]
TOL = 5e-5


def _fit(overrides):
    from megatron_taper.config import load_config
    from megatron_taper.training.trainer import Trainer

    return Trainer(load_config(None, overrides)).fit()


def _run(tp, run_dir, data, *extra):
    args = MODEL + TRAIN + [f"parallel.tp={tp}", f"run.dir={run_dir}", f"data.path={data}", *extra]
    assert run_distributed(_fit, tp, args, timeout=240) == [0] * tp


def _losses(run_dir):
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def test_checkpoint_moves_between_tp_sizes(tmp_path, byte_tokens):
    _run(1, tmp_path / "ref", byte_tokens)
    ref = _losses(tmp_path / "ref")
    assert sorted(ref) == list(range(1, 7))
    for first, second in ((2, 1), (1, 2)):
        run_dir = tmp_path / f"tp{first}_to_tp{second}"
        _run(first, run_dir, byte_tokens, "train.exit_after=3")
        assert sorted(_losses(run_dir)) == [1, 2, 3]
        _run(second, run_dir, byte_tokens)
        got = _losses(run_dir)
        assert sorted(got) == sorted(ref)
        diff = max(abs(got[s] - ref[s]) for s in ref)
        print(f"tp={first} -> tp={second}: max |loss - uninterrupted| over 6 steps = {diff:.1e}")
        assert diff < TOL, (first, second, got, ref)
        assert (run_dir / "checkpoints" / "step-3").is_dir() and (run_dir / "checkpoints" / "step-6").is_dir()
