"""The Trainer with data.document_mask=true on MDS data (tests/helpers/datahelpers.py: library
sources cut into documents of 3-60 lines, each written as its tokens + EOS): doc_start comes from
the EOS ids the windows hold, so a run resumed mid-way sees exactly the masks an uninterrupted
one saw, and its losses (training and held-out) are bitwise the same."""
import json

import pytest

from megatron_taper.config import load_config
from megatron_taper.data.sources import build_sources, document_end_id
from megatron_taper.models.documents import document_starts
from tests.helpers.datahelpers import VOCAB, corpus, dataset, tokenizer_model  # noqa: F401
from tests.helpers.runner import TINY, losses, read_metrics, train_in_process

pytestmark = pytest.mark.multiprocess
SEQ = 128


def args(data, run_dir, *extra):
    return ["--config", "configs/tiny_taper.yaml", *TINY, f"model.vocab_size={VOCAB}", f"model.seq_len={SEQ}",
            f"data.path={data}", "data.document_mask=true", "train.steps=6", "train.eval_interval=3",
            f"run.dir={run_dir}", *extra]


def test_document_masked_run_resumes_bitwise(dataset, tmp_path):  # noqa: F811
    with open(f"{dataset}/stats.json") as f:
        eos = json.load(f)["eos_id"]
    cfg = load_config(None, ["data.document_mask=true", f"data.path={dataset}", f"model.vocab_size={VOCAB}"])
    assert document_end_id(cfg.data, VOCAB) == eos
    straight, split = tmp_path / "straight", tmp_path / "split"
    console = train_in_process(args(dataset, straight)).stdout
    assert f"attention inside documents (ended by token {eos})" in console
    train_in_process(args(dataset, split, "train.exit_after=3"))
    assert len(losses(split)) == 3
    train_in_process(args(dataset, split))
    assert losses(split) == losses(straight)
    evals = [r["eval_loss"] for r in read_metrics(straight) if "eval_loss" in r]
    assert evals and evals == [r["eval_loss"] for r in read_metrics(split) if "eval_loss" in r]
    # the run's windows hold document ends (documents average ~530 tokens): its 12 micro-batches mark starts
    train, _ = build_sources(cfg.data, seq_len=SEQ, micro_batch=4, seed=0, vocab_size=VOCAB, dp_rank=0, dp_size=1)
    starts = sum(int(document_starts(train.next_batch()[:, :-1], eos).sum()) for _ in range(12))
    assert starts >= 3, starts
