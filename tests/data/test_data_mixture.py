"""data.mix: the schedule's exactness, the mixture source against its sources, the config checks, and
a 70/30 mixture through the Trainer (realised shares logged, bitwise resume, evaluation per source).
Resume at another dp size through the Trainer: tests/data/test_data_mixture_dp.py."""
import json
import os

import numpy as np
import pytest
import torch

from megatron_taper.config import ConfigError, DataConfig, load_config
from megatron_taper.data.mixture import MixSchedule
from megatron_taper.data.sources import build_sources
from megatron_taper.inference.evaluate import evaluate_checkpoint
from megatron_taper.train import main
from tests.helpers.datahelpers import VOCAB, corpus, dataset, second_dataset, tokenizer_model  # noqa: F401
from tests.helpers.runner import REPO

SEQ = 32


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 2, 3], [0.5, 0.25, 0.125, 0.125, 3.0], [1e-3, 1.0]])
def test_schedule_counts_stay_within_depth_over_two_of_the_weights_at_every_prefix(weights):
    schedule = MixSchedule(weights)
    shares = np.array(weights, float) / sum(weights)
    counts = np.zeros(len(weights), np.int64)
    worst = 0.0
    for g in range(3000):
        source, index = schedule.locate(g)
        assert index == counts[source]  # each source's stream is read in order, nothing skipped
        counts[source] += 1
        worst = max(worst, float(np.abs(counts - shares * (g + 1)).max()))
    assert schedule.counts(3000) == counts.tolist()
    assert worst <= schedule.depth / 2
    # counts(n) needs no walk from 0: far into the stream it still sums to n and is within the bound
    far = schedule.counts(10**12 + 7)
    assert sum(far) == 10**12 + 7 and np.abs(np.array(far) - shares * (10**12 + 7)).max() <= schedule.depth / 2 + 1e-3


def _mix(a, b, wa=0.7, wb=0.3):
    return [{"path": a, "weight": wa, "name": "A"}, {"path": b, "weight": wb}]


def test_mixture_batches_are_the_located_samples_of_each_source(dataset, second_dataset):
    data = DataConfig(mix=_mix(dataset, second_dataset))
    data.validate("data")
    ranks = [build_sources(data, seq_len=SEQ, micro_batch=4, seed=5, vocab_size=VOCAB, dp_rank=r, dp_size=2)
             for r in range(2)]
    mixture = ranks[0][0]
    assert mixture.names == ["A", "upper"] and mixture.weights == {"A": 0.7, "upper": 0.3}
    seen = {}
    for _ in range(125):  # 125 calls x 2 ranks x 4 = 1000 global samples
        for r, (source, _) in enumerate(ranks):
            first = source.samples_consumed + r * 4
            for i, row in enumerate(source.next_batch()):
                name, index = source.locate(first + i)
                own = source.sources[source.names.index(name)]
                assert torch.equal(row, torch.from_numpy(own.sample(index)))
                seen[first + i] = (name, index)
    assert sorted(seen) == list(range(1000))
    by_source = {n: sorted(i for s, i in seen.values() if s == n) for n in mixture.names}
    assert by_source == {"A": list(range(700)), "upper": list(range(300))}
    assert mixture.metrics() == {"mix/A": 0.7, "mix/upper": 0.3}
    # the second source's stream runs through its epochs as it runs out (an epoch has fewer than 300)
    assert mixture.sources[1].samples_per_epoch < 300
    held_out = ranks[0][1]
    assert [(h.name, h.weight) for h in held_out] == [("A", 0.7), ("upper", 0.3)]
    assert held_out[1].make().next_batch().shape == (4, SEQ + 1)


def test_mixture_state_checks(dataset, second_dataset):
    def source(mix, dp_size=1):
        return build_sources(DataConfig(mix=mix), seq_len=SEQ, micro_batch=2, seed=5, vocab_size=VOCAB,
                             dp_rank=0, dp_size=dp_size)[0]

    a = source(_mix(dataset, second_dataset))
    for _ in range(3):
        a.next_batch()
    state = a.state_dict()
    b = source(_mix(dataset, second_dataset), dp_size=3)
    b.load_state_dict(state)
    assert b.samples_consumed == 6
    with pytest.raises(ValueError, match=r"data.mix changed .*weights \[0.7, 0.3\] in the checkpoint, now .* "
                                         r"and \[0.6, 0.4\]"):
        source(_mix(dataset, second_dataset, 0.6, 0.4)).load_state_dict(state)
    with pytest.raises(ValueError, match=r"data.mix\[1\].path changed"):
        source([{"path": dataset, "weight": 0.7, "name": "A"},
                {"path": dataset, "weight": 0.3, "name": "upper"}]).load_state_dict(state)
    with pytest.raises(ValueError, match="does not divide it"):
        source(_mix(dataset, second_dataset), dp_size=4).load_state_dict(state)
    single = build_sources(DataConfig(path=dataset), seq_len=SEQ, micro_batch=2, seed=5, vocab_size=VOCAB,
                           dp_rank=0, dp_size=1)[0]
    with pytest.raises(ValueError, match="written by a data.mix run"):
        single.load_state_dict(state)
    with pytest.raises(ValueError, match="written by a run on one data.path"):
        a.load_state_dict(single.state_dict())


