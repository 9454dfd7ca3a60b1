"""Sequence-length warmup (train.seq_len_warmup_steps, train.seq_len_warmup_start): the schedule
(TrainConfig.seq_len_at), the cut of each micro-batch into shorter windows (ParallelModel.batch_inputs),
the layouts preflight refuses, and a run stopped mid-warmup that resumes bitwise, logging the
length and an MFU at the real length."""
import contextlib
import dataclasses

import pytest
import torch

from megatron_taper.config import TrainConfig, load_config
from megatron_taper.cost.flops import model_costs
from megatron_taper.cost.preflight import preflight
from megatron_taper.models.documents import document_starts
from megatron_taper.parallel.context import ParallelContext
from megatron_taper.training.build import build_run
from megatron_taper.validation import ConfigError
from tests.helpers.datahelpers import VOCAB, corpus, dataset, tokenizer_model  # noqa: F401
from tests.helpers.runner import TINY, read_metrics, train_in_process

MODEL = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.mlp_width=64", "model.vocab_size=64",
         "model.seq_len=32", "model.taper.multiple=16"]
END_OF_DOCUMENT = 2


def test_schedule_doubles_the_length_in_equal_phases():
    t = TrainConfig(seq_len_warmup_steps=6, seq_len_warmup_start=8)
    assert t.seq_len_lengths(64) == [8, 16, 32, 64]
    assert [t.seq_len_at(step, 64) for step in range(8)] == [8, 8, 16, 16, 32, 32, 64, 64]
    off = TrainConfig()
    assert off.seq_len_lengths(64) == [64] and {off.seq_len_at(step, 64) for step in range(5)} == {64}


@pytest.mark.parametrize("arch", ["transformer", "titans"])
def test_cut_windows_equal_reading_the_short_windows(arch):
    """Cutting [b, S + 1] at length L gives the same loss and gradients, bitwise, as a batch of the
    b x S / L windows of L + 1 tokens read one after another (each target the token after its input,
    also at every cut), with documents found inside each window; a recurrent family (titans) starts
    every short window from its initial memory."""
    cfg = load_config(None, [*MODEL, f"model.arch={arch}"])
    run = build_run(cfg, ParallelContext(1, 0, 0, 1, 1, 1, torch.device("cpu")))
    pm = run.model
    pm.document_end = END_OF_DOCUMENT  # data.document_mask's switch, with this test's own end-of-document id
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, 64, (2, 33), generator=g)
    tokens[0, [5, 8, 20]] = END_OF_DOCUMENT  # an end at position 8 makes the second window start a document
    short = torch.cat([tokens[:, i:i + 9] for i in range(0, 32, 8)], dim=1).reshape(8, 9)

    def loss_and_grads(micro_batches, seq_len):
        pm.module.zero_grad()
        loss = pm.forward_backward(micro_batches, contextlib.nullcontext, seq_len=seq_len)
        return loss, {n: p.grad.clone() for n, p in pm.module.named_parameters() if p.grad is not None}

    inputs, targets, documents = pm.batch_inputs(tokens, 8)
    assert torch.equal(inputs, short[:, :-1]) and torch.equal(targets, short[:, 1:])
    assert torch.equal(documents["doc_start"], document_starts(short[:, :-1], END_OF_DOCUMENT))
    cut_loss, cut_grads = loss_and_grads([tokens], 8)
    short_loss, short_grads = loss_and_grads([short], None)
    assert cut_loss == short_loss
    assert cut_grads.keys() == short_grads.keys() and all(torch.equal(cut_grads[n], short_grads[n]) for n in cut_grads)
    whole_loss, _ = loss_and_grads([tokens], 32)
    assert whole_loss != cut_loss  # the whole window sees more context


def _refusal(*overrides: str, world: int = 1) -> str:
    cfg = load_config(None, [*MODEL, "train.seq_len_warmup_steps=4", "train.seq_len_warmup_start=8", *overrides])
    with pytest.raises(ConfigError) as e:
        preflight(cfg, world)
    return str(e.value)


