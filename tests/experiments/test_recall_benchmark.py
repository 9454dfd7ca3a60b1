"""benchmarks/recall.py's options: the Transformer with a short convolution (causal, equal
parameters), the early stop on held-out accuracy, and the summary over seeds (tiny sizes)."""
from __future__ import annotations

import argparse
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import recall  # noqa: E402

VOCAB = 16 + 8 + 1  # keys, values, filler


def test_short_convolution_is_causal_and_keeps_the_parameters():
    cfg = recall.model_config("transformer_conv", 128, 32, VOCAB, 16, [])
    model = recall.build("transformer_conv", cfg, 0)
    taps = [p for n, p in model.named_parameters() if n.endswith(".taps")]
    assert len(taps) == 3 * cfg.n_layers and all(t.shape[1] == recall.SHORT_CONV_TAPS for t in taps)
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 20] = (changed[:, 20] + 1) % VOCAB
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :20], after[:, :20])  # nothing reaches an earlier position
    assert not torch.allclose(before[:, 20:], after[:, 20:])
    target = recall.model_costs(recall.model_config("transformer", 128, 32, VOCAB, 16, [])).total_params
    width = recall.matched_width("transformer_conv", target, 128, 32, VOCAB, 16, [])
    built = recall.build("transformer_conv", recall.model_config("transformer_conv", width, 32, VOCAB, 16, []), 0)
    assert width < 128 and abs(sum(p.numel() for p in built.parameters()) - target) / target < 0.02


def args(**changes) -> argparse.Namespace:
    base = dict(steps=6, warmup=2, batch=4, eval=4, lr=5e-3, keys=16, values=8, segment=16, seed=0,
                eval_every=2, patience=1, min_delta=1.0, eval_chunks=[], overrides=[])
    return argparse.Namespace(**{**base, **changes})


def test_early_stop_and_summary():
    name = "transformer_conv"
    # min_delta 1.0: no evaluation can beat the first by a whole accuracy point, so with patience 1
    # the run stops at the second evaluation (step 4 of 6) as a plateau
    stopped = recall.train_and_evaluate(name, args(), VOCAB, 64, [16])
    assert stopped["stopped"] == "plateau" and stopped["steps_run"] == 4
    assert [c["step"] for c in stopped["learning_curve"]] == [2, 4]
    full = recall.train_and_evaluate(name, args(seed=1, min_delta=0.0, patience=10), VOCAB, 64, [16])
    assert full["stopped"] == "budget" and full["steps_run"] == 6 and len(full["learning_curve"]) == 3
    reports = [{"seed": r_seed, "values": 8, "results": [r]} for r_seed, r in ((0, stopped), (1, full))]
    row, = recall.summarise(reports)["rows"]
    accs = [stopped["accuracy"][16], full["accuracy"][16]]
    assert row["mean"] == pytest.approx(sum(accs) / 2, abs=1e-4) and [r["seed"] for r in row["runs"]] == [0, 1]
    assert row["std"] == pytest.approx(abs(accs[0] - accs[1]) / 2 ** 0.5, abs=1e-4)
    assert "| " + name + " |" in recall.summary_markdown(recall.summarise(reports))
