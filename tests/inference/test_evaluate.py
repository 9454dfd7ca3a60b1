"""tools/evaluate.py and megatron_taper.inference.evaluate in one process.

A tiny tapered model is trained 3 steps by the Trainer (byte tokens, one process). Its final
eval record (train.eval_batches=1) must equal evaluate_checkpoint with --batches 1 exactly (the
same function on the same held-out batch); the folder exported by tools/convert_checkpoint.py
must give exactly the checkpoint's numbers; JSON shape, several lengths, and the bad inputs
(missing folder, bad --seq-lens, a model override) exit with code 2 naming the flag or key.
The multi-process layouts are in tests/inference/test_evaluate_layouts.py.
"""
import importlib.util
import json
import math

import pytest

from megatron_taper.inference.evaluate import evaluate_checkpoint
from tests.helpers.runner import REPO

MODEL = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.mlp_width=48",
         "model.taper.multiple=8", "model.vocab_size=256", "model.seq_len=32"]
TRAIN = ["train.steps=3", "train.global_batch=4", "train.micro_batch=2", "train.lr=3e-3", "train.warmup_steps=1",
         "train.log_interval=1", "train.eval_batches=1", "train.device=cpu", "train.precision=fp32",
         "run.tensorboard=false"]


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, byte_tokens):
    from megatron_taper.config import load_config
    from megatron_taper.training.trainer import Trainer

    run = tmp_path_factory.mktemp("evaluate") / "run"
    assert Trainer(load_config(None, MODEL + TRAIN + [f"run.dir={run}", f"data.path={byte_tokens}"])).fit() == 0
    return run


def test_equals_the_trainers_eval(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        eval_loss = [r["eval_loss"] for r in map(json.loads, f) if "eval_loss" in r][-1]
    result = evaluate_checkpoint(str(run_dir), batches=1)
    got = result["results"]["32"]
    assert result["step"] == 3 and result["checkpoint"].endswith("step-3")
    assert got["loss"] == eval_loss and got["tokens"] == 2 * 32 and got["batches"] == 1
    assert got["ppl"] == pytest.approx(math.exp(eval_loss))


def test_tool_several_lengths_and_exported_folder(run_dir, tmp_path, capsys):
    tool = _tool("evaluate")
    assert tool.main(["--checkpoint", str(run_dir), "--seq-lens", "16,64", "--batches", "2"]) == 0
    from_checkpoint = json.loads(capsys.readouterr().out)
    assert sorted(from_checkpoint["results"]) == ["16", "64"]
    assert from_checkpoint["layout"] == {"pp": 1, "dp": 1, "tp": 1, "zero": "none"}
    assert from_checkpoint["results"]["64"]["tokens"] == 2 * 2 * 64
    exported = tmp_path / "exported"
    _tool("convert_checkpoint").convert(str(run_dir / "checkpoints" / "step-3"), str(exported))
    assert tool.main(["--checkpoint", str(exported), "--seq-lens", "16,64", "--batches", "2"]) == 0
    from_export = json.loads(capsys.readouterr().out)
    assert from_export["results"] == from_checkpoint["results"] and from_export["step"] == 3


def test_bad_inputs_name_the_flag(run_dir, tmp_path, capsys):
    tool = _tool("evaluate")
    assert tool.main(["--checkpoint", str(tmp_path / "nowhere")]) == 2
    assert "--checkpoint" in capsys.readouterr().err
    assert tool.main(["--checkpoint", str(run_dir), "--seq-lens", "16,x"]) == 2
    assert "--seq-lens" in capsys.readouterr().err
    assert tool.main(["--checkpoint", str(run_dir), "model.d_model=64"]) == 2
    assert "model.*" in capsys.readouterr().err
    assert tool.main(["--checkpoint", str(run_dir), "parallel.tp=2"]) == 2  # one process: no tp=2
    assert "parallel.tp" in capsys.readouterr().err
