"""The lm-evaluation-harness adapter (megatron_taper.inference.lm_eval_adapter), offline.

lm_eval itself is an optional extra that launch/install.sh does not install, so the adapter is
driven here as lm_eval drives it: request objects with `.args`, read from a tiny multiple-choice
task file (JSONL) that the test writes; when lm_eval is importable, the last test also runs
lm_eval.simple_evaluate on the same task as a YAML task (skipped otherwise).

Equalities (model: 2 tapered layers, byte tokens so that tokenization splits exactly):
- loglikelihood_rolling(text) = -(mean loss x tokens) of megatron_taper.inference.evaluate on the same
  tokens ([prefix] + text through build_run's model and ParallelModel.evaluate): TOL 1e-4 on sums
  of ~60 log-probabilities in fp32 (measured ~1e-5);
- loglikelihood(context, continuation) = rolling(context + continuation) - rolling(context)
  (chain rule), TOL 1e-4; windows of a text longer than max_length score each token once;
- generate_until = greedy generation cut before the first stop string.
A sentencepiece checkpoint uses EOS as the prefix token; a bad checkpoint is one clear error.
"""
import json

import numpy as np
import pytest
import torch

from megatron_taper.config import load_config
from megatron_taper.inference.evaluate import evaluation_config
from megatron_taper.inference.generation import SamplingOptions, generate
from megatron_taper.inference.lm_eval_adapter import MegatronTaperLM
from megatron_taper.inference.load import load_parallel_weights, open_checkpoint, save_exported
from megatron_taper.models import build_model
from megatron_taper.training.held_out import evaluate_source

TOL = 1e-4
MODEL = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.mlp_width=48",
         "model.taper.multiple=8", "model.seq_len=64", "model.init_std=0.2"]
TASK = [
    {"context": "The capital of France is", "choices": [" Paris", " a fish", " blue"], "gold": 0},
    {"context": "def f(x):\n    return", "choices": [" x", " import", " ))"], "gold": 0},
    {"context": "1, 2, 3,", "choices": [" 4", " z"], "gold": 0},
]


class Request:
    def __init__(self, *args):
        self.args = args


@pytest.fixture(scope="module")
def byte_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    data = root / "bytes.npy"
    np.save(data, np.frombuffer(b"some held-out text " * 64, dtype=np.uint8).astype(np.uint16))
    cfg = load_config(None, MODEL + ["model.vocab_size=256", f"data.path={data}"])
    model = build_model(cfg.model)
    model.init_weights(3)
    return save_exported(model, cfg, str(root / "byte_model"))


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("task") / "tiny_mc.jsonl"
    path.write_text("".join(json.dumps(doc) + "\n" for doc in TASK))
    return path


class FixedBatch:
    """A BatchSource that hands out one given batch."""

    def __init__(self, tokens):
        self.tokens = tokens

    def next_batch(self):
        return self.tokens


def _accuracy(lm, docs):
    """Multiple-choice accuracy as lm_eval's `acc` computes it: argmax of the summed log-probs."""
    correct = []
    for d in docs:
        scores = [ll for ll, _ in lm.loglikelihood([Request(d["context"], c) for c in d["choices"]])]
        correct.append(int(np.argmax(scores)) == d["gold"])
    return sum(correct) / len(correct)


def _our_evaluation_logprob(checkpoint, tokens):
    """-(mean loss x predicted tokens) of megatron_taper.inference.evaluate over `tokens` (one sequence)."""
    from megatron_taper.training.build import build_run

    ref = open_checkpoint(checkpoint)
    run = build_run(evaluation_config(ref, [], batch_size=1))
    load_parallel_weights(run.model, ref)
    result = evaluate_source(run.model, FixedBatch(torch.tensor([tokens])), batches=1)
    return -result.loss * result.tokens


def test_rolling_equals_our_evaluation(byte_checkpoint):
    lm = MegatronTaperLM(checkpoint=byte_checkpoint, batch_size=2)
    text = "held-out text, scored by both paths: 0123456789"
    (rolling,) = lm.loglikelihood_rolling([Request(text)])
    ours = _our_evaluation_logprob(byte_checkpoint, [lm.prefix_token] + list(text.encode()))
    print(f"rolling {rolling:.6f} vs evaluate {ours:.6f}: |diff| = {abs(rolling - ours):.1e}")
    assert lm.prefix_token == 10 and abs(rolling - ours) < TOL


