"""Evaluation from a tp=2 x pp=2 checkpoint equals evaluation of its one-process conversion.

The Trainer trains a 4-layer tapered model (MLP widths 75-multiples of 5, uneven over tp=2; GQA
kv heads 2) for 3 steps on 4 gloo processes at tp=2 x pp=2 and writes a sharded checkpoint.
Then, on 4 processes at that layout, evaluate_checkpoint (what tools/evaluate.py runs) reads only
each rank's pieces and evaluates at two sequence lengths; in one process the folder that
tools/convert_checkpoint.py exports from the checkpoint, and the checkpoint itself (resharded to
one process), are evaluated at the same lengths. Same held-out batches everywhere (dp=1).
TOL = 1e-5 on the mean loss (fp32; tp and pp change reduction orders only, measured ~1e-7).
"""
import importlib.util

import pytest

from megatron_taper.inference.evaluate import evaluate_checkpoint
from tests.helpers.harness import run_distributed
from tests.helpers.runner import REPO

pytestmark = pytest.mark.multiprocess

MODEL = ["model.n_layers=4", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.mlp_width=75",
         "model.taper.multiple=5", "model.vocab_size=256", "model.seq_len=16"]
TRAIN = ["train.steps=3", "train.global_batch=4", "train.micro_batch=1", "train.lr=3e-3", "train.warmup_steps=1",
         "train.log_interval=1", "train.eval_batches=1", "train.device=cpu", "train.precision=fp32",
         "run.tensorboard=false"]
LAYOUT = ["parallel.tp=2", "parallel.pp=2"]
LENGTHS = [16, 48]
TOL = 1e-5


def _train(overrides):
    from megatron_taper.config import load_config
    from megatron_taper.training.trainer import Trainer

    return Trainer(load_config(None, overrides)).fit()


def _evaluate(checkpoint, overrides):
    return evaluate_checkpoint(checkpoint, overrides, LENGTHS, batches=2, batch_size=2)


def test_tp2_pp2_checkpoint_evaluates_like_its_one_process_conversion(tmp_path, byte_tokens):
    run = tmp_path / "run"
    args = MODEL + TRAIN + LAYOUT + [f"run.dir={run}", f"data.path={byte_tokens}"]
    assert run_distributed(_train, 4, args, timeout=300) == [0] * 4
    step = run / "checkpoints" / "step-3"
    distributed = run_distributed(_evaluate, 4, str(step), LAYOUT, timeout=300)
    assert all(r == distributed[0] for r in distributed)  # every rank returns the same object
    assert distributed[0]["layout"] == {"pp": 2, "dp": 1, "tp": 2, "zero": "none"}

    spec = importlib.util.spec_from_file_location("convert_checkpoint", REPO / "tools" / "convert_checkpoint.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.convert(str(step), str(tmp_path / "exported"))
    converted = _evaluate(str(tmp_path / "exported"), [])
    resharded = _evaluate(str(step), [])
    for n in map(str, LENGTHS):
        got, ref = distributed[0]["results"][n], converted["results"][n]
        diff = abs(got["loss"] - ref["loss"])
        print(f"seq_len {n}: tp=2 x pp=2 loss {got['loss']:.6f}, one process {ref['loss']:.6f}, |diff| = {diff:.1e}")
        assert diff < TOL and got["tokens"] == ref["tokens"] == 2 * 2 * int(n)
        assert resharded["results"][n] == ref  # the sharded checkpoint at one process: the same tensors
