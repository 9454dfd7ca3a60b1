"""The Trainer on MDS data: resuming mid-epoch gives bitwise the uninterrupted losses (CPU, fp32)."""
import json
import os

from megatron_taper.train import main
from tests.helpers.datahelpers import VOCAB, corpus, dataset, tokenizer_model  # noqa: F401
from tests.helpers.runner import REPO

TINY = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.mlp_width=128", "model.seq_len=32",
        "model.taper.multiple=16", f"model.vocab_size={VOCAB}", "train.global_batch=8", "train.micro_batch=4",
        "train.lr=3e-3", "train.warmup_steps=3", "train.log_interval=1", "train.eval_batches=2",
        "run.tensorboard=false"]


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_resume_on_mds_data_gives_bitwise_equal_losses(dataset, tmp_path):
    common = ["--config", os.path.join(REPO, "configs", "tiny_taper.yaml"), *TINY, f"data.path={dataset}",
              "train.steps=12", "train.eval_interval=5", "train.precision=fp32", "train.device=cpu"]
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    assert main(common + [f"run.dir={straight}"]) == 0
    assert main(common + [f"run.dir={split}", "train.exit_after=7"]) == 0
    assert len([r for r in _records(split) if "loss" in r]) == 7
    assert main(common + [f"run.dir={split}"]) == 0
    a, b = _records(straight), _records(split)
    assert [r["loss"] for r in a if "loss" in r] == [r["loss"] for r in b if "loss" in r]
    assert [r["eval_loss"] for r in a if "eval_loss" in r] == [r["eval_loss"] for r in b if "eval_loss" in r]
    assert len([r for r in a if "eval_loss" in r]) == 3