def test_loglikelihood_chain_rule_and_multiple_choice(byte_checkpoint, task_file):
    lm = MegatronTaperLM(checkpoint=byte_checkpoint, batch_size=3)
    docs = [json.loads(line) for line in task_file.read_text().splitlines()]
    requests = [Request(d["context"], c) for d in docs for c in d["choices"]]
    results = lm.loglikelihood(requests)
    assert len(results) == len(requests) and all(isinstance(g, bool) for _, g in results)
    for req, (ll, _) in zip(requests, results):
        context, continuation = req.args
        whole, head = lm.loglikelihood_rolling([Request(context + continuation), Request(context)])
        assert abs(ll - (whole - head)) < TOL, (req.args, ll, whole - head)
    assert 0 <= _accuracy(lm, docs) <= 1
    one_by_one = MegatronTaperLM(checkpoint=byte_checkpoint, batch_size=1).loglikelihood(requests)
    assert max(abs(a - b) for (a, _), (b, _) in zip(results, one_by_one)) < TOL  # padding changes nothing
    (empty, _), = lm.loglikelihood([Request("", "abc")])
    (rolled,) = lm.loglikelihood_rolling([Request("abc")])
    assert abs(empty - rolled) < TOL  # an empty context is the prefix token


def test_rolling_windows_score_each_token_once(byte_checkpoint):
    lm = MegatronTaperLM(checkpoint=byte_checkpoint, max_length=16)
    tokens = list(range(40, 90))
    windows = lm.rolling_windows(tokens)
    assert sum(n for _, n in windows) == len(tokens)
    assert all(len(w) <= 17 for w, _ in windows) and windows[-1][0][-1] == tokens[-1]
    assert [len(w) for w, _ in windows] == [17, 17, 17, 17]  # the last window keeps a full context
    (value,) = lm.loglikelihood_rolling([Request(bytes(tokens).decode())])
    assert value == pytest.approx(sum(float(lp.sum()) for lp, _ in lm.score(windows)), abs=1e-9)


def test_generate_until_stops_at_the_first_stop_string(byte_checkpoint):
    lm = MegatronTaperLM(checkpoint=byte_checkpoint)
    context = "once upon a time"
    greedy = generate(lm.model, list(context.encode()), SamplingOptions(max_new_tokens=12, temperature=0)).tokens
    text = bytes(greedy).decode("utf-8", errors="replace")
    stop = text[5:7]
    (out,) = lm.generate_until([Request(context, {"until": [stop], "max_gen_toks": 12})])
    assert out == text[:text.index(stop)]
    (full,) = lm.generate_until([Request(context, {"until": [], "max_gen_toks": 12})])
    assert full == text


def test_sentencepiece_checkpoint_and_bad_input(tmp_path):
    from megatron_taper.data.tokenizer import train_tokenizer

    docs = ["the quick brown fox jumps over the lazy dog\n" * 20, "def main():\n    return 0\n" * 20]
    train_tokenizer(docs, str(tmp_path / "tok" / "spm"), 300)
    cfg = load_config(None, MODEL + ["model.vocab_size=320", f"data.tokenizer={tmp_path / 'tok' / 'spm.model'}"])
    model = build_model(cfg.model)
    model.init_weights(0)
    lm = MegatronTaperLM(checkpoint=save_exported(model, cfg, str(tmp_path / "spm_model")))
    assert lm.prefix_token == 2  # EOS
    (ll, _), = lm.loglikelihood([Request("the quick brown", " fox")])
    assert np.isfinite(ll) and ll < 0
    with pytest.raises(ValueError, match="checkpoint="):
        MegatronTaperLM(checkpoint=str(tmp_path / "missing"))


def test_simple_evaluate_on_a_local_task(byte_checkpoint, task_file, tmp_path):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is an optional extra (.[lmeval])")
    from lm_eval.tasks import TaskManager

    from megatron_taper.inference.lm_eval_adapter import lm_eval_model_class

    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_mc.yaml").write_text(
        "task: tiny_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {task_file}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: gold\ntarget_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n")
    lm = lm_eval_model_class()(checkpoint=byte_checkpoint)
    results = lm_eval.simple_evaluate(model=lm, tasks=["tiny_mc"], task_manager=TaskManager(
        include_path=str(tmp_path / "tasks")))
    assert results["results"]["tiny_mc"]["acc,none"] == pytest.approx(_accuracy(lm, TASK))