def test_mix_config_from_the_command_line_and_its_errors(dataset, tmp_path):
    mix = '[{"path": "/d/a", "weight": 0.7}, {"path": "/d/b/", "weight": 0.3}]'
    cfg = load_config(None, [f"data.mix={mix}"])
    assert cfg.data.mix == [{"path": "/d/a", "weight": 0.7}, {"path": "/d/b/", "weight": 0.3}]
    assert cfg.data.mix_names() == ["a", "b"]
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  mix:\n    - {path: /d/a, weight: 2}\n    - {path: /e/a, weight: 1, name: other}\n")
    assert load_config(str(recipe)).data.mix_names() == ["a", "other"]
    bad = {
        '[{"path": "/d/a", "weight": 0}]': r"data.mix\[0\].weight must be a number > 0, got 0",
        '[{"path": "/d/a", "wieght": 1}]': r"unknown key data.mix\[0\].wieght; did you mean 'weight'\?",
        '[{"weight": 1}]': r"data.mix\[0\].path must be the path of an MDS dataset folder, got None",
        '[{"path": "/d/a.npy", "weight": 1}]': r"data.mix\[0\].path='/d/a.npy': a mixture reads MDS folders only",
        '[{"path": "/d/a", "weight": 1}, {"path": "/e/a", "weight": 1}]':
            r"data.mix\[1\]: the name 'a' is taken by data.mix\[0\]",
        '{"path": "/d/a"}': r"data.mix must be a list",
        '["/d/a"]': r"data.mix\[0\] must be a mapping",
    }
    for value, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            load_config(None, [f"data.mix={value}"])
    with pytest.raises(ConfigError, match=r"data.mix and data.path='/x' are exclusive"):
        load_config(None, [f"data.mix={mix}", "data.path=/x"])
    with pytest.raises(ValueError, match=r"data.mix\[1\].path='/nowhere': no such file or folder \(write one "):
        build_sources(DataConfig(mix=[{"path": dataset, "weight": 1}, {"path": "/nowhere", "weight": 1}]),
                      seq_len=SEQ, micro_batch=2, seed=5, vocab_size=VOCAB, dp_rank=0, dp_size=1)


TINY = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.mlp_width=64", f"model.seq_len={SEQ}",
        "model.taper.multiple=16", f"model.vocab_size={VOCAB}", "train.global_batch=40", "train.micro_batch=8",
        "train.lr=3e-3", "train.warmup_steps=3", "train.log_interval=1", "train.eval_batches=1",
        "run.tensorboard=false", "train.precision=fp32", "train.device=cpu"]


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_a_70_30_mixture_trains_logs_its_shares_resumes_bitwise_and_evaluates_per_source(
        dataset, second_dataset, tmp_path):
    mix = json.dumps(_mix(dataset, second_dataset))
    common = ["--config", os.path.join(REPO, "configs", "tiny_taper.yaml"), *TINY, f"data.mix={mix}",
              "train.steps=25", "train.eval_interval=10"]
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    assert main(common + [f"run.dir={straight}"]) == 0
    assert main(common + [f"run.dir={split}", "train.exit_after=12"]) == 0
    assert main(common + [f"run.dir={split}"]) == 0
    a, b = _records(straight), _records(split)
    kept = ("step", "loss", "grad_norm", "lr", "mix/A", "mix/upper", "eval_loss", "eval_loss/A", "eval_loss/upper")
    assert [{k: r[k] for k in kept if k in r} for r in a] == [{k: r[k] for k in kept if k in r} for r in b]
    losses = [r["loss"] for r in a if "loss" in r]
    assert len(losses) == 25 and losses == [r["loss"] for r in b if "loss" in r]
    assert losses[-1] < losses[0]
    last = [r for r in a if "loss" in r][-1]  # 25 steps x 40 = 1,000 samples
    assert abs(last["mix/A"] - 0.7) <= 0.01 and abs(last["mix/upper"] - 0.3) <= 0.01
    evals = [r for r in a if "eval_loss" in r]
    assert len(evals) == 3 and evals == [r for r in b if "eval_loss" in r]
    for r in evals:
        assert r["eval_loss"] == pytest.approx(0.7 * r["eval_loss/A"] + 0.3 * r["eval_loss/upper"], rel=1e-12)
    # tools/evaluate.py's path: each source's val split, and the mixture-weighted loss
    result = evaluate_checkpoint(os.path.join(straight, "checkpoints", "step-25"), batches=1)["results"][str(SEQ)]
    sources = result["sources"]
    assert set(sources) == {"A", "upper"} and result["tokens"] == sources["A"]["tokens"] + sources["upper"]["tokens"]
    assert result["loss"] == pytest.approx(0.7 * sources["A"]["loss"] + 0.3 * sources["upper"]["loss"], rel=1e-12)
