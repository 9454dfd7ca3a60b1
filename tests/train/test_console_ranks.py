"""Two gloo processes, pp=2: only rank 0 prints (the summary with the pipeline plan, the step
lines); an error is one line on rank 0's stderr, nothing on rank 1's, and a traceback in each
rank's RUN/logs/rank-N.log."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from tests.helpers.harness import run_distributed

pytestmark = pytest.mark.multiprocess

MODEL = ["model.n_layers=4", "model.d_model=32", "model.n_heads=4", "model.mlp_width=96", "model.vocab_size=256",
         "model.seq_len=32", "model.taper.multiple=16", "train.device=cpu"]
TRAIN = ["train.steps=2", "train.global_batch=4", "train.micro_batch=2", "train.log_interval=1",
         "train.eval_batches=1", "run.tensorboard=false", "parallel.pp=2"]


def _train_then_fail(tokens: str, run_dir: str) -> tuple[str, str]:
    import torch
    import torch.distributed as dist

    from megatron_taper.config import load_config
    from megatron_taper.console import report_error
    from megatron_taper.training.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load_config(None, MODEL + TRAIN + [f"data.path={tokens}", f"run.dir={run_dir}"])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out):
        Trainer(cfg).fit()
    rank = dist.get_rank()
    with contextlib.redirect_stderr(err):
        try:
            raise RuntimeError(f"rank {rank} lost its data")
        except RuntimeError as e:
            report_error(e, rank, run_dir, expected=False)
    return out.getvalue(), err.getvalue()


def test_only_rank_0_prints_and_every_rank_logs_its_error(byte_tokens, tmp_path, monkeypatch):
    monkeypatch.delenv("MEGATRON_TAPER_DEBUG", raising=False)
    run = tmp_path / "run"
    (out0, err0), (out1, err1) = run_distributed(_train_then_fail, 2, byte_tokens, str(run), timeout=180)
    assert out1 == "" and err1 == ""
    assert "layout: 2 process(es) = pp 2 x dp 1 x tp 1" in out0
    assert "pipeline (1f1b, balance flops): stage 0 (pp rank 0): layers 0-" in out0 and "stage 1 (pp rank 1)" in out0
    assert out0.count(" step ") == 2 and "checkpoint saved:" in out0
    assert err0.startswith("error: RuntimeError: rank 0 lost its data (traceback in") and err0.count("\n") == 1
    for rank in (0, 1):
        log = Path(run, "logs", f"rank-{rank}.log").read_text()
        assert "Traceback (most recent call last)" in log and f"RuntimeError: rank {rank} lost its data" in log
