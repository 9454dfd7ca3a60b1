"""The memory bridge's carried state (model.bridge.carry_state): two consecutive windows with the
state carried give the values of one recurrence over the joined window, gradients stop at the
window boundary, a row that starts a document starts from the initial state, and a run stopped and
resumed at dp=2 (gloo) continues bitwise like the uninterrupted one (dp=1: test_memory_bridge.py
test_trains_and_resumes_exactly), dp=2 and tp=2 match one process, and a .npy token file (which
the row order cannot read) is one error."""
from __future__ import annotations

import pytest
import torch

from megatron_taper.config import load_config
from megatron_taper.models import build_model, family
from tests.helpers.datahelpers import corpus, dataset, tokenizer_model  # noqa: F401
from tests.helpers.harness import run_distributed
from tests.helpers.runner import TINY, train_in_process
from tests.helpers.trainer_records import fit_all

WINDOW, SEGMENT = 32, 8
SMALL = ["model.arch=bridge", "model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.mlp_width=128",
         "model.vocab_size=256", f"model.seq_len={WINDOW}", "model.taper.multiple=16", "model.bridge.slots=4",
         f"model.bridge.segment={SEGMENT}", "model.bridge.carry_state=true"]
# The same matmuls on fewer rows may sum in another order: float32 rounding (measured: 0, bit-equal)
ATOL = 1e-6
LOSS_ATOL = 1e-5


@pytest.fixture
def bridge():
    model = build_model(load_config(None, SMALL).model)
    model.init_weights(0)
    with torch.no_grad():  # the read's output projection starts at zero: give it weights to read with
        model.bridge.read.wo.weight.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(1))
    return model


def windows(model, x: torch.Tensor, continues: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bridge over x's two halves, the state of the first handed to the second (the trainer's
    way, through the family's CarriedState): (outputs [B, 2W, D], the final state)."""
    spec = family("bridge").carried_state
    first = model.bridge(x[:, :WINDOW])
    spec.put(model, spec.take(model), continues)
    second = model.bridge(x[:, WINDOW:])
    return torch.cat([first, second], 1), spec.take(model)


def test_two_windows_with_the_carried_state_equal_one_recurrence(bridge):
    x = torch.randn(2, 2 * WINDOW, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    joined = bridge.bridge(x)
    final = bridge.bridge.states(x, last=True)[:, -1]
    out, state = windows(bridge, x, torch.tensor([True, True]))
    torch.testing.assert_close(out, joined, atol=ATOL, rtol=0)
    torch.testing.assert_close(state, final, atol=ATOL, rtol=0)
    assert not state.requires_grad and bridge.bridge.carry_in is None
    # truncated backpropagation: the second window's outputs reach no input of the first through the state
    out[:, WINDOW:].sum().backward()
    assert x.grad[:, :WINDOW].abs().max() == 0 and x.grad[:, WINDOW:].abs().max() > 0
    x.grad = None
    joined[:, WINDOW:].sum().backward()
    assert x.grad[:, :WINDOW].abs().max() > 0  # (one long recurrence: it does)


def test_a_row_that_starts_a_document_starts_from_the_initial_state(bridge):
    x = torch.randn(2, 2 * WINDOW, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out, _ = windows(bridge, x, torch.tensor([True, False]))
        fresh = bridge.bridge(x[1:, WINDOW:])
        joined = bridge.bridge(x)
    torch.testing.assert_close(out[1:, WINDOW:], fresh, atol=ATOL, rtol=0)
    torch.testing.assert_close(out[:1], joined[:1], atol=ATOL, rtol=0)
    assert (fresh - joined[1:, WINDOW:]).abs().max() > 1e-3  # the reset changed what row 1 reads


@pytest.mark.multiprocess
def test_dp2_resumes_exactly_and_dp2_tp2_match_one_process(dataset, tmp_path):
    """2 gloo ranks, 2 micro-batches of 2 rows per rank and step: 4 steps straight, and stopped after
    step 2 then resumed: the logged losses are bitwise equal. The same 4 steps at tp=2 and at one
    process (2 micro-batches of 4 rows: the same accumulation, on which the auxiliary loss's
    weight depends) give the dp=2 losses within LOSS_ATOL (float32 reduction order; measured
    4.8e-7 at dp=2, 9.5e-7 at tp=2)."""
    args = [*TINY, "model.arch=bridge", "model.n_layers=2", "model.vocab_size=512", "model.bridge.slots=4",
            "model.bridge.segment=8", "model.bridge.carry_state=true", "model.bridge.aux_weight=0.1",
            "train.micro_batch=2", "train.steps=4", "train.eval_interval=0", f"data.path={dataset}",
            "train.device=cpu"]
    runs = [[*args, f"run.dir={tmp_path / 'straight'}"],
            [*args, f"run.dir={tmp_path / 'split'}", "train.exit_after=2"],
            [*args, f"run.dir={tmp_path / 'split'}"],
            [*args, f"run.dir={tmp_path / 'tp2'}", "parallel.tp=2", "train.micro_batch=4"]]
    straight, stopped, resumed, tp2 = run_distributed(fit_all, 2, runs, timeout=240)[0]
    assert sorted(stopped["loss"]) == [1, 2] and sorted(resumed["loss"]) == list(range(1, 5))
    assert resumed["loss"] == straight["loss"]
    (one,) = fit_all([[*args, f"run.dir={tmp_path / 'one'}", "train.micro_batch=4"]])
    assert sorted(one["loss"]) == list(range(1, 5))
    for name, got in (("dp2", straight), ("tp2", tp2)):
        diff = max(abs(got["loss"][s] - one["loss"][s]) for s in one["loss"])
        print(f"{name}: max |loss - one process| = {diff:.1e}")
        assert diff < LOSS_ATOL, (name, got, one)


def test_a_token_file_is_refused_with_one_error_and_no_run_folder(byte_tokens, tmp_path):
    """data.row_streams (on by itself with carry_state) reads one MDS folder: a .npy token file is
    one error naming the field, before anything is written."""
    run_dir = tmp_path / "run"
    proc = train_in_process(["--config", "configs/tiny_bridge.yaml", *TINY, "model.n_layers=2",
                             "model.bridge.segment=8", f"data.path={byte_tokens}", f"run.dir={run_dir}"], check=False)
    assert proc.returncode == 2
    assert "data.row_streams (on for a model that carries a state, e.g. model.bridge.carry_state)" in proc.stderr
    assert not run_dir.exists()
