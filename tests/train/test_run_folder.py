"""What a run does to its run.dir, and what a resume may change (issue 41, issue 40's preflight once).

- run.dir pointing at a folder that is not a run (a project folder with its own config.yaml,
  metrics.jsonl and checkpoints/.tmp-step-*) is refused with one line naming it, and nothing in it
  changes: not config.yaml, not metrics.jsonl, no .lock, no logs/ (before: config.yaml was
  overwritten, metrics.jsonl truncated and .tmp-step-* / .trash-* removed recursively). Folders a
  run may use: none yet, empty, a run's, or one with only what a run writes (data_skips.json, the
  logs of a failed start).
- A refused resume (another model) leaves the run's config.yaml as it was (before: rewritten
  with the rejected config).
- The leftovers of unfinished saves are removed only in a run's checkpoints folder and only under
  the names our saves give them.
- A train.global_batch change on resume is one warning line saying what it changes (each step's
  samples; the data continues at the same sample, its position counting samples); tokens_seen
  counts the tokens really seen; where the data would not continue exactly (data.row_streams)
  it is refused.
- preflight runs once per process (run() before joining; build_run does not repeat it).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_taper.checkpoint.folders import leftovers
from megatron_taper.config import ConfigError, load_config
from megatron_taper.train import main
from megatron_taper.training.run_folder import NotARunFolder, check_run_folder, resume_changes
from tests.helpers.runner import REPO, TINY, read_metrics, train_in_process


def args(tokens, run_dir, *extra):
    return ["--config", "configs/tiny_taper.yaml", *TINY, f"data.path={tokens}", f"run.dir={run_dir}",
            "train.eval_interval=0", *extra]


def _snapshot(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in folder.rglob("*")}


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_folder_that_is_not_a_run_is_refused_and_left_untouched(byte_tokens, tmp_path, capsys):
    project = tmp_path / "project"
    _write(project / "config.yaml", "name: my project\nlearning_rate: 0.1\n")
    _write(project / "metrics.jsonl", '{"epoch": 1, "acc": 0.5}\n{"epoch": 2, "acc": 0.7}\n')
    _write(project / "checkpoints" / ".tmp-step-3" / "weights.bin", "mine")
    _write(project / "notes.txt", "do not touch")
    before = _snapshot(project)
    assert main(args(byte_tokens, project, "train.steps=2")) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: run.dir={project} is not a run folder (it holds config.yaml, metrics.jsonl, which no "
                   f"run wrote); nothing was written there: give a new or empty folder, or the folder of a run to "
                   f"resume")
    assert _snapshot(project) == before


def test_which_folders_are_run_folders(tmp_path):
    check_run_folder(str(tmp_path / "missing"))
    cases = {  # folder -> files in it, whether a run may use it
        "empty": ({}, True),
        "failed_start": ({"logs/rank-0.log": "x", ".lock": ""}, True),
        "skips_prepared": ({"data_skips.json": '{"windows": [[7, 7]]}'}, True),
        # every rank checks run.dir before joining while another rank's write check (launch_check's
        # probe file) may be there: refused, the rank exited alone and its peer waited (issue 41's drill hang)
        "skips_and_a_peers_write_check": ({"data_skips.json": "{}", ".write-check-k2j4x_9a": ""}, True),
        "run_with_notes": ({"config.yaml": "model: {d_model: 64}\ntrain: {steps: 2}\n", "notes.txt": "mine"}, True),
        "run_metrics": ({"metrics.jsonl": '{"step": 1, "loss": 5.0}\n'}, True),
        "run_checkpoints": ({"checkpoints/step-2/meta.json": "{}", "checkpoints/.tmp-step-4/x": "",
                             "checkpoints/abandoned-step-6/x": ""}, True),
        "other_config": ({"config.yaml": "name: other\n"}, False),
        "other_metrics": ({"metrics.jsonl": "epoch,acc\n"}, False),
        "other_checkpoints": ({"checkpoints/iter_0001000/x": ""}, False),
        "other_files": ({"data/tokens.npy": "", "README": ""}, False),
    }
    for name, (files, usable) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        for rel, text in files.items():
            _write(folder / rel, text)
        if usable:
            check_run_folder(str(folder))
        else:
            with pytest.raises(NotARunFolder, match=f"run.dir={folder} is not a run folder"):
                check_run_folder(str(folder))
    (tmp_path / "a_file").write_text("")
    with pytest.raises(NotARunFolder, match="is a file, not a folder"):
        check_run_folder(str(tmp_path / "a_file"))


def test_a_refused_resume_keeps_config_yaml(byte_tokens, tmp_path, capsys):
    run = tmp_path / "run"
    train_in_process(args(byte_tokens, run, "train.steps=2", "run.tensorboard=true"))
    config = (run / "config.yaml").read_text()
    events = sorted(p.name for p in (run / "tb").iterdir())
    assert len(events) == 1
    assert main(args(byte_tokens, run, "train.steps=4", "model.d_model=128", "run.tensorboard=true")) == 2
    assert "was written for another model" in capsys.readouterr().err
    assert (run / "config.yaml").read_text() == config
    assert sorted(p.name for p in (run / "tb").iterdir()) == events  # the event file is opened at the first record


def test_leftovers_are_removed_only_in_a_runs_checkpoints_folder(tmp_path):
    names = [".tmp-step-4", ".trash-step-2-0", ".trash-.tmp-step-4-1", ".tmp-step-notes", ".trash-mine", "step-2"]
    for folder in ("run", "elsewhere"):
        for name in names:
            (tmp_path / folder / "checkpoints" / name).mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text("model: {}\ntrain: {}\n")
    assert sorted(Path(p).name for p in leftovers(str(tmp_path / "run" / "checkpoints"))) == [
        ".tmp-step-4", ".trash-.tmp-step-4-1", ".trash-step-2-0"]
    assert leftovers(str(tmp_path / "elsewhere" / "checkpoints")) == []


def test_a_global_batch_change_on_resume_warns_and_counts_tokens(byte_tokens, tmp_path):
    run = tmp_path / "run"
    train_in_process(args(byte_tokens, run, "train.steps=4", "train.exit_after=2"))
    proc = train_in_process(args(byte_tokens, run, "train.steps=4", "train.global_batch=16", "train.exit_after=1"))
    assert ("warning: train.global_batch changed from 8 (checkpoint) to 16: from step 2 on each step consumes 16 "
            "sequences instead of 8; the data continues at the same sample of the same order (its position counts "
            "samples), while the learning-rate schedule counts steps and train.lr is not rescaled") in proc.stdout
    assert [r["tokens_seen"] for r in read_metrics(run)] == [8 * 32, 2 * 8 * 32, 2 * 8 * 32 + 16 * 32]
    cfg = load_config(str(REPO / "configs/tiny_taper.yaml"), args(byte_tokens, run, "train.global_batch=16")[2:])
    saved = {"train": {"steps": cfg.train.steps, "global_batch": 8}}
    assert resume_changes(saved, cfg, 2, row_streams=False)[0].startswith("warning: train.global_batch changed")
    with pytest.raises(ConfigError, match=r"train.global_batch=16 differs from the checkpoint's 8: data.row_streams "
                                          r".*resume with train.global_batch=8"):
        resume_changes(saved, cfg, 2, row_streams=True)


def test_preflight_runs_once_per_process(byte_tokens, tmp_path, monkeypatch):
    from megatron_taper.cost import preflight as checks
    from megatron_taper.training import build, trainer

    calls = []

    def counted(*a, **k):
        calls.append(1)
        return checks.preflight(*a, **k)

    monkeypatch.setattr(trainer, "preflight", counted)
    monkeypatch.setattr(build, "preflight", counted)
    train_in_process(args(byte_tokens, tmp_path / "run", "train.steps=1"))
    assert len(calls) == 1
    assert os.path.isfile(tmp_path / "run" / "config.yaml")
