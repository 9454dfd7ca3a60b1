"""Command-line conventions: key=value, --key=value and --key value overrides, --print-config,
--list-keys, did-you-mean, and the installed console scripts."""
import json
import os
import subprocess
import sys
from importlib.metadata import distribution
from pathlib import Path

import pytest
import yaml
from megatron_taper_tools.show_model import describe

from megatron_taper.cli import key_types, normalise_overrides
from megatron_taper.config import ConfigError, all_keys, load_config
from megatron_taper.train import main
from tests.helpers.runner import REPO


def test_the_three_override_forms_mean_the_same():
    forms = [["train.steps=100", "model.taper.start=1.2", "train.compile=true", "run.dir=runs/a"],
             ["--train.steps=100", "--model.taper.start=1.2", "--train.compile=true", "--run.dir=runs/a"],
             ["--train.steps", "100", "--model.taper.start", "1.2", "--train.compile", "--run.dir", "runs/a"],
             ["--train.compile", "true", "train.steps=100", "--model.taper.start", "1.2", "--run.dir", "runs/a"]]
    expected = ["train.steps=100", "model.taper.start=1.2", "train.compile=true", "run.dir=runs/a"]
    for tokens in forms:
        assert sorted(normalise_overrides(tokens)) == sorted(expected), tokens
    cfg = load_config("configs/tiny_taper.yaml", normalise_overrides(forms[2]))
    assert (cfg.train.steps, cfg.model.taper.start, cfg.train.compile, cfg.run.dir) == (100, 1.2, "true", "runs/a")
    # a negative number is a value, a JSON list too
    assert normalise_overrides(["--train.lr", "-1e-3"]) == ["train.lr=-1e-3"]
    assert normalise_overrides(["--train.compile", "--train.steps", "5"]) == ["train.compile=true", "train.steps=5"]


@pytest.mark.parametrize("tokens, message", [
    (["--train.steps"], "--train.steps needs a value"),
    (["--train.steps", "--train.lr=1"], "--train.steps needs a value"),
    (["stray"], "unrecognised argument 'stray'"),
    (["--verbose"], "unrecognised option '--verbose'"),
])
def test_malformed_overrides_are_one_clear_error(tokens, message):
    with pytest.raises(ConfigError, match=message):
        normalise_overrides(tokens)


def test_unknown_keys_suggest_the_closest_in_every_form(capsys):
    for tokens in (["train.stepz=5"], ["--train.stepz=5"], ["--train.stepz", "5"]):
        assert main(tokens) == 2
        assert capsys.readouterr().err == "error: unknown key 'train.stepz'; did you mean 'train.steps'?\n"


def test_print_config_is_the_resolved_config_with_defaults(capsys):
    assert main(["--config", "configs/tiny_taper.yaml", "--print-config", "--train.steps", "7", "run.dir=x"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == load_config("configs/tiny_taper.yaml", ["train.steps=7", "run.dir=x"]).to_dict()
    assert printed["train"]["steps"] == 7 and printed["model"]["d_model"] == 128  # override, recipe
    assert printed["run"]["wandb"]["enabled"] is False and printed["train"]["peak_tflops"] == 0.0  # defaults


def test_list_keys_shows_every_key_with_type_and_default(capsys):
    assert main(["--list-keys"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split(maxsplit=2)[1:] for line in lines[1:]}
    assert list(rows) == all_keys()
    assert rows["train.steps"] == ["int", "1000"]
    assert rows["model.taper.schedule"] == ["str", "cosine"]
    assert rows["run.wandb.mode"] == ["str", "online"]
    assert rows["train.compile"] == ["str", "auto"]
    assert {t.__name__ for t in key_types().values()} >= {"int", "float", "str", "bool"}


def test_console_scripts_are_installed_and_run():
    scripts = {e.name: e for e in distribution("megatron_taper").entry_points if e.group == "console_scripts"}
    assert {"megatron-taper-train", "megatron-taper-preprocess", "megatron-taper-tokenizer", "megatron-taper-evaluate",
            "megatron-taper-generate", "megatron-taper-convert", "megatron-taper-sweep", "megatron-taper-plan",
            "megatron-taper-show"} <= set(scripts)
    for entry in scripts.values():
        assert callable(entry.load()), entry
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    show = subprocess.run([bin_dir / "megatron-taper-show", "--config", "configs/tiny_taper.yaml", "--json",
                           "--model.n_layers", "6"], cwd=REPO, capture_output=True, text=True, env=env)
    assert show.returncode == 0, show.stderr
    # the same function as `python tools/show_model.py` (tests/cost/test_show_model.py runs the file)
    assert json.loads(show.stdout)["widths"] == describe(load_config("configs/tiny_taper.yaml",
                                                                     ["model.n_layers=6"]))["widths"]
