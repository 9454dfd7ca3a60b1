"""data.mix resumes at another dp size: a one-process run of a 70/30 mixture stops with a checkpoint
at step 3 and resumes on 2 gloo processes (dp 2). The rows the two ranks read after the resume are
exactly the rows the uninterrupted one-process run read in steps 4-6, each once (none repeated,
none dropped), and before it those of steps 1-3; the losses match the uninterrupted run within
TOL = 5e-5 (dp 2 averages the two ranks' gradients, dp 1 accumulates two micro-batches: fp32
summation order differs, ~1e-6 per step here)."""
import json
import os

import pytest

from tests.helpers.datahelpers import VOCAB, corpus, dataset, second_dataset, tokenizer_model  # noqa: E402, F401
from tests.helpers.harness import run_distributed

pytestmark = pytest.mark.multiprocess

TOL = 5e-5
ARGS = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.mlp_width=64", "model.seq_len=32",
        "model.taper.multiple=16", f"model.vocab_size={VOCAB}", "train.global_batch=8", "train.micro_batch=4",
        "train.steps=6", "train.lr=3e-3", "train.warmup_steps=2", "train.log_interval=1",
        "train.eval_interval=0", "train.eval_batches=1", "train.device=cpu", "train.precision=fp32",
        "run.tensorboard=false"]


def _fit_recording(overrides):
    """Trainer(...).fit() that records (global sample index, row) of every micro-batch this rank
    trains on (the prefetch thread reads a few steps ahead: those are left out)."""
    from megatron_taper.config import load_config
    from megatron_taper.training.trainer import Trainer

    trainer = Trainer(load_config(None, overrides))
    source, seen = trainer.train_source, []
    read = source.next_batch

    def recording():
        first = source.samples_consumed + source.dp_rank * source.micro_batch
        batch = read()
        seen.extend((first + i, tuple(row.tolist())) for i, row in enumerate(batch))
        return batch

    source.next_batch = recording
    start = trainer.step
    code = trainer.fit()
    return code, seen[:(trainer.step - start) * trainer.accum * source.micro_batch]


def _losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def test_mixture_resumes_at_dp2_from_a_dp1_checkpoint_without_repeating_or_dropping(
        dataset, second_dataset, tmp_path):
    mix = json.dumps([{"path": dataset, "weight": 0.7}, {"path": second_dataset, "weight": 0.3}])
    args = ARGS + [f"data.mix={mix}"]
    code, reference = _fit_recording(args + [f"run.dir={tmp_path / 'straight'}"])
    assert code == 0 and [g for g, _ in reference] == list(range(48))
    run = str(tmp_path / "split")
    code, before = _fit_recording(args + [f"run.dir={run}", "train.exit_after=3"])
    assert code == 0 and before == reference[:24]
    results = run_distributed(_fit_recording, 2, args + [f"run.dir={run}"], timeout=240)
    assert [code for code, _ in results] == [0, 0]
    after = sorted(row for _, seen in results for row in seen)
    assert after == reference[24:]  # every global sample of steps 4-6 once, with the uninterrupted content
    assert {g for g, _ in results[0][1]}.isdisjoint(g for g, _ in results[1][1])
    straight, resumed = _losses(tmp_path / "straight"), _losses(run)
    assert sorted(resumed) == list(range(1, 7))
    assert all(abs(straight[s] - resumed[s]) <= TOL for s in straight), (straight, resumed)