def test_preflight_refuses_what_cannot_cut():
    assert "train.seq_len_warmup_start=12 must be model.seq_len=32 divided by a power of two" in _refusal(
        "train.seq_len_warmup_start=12")
    assert "divided by a power of two" in _refusal("train.seq_len_warmup_start=32")
    assert "parallel.pp=2" in _refusal("parallel.pp=2", world=2)
    assert "parallel.cp=2" in _refusal("parallel.cp=2", world=2)
    assert "data.row_streams=true" in _refusal("data.row_streams=true")
    assert "carrying its state" in _refusal("model.arch=bridge", "model.bridge.segment=4",
                                         "model.bridge.carry_state=true")
    # the family's own rule at the shortest length: the bridge's segment must be shorter than a window
    message = _refusal("model.arch=bridge", "model.bridge.segment=8")
    assert message.startswith("train.seq_len_warmup_start=8: at the warmup's first length (model.seq_len=8)")
    message = _refusal("model.seq_len=24", "train.seq_len_warmup_start=3", "parallel.tp=2",
                       "parallel.sequence_parallel=true", world=2)
    assert "(model.seq_len=3): parallel.sequence_parallel needs model.seq_len=3 divisible by parallel.tp=2" in message
    with pytest.raises(ConfigError, match="train.seq_len_warmup_start=0 is outside"):
        load_config(None, ["train.seq_len_warmup_start=0"])
    preflight(load_config(None, [*MODEL, "train.seq_len_warmup_steps=4", "train.seq_len_warmup_start=8"]), 1)


def test_run_stopped_mid_warmup_resumes_bitwise(dataset, tmp_path):  # noqa: F811
    """6 steps on MDS data with document masking, the first 4 a warmup from 16 to 64 tokens (16, 16,
    32, 32, then 64): stopped after step 3 and resumed, the losses and the held-out loss are bitwise
    the uninterrupted run's; metrics.jsonl holds each step's length, and its MFU counts the model's
    FLOPs at that length (cost/flops.py model_costs)."""
    overrides = [*TINY, f"model.vocab_size={VOCAB}", "model.seq_len=64", f"data.path={dataset}",
                 "data.document_mask=true", "train.steps=6", "train.seq_len_warmup_steps=4",
                 "train.seq_len_warmup_start=16", "train.peak_tflops=1", "train.compile=false"]
    args = ["--config", "configs/tiny_taper.yaml", *overrides]
    straight, split = tmp_path / "straight", tmp_path / "split"
    console = train_in_process([*args, f"run.dir={straight}"]).stdout
    assert "seq_len warmup: windows of 16, 32, 64 tokens over the first 4 steps" in console
    train_in_process([*args, f"run.dir={split}", "train.exit_after=3"])
    train_in_process([*args, f"run.dir={split}"])
    records = [r for r in read_metrics(straight) if "loss" in r]
    assert [r["seq_len"] for r in records] == [16, 16, 32, 32, 64, 64]
    assert [r["loss"] for r in records] == [r["loss"] for r in read_metrics(split) if "loss" in r]
    evals = [r["eval_loss"] for r in read_metrics(straight) if "eval_loss" in r]
    assert len(evals) == 1 and evals == [r["eval_loss"] for r in read_metrics(split) if "eval_loss" in r]
    model = load_config("configs/tiny_taper.yaml", overrides).model
    for r in records:  # mfu = 3 x FLOPs per token x tokens/s / peak (one process, log_interval=1)
        flops = r["mfu"] * 1e12 / (3 * r["tokens_per_s"])
        assert flops == pytest.approx(model_costs(dataclasses.replace(model, seq_len=r["seq_len"])).total_flops,
                                      rel=1e-9)
    assert model_costs(dataclasses.replace(model, seq_len=16)).total_flops < model_costs(model).total_flops
