"""benchmarks/gpu_science.sh (issue 45): its corpus builder on a made-up site-packages folder, and
the whole script in `--cpu` mode end to end, so the prepared GPU run is known to work before a GPU
is at hand. The CPU run's numbers say nothing about the taper (6 steps of a 60K-parameter model);
what is checked is that the JSON holds what the GPU run will be read by: equal tokens across the
arms, finite curves, and differences computed from the curves it reports."""
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from tests.helpers.runner import REPO


def _load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


science_corpus = _load("science_corpus")


def _site_packages(root, outside):
    """A site-packages folder: two wheels with RECORDs (one spanning two top-level entries), a module
    without one, a duplicate across packages, files to skip, and a link to a file outside the root."""
    files = {
        "alpha/__init__.py": "def alpha():\n    return 'alpha'\n" * 40,
        "alpha/README.md": "# alpha\nThe alpha package.\n" * 30,
        "alpha_extra/util.py": "SHARED = 'the same file in two packages'\n" * 20,
        "beta/core.py": "class Beta:\n    pass\n" * 50,
        "beta/copy.py": "SHARED = 'the same file in two packages'\n" * 20,
        "beta/docs.rst": "Beta\n====\n\nDocs of beta.\n" * 25,
        "gamma.py": "GAMMA = 3\n" * 60,
        "delta/notes.txt": "delta notes\n" * 45,
        "delta/binary.py": "x = 1\n\x00\x01",
        "delta/latin1.txt": None,  # written as bytes below
        "delta/empty.md": "   \n",
        "delta/lib.so": "not a text extension",
        "delta/__pycache__/cached.py": "never read",
        "alpha-1.0.dist-info/LICENSE.txt": "metadata, never read",
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if text is None:
            path.write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
        else:
            path.write_text(text)
    (root / "alpha-1.0.dist-info" / "RECORD").write_text(
        "alpha/__init__.py,sha256=x,1\nalpha/README.md,sha256=x,1\nalpha_extra/util.py,sha256=x,1\n"
        "../../bin/alpha,sha256=x,1\n")
    (root / "Beta_Pkg-2.0.dist-info").mkdir()
    (root / "Beta_Pkg-2.0.dist-info" / "RECORD").write_text("beta/core.py,,\nbeta/copy.py,,\nbeta/docs.rst,,\n")
    outside.mkdir()
    (outside / "secret.py").write_text("SECRET = 'outside the root'\n")
    (root / "delta" / "linked.py").symlink_to(outside / "secret.py")


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_corpus_held_out_by_package(tmp_path):
    """Packages from RECORDs (alpha_extra/ belongs to alpha; Beta_Pkg's name normalised), files that
    are not text, empty, in metadata or caches, or outside the root skipped by reason; exact
    duplicates written once, and never held out while a training package holds them; train and
    held-out never share a package, and the held-out bytes stay within the fraction."""
    root, outside = tmp_path / "site-packages", tmp_path / "outside"
    _site_packages(root, outside)
    assert science_corpus.package_of("alpha_extra/util.py", science_corpus.record_owners(str(root))) == "alpha"
    spans = []
    for key in range(12):
        out = tmp_path / f"corpus{key}"
        report = science_corpus.build_corpus(str(out), [str(root)], held_out_fraction=0.45, key=key)
        train, held = _records(out / "train.jsonl"), _records(out / "held_out.jsonl")
        assert report == json.loads((out / "corpus.json").read_text())
        assert report["skipped"] == {"unreadable": 0, "binary": 1, "not_utf8": 1, "empty": 1, "too_large": 0,
                                     "outside_root": 1, "duplicate": 1}
        packages = {"train": {r["package"] for r in train}, "held_out": {r["package"] for r in held}}
        assert packages["train"] | packages["held_out"] == {"alpha", "beta-pkg", "gamma", "delta"}
        assert not packages["train"] & packages["held_out"] and packages["held_out"]
        assert {s: sorted(p) for s, p in packages.items()} == {s: v["packages"] for s, v in report["splits"].items()}
        texts = [r["text"] for r in train + held]
        assert len(texts) == len(set(texts)) == 7  # 8 text files with content, one a duplicate
        assert not any("outside the root" in t or "never read" in t or "metadata" in t for t in texts)
        held_bytes = sum(len(r["text"].encode()) for r in held)
        assert held_bytes == report["splits"]["held_out"]["bytes"] <= 0.45 * report["bytes_read"]
        shared = next(r for r in train + held if r["text"].startswith("SHARED"))
        if {"alpha", "beta-pkg"} & packages["train"] and {"alpha", "beta-pkg"} & packages["held_out"]:
            spans.append(key)
            assert shared in train  # a training package holds it too: it is trained on, never held out
    assert spans, "no key split alpha and beta: the duplicate rule went unchecked"
    again = tmp_path / "again"
    science_corpus.build_corpus(str(again), [str(root)], held_out_fraction=0.45, key=0)
    assert (again / "held_out.jsonl").read_text() == (tmp_path / "corpus0" / "held_out.jsonl").read_text()
    with pytest.raises(ValueError, match="no package fits"):
        science_corpus.build_corpus(str(tmp_path / "none"), [str(root)], held_out_fraction=0.01)


def test_gpu_plan_from_the_predicted_rate(monkeypatch):
    """Planned steps (the GPU mode's rule, on the toy shape so the planner's operator count is quick):
    the three required arms' share of the time left, less their overhead, at --plan-margin x the
    layout planner's tokens/s for the device (the h200 profile, as a machine with an H200 reports
    it); evaluations over the whole held-out split up to the cap; too little time is one error
    naming --budget-s."""
    import argparse
    import dataclasses

    import megatron_taper.cost.auto_layout as auto_layout

    gpu_science = _load("gpu_science")
    monkeypatch.setattr(auto_layout, "local_device", lambda device, world: auto_layout.profile_device("h200", world))
    mode = dataclasses.replace(gpu_science.CPU, steps=0)
    args = argparse.Namespace(steps=0, plan_margin=0.6, arm_overhead_s=60.0)
    shared = gpu_science.run_settings(mode, "/data", 1)
    plan = gpu_science.plan_steps(mode, args, shared, 420.0, held_out=10_000)
    assert plan["tokens_per_step"] == 8 * 32 and plan["steps_from"] == "planned" and "h200" in plan["profile"]
    assert plan["planned_tokens_per_s"] == 0.6 * plan["predicted_tokens_per_s"] > 0
    assert plan["steps"] == int((420.0 / 3 - 60.0) * plan["planned_tokens_per_s"] / (8 * 32)) >= 20
    assert plan["tokens"] == plan["steps"] * 8 * 32
    assert plan["eval_batches"] == 10_000 // (8 * 33) == 37  # every full micro-batch of the held-out tokens
    settings = gpu_science.run_settings(mode, "/data", plan["steps"], plan["eval_batches"])
    assert f"train.eval_interval={plan['steps'] // 2}" in settings and "train.eval_batches=37" in settings
    assert gpu_science.plan_steps(mode, args, shared, 420.0, held_out=10**9)["eval_batches"] == 64  # the cap
    with pytest.raises(RuntimeError, match="raise --budget-s"):
        gpu_science.plan_steps(mode, args, shared, 3 * 60.0, held_out=10_000)


@pytest.mark.slow  # ~35 s alone: seven processes (tokenizer, 2 x preprocess, 4 training runs)
def test_gpu_science_cpu_mode(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable,
           "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_INDEX": "1"}
    proc = subprocess.run(["bash", "benchmarks/gpu_science.sh", "--cpu", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "install" not in proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == json.loads((out / "gpu_science.json").read_text())
    assert report["mode"] == "cpu" and report["device"] == "cpu" and "failed" not in report
    # the data: held out by package, both splits tokenized with the tokenizer trained on the training split
    corpus = json.loads((out / "corpus.json").read_text())
    assert not set(corpus["splits"]["train"]["packages"]) & set(corpus["splits"]["held_out"]["packages"])
    assert report["corpus"]["train"]["packages"] >= 10 and report["corpus"]["held_out"]["packages"] >= 2
    assert report["tokens"]["train"] > 100_000 and report["tokens"]["held_out"] > 1_000
    stats = json.loads((out / "data_stats.json").read_text())
    assert stats["splits"]["val"]["tokens"] == report["tokens"]["held_out"] and stats["vocab_size"] == 512
    # every arm: the same steps and tokens, finite curves, the trainer's own device line (fp32 on a CPU)
    plan, arms = report["plan"], report["arms"]
    assert plan["steps"] == 6 and plan["tokens"] == 6 * plan["tokens_per_step"] == 6 * 8 * 32
    # an evaluation reads every held-out sequence of 32 + 1 tokens that fills a micro-batch of 8 (cap 64)
    assert plan["eval_batches"] == min(64, report["tokens"]["held_out"] // (8 * 33)) > 1
    assert list(arms) == ["taper", "uniform", "uniform_seed2", "reverse"]
    for arm in arms.values():
        assert arm["returncode"] == 0 and arm["steps"] == plan["steps"] and arm["tokens_seen"] == plan["tokens"]
        assert arm["device_line"].startswith("device: cpu, fp32")
        assert [s for s, _, _ in arm["eval"]] == [3, 6] and arm["train"][-1][:2] == [6, plan["tokens"]]
        assert all(math.isfinite(loss) and loss > 0 for _, _, loss in arm["train"] + arm["eval"])
        assert arm["final_eval_loss"] == arm["eval"][-1][2]
    logs = {name: (out / arm["log"]).read_text() for name, arm in arms.items()}
    assert "mlp widths (cosine, start 1.5, uniform 96): 144 48" in logs["taper"]
    assert "mlp widths (cosine, start 0.5, uniform 96): 48 144" in logs["reverse"]
    assert "mlp widths (uniform" in logs["uniform"] and "mlp widths (uniform" in logs["uniform_seed2"]
    assert "train.seed=1" in arms["uniform_seed2"]["overrides"] and "train.seed=0" in arms["uniform"]["overrides"]
    assert arms["uniform_seed2"]["eval"] != arms["uniform"]["eval"]  # another seed: other weights and order
    # the comparison is what the curves say
    cmp, final = report["comparison"], {name: arm["final_eval_loss"] for name, arm in arms.items()}
    assert cmp["tokens"] == plan["tokens"]
    assert cmp["paired_difference"] == final["taper"] - final["uniform"]
    assert cmp["seed_noise"] == abs(final["uniform_seed2"] - final["uniform"])
    assert cmp["reverse_minus_uniform"] == final["reverse"] - final["uniform"]
    assert cmp["paired_difference_curve"] == [[t[0], t[1], t[2] - u[2]] for t, u in zip(arms["taper"]["eval"],
                                                                                     arms["uniform"]["eval"])]
    assert cmp["seed_noise_curve"] == [[s[0], s[1], abs(s[2] - u[2])] for s, u in zip(arms["uniform_seed2"]["eval"],
                                                                                      arms["uniform"]["eval"])]
    assert cmp["taper_below_uniform_by_twice_noise"] == (-cmp["paired_difference"] > 2 * cmp["seed_noise"])
    assert (out / "gpu_science.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
