"""Checks before start-up and what a new user's next try needs: the tokenizer against
model.vocab_size, one fix-it line per kind of bad data.path, resume hints, a warning when
train.steps changes on resume or eval is asked for without held-out data, run.init_from (weights
only, from a checkpoint, a run folder or an export), tools/convert_checkpoint.py on a run folder."""

import pytest
from megatron_taper_tools import convert_checkpoint

from megatron_taper.data.tokenizer import train_tokenizer
from megatron_taper.inference.load import open_checkpoint
from megatron_taper.train import main
from megatron_taper.training.trainer import Trainer
from tests.helpers.runner import REPO, TINY


def args(tokens, run_dir, *extra):
    return ["--config", "configs/tiny_taper.yaml", *TINY, f"data.path={tokens}", f"run.dir={run_dir}", *extra]


@pytest.fixture(scope="module")
def tokenizer_512(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("tok") / "spm"
    text = (REPO / "README.md").read_text().split("\n\n")
    train_tokenizer(text, str(prefix), 512, seed=0)
    return str(prefix) + ".model"


def _bad_start(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "Traceback" not in err and "\n" not in err
    return err


def test_tokenizer_against_vocab_size(byte_tokens, tokenizer_512, tmp_path, capsys):
    err = _bad_start(args(byte_tokens, tmp_path / "run", f"data.tokenizer={tokenizer_512}"), capsys)
    assert err == (f"error: data.tokenizer={tokenizer_512} has 512 ids, more than model.vocab_size=256: ids >= 256 "
                   f"would index past the embedding; set model.vocab_size=512 (or more)")
    assert not (tmp_path / "run").exists()
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"text": "a"}\n')
    err = _bad_start(args(byte_tokens, tmp_path / "run", f"data.tokenizer={jsonl}"), capsys)
    assert err.startswith(f"error: data.tokenizer: {jsonl} is not a sentencepiece model (") and \
        err.endswith("pass the PREFIX.model file written by tools/train_tokenizer.py")
    from megatron_taper.config import load_config
    from megatron_taper.data.checks import check_data

    cfg = load_config("configs/tiny_taper.yaml", [*TINY, f"data.path={byte_tokens}", "model.vocab_size=640",
                                                  f"data.tokenizer={tokenizer_512}"])
    with pytest.warns(UserWarning, match=rf"model.vocab_size=640 is larger than the 512 ids of data.tokenizer="
                                         rf"{tokenizer_512}: 128 embedding and output rows are padding"):
        check_data(cfg)


def test_token_file_ids_are_checked_against_vocab_size(tmp_path, capsys, monkeypatch):
    import numpy as np

    from megatron_taper.data import checks as preflight

    monkeypatch.setattr(preflight, "TOKEN_SCAN_ELEMENTS", 1000)  # the bad id sits in the third slice
    ids = np.arange(5000, dtype=np.uint16) % 250
    ids[2345] = 300
    np.save(tmp_path / "ids.npy", ids)
    floats = tmp_path / "floats.npy"
    np.save(floats, np.zeros(10, dtype=np.float32))
    cases = {
        tmp_path / "ids.npy": f"{tmp_path / 'ids.npy'} holds token id 300 at index 2345, outside [0, "
                              "model.vocab_size=256): set model.vocab_size to the tokenizer's size or re-tokenize "
                              "the file",
        floats: f"{floats} must hold a 1-D integer token array, got float32 (10,)",
    }
    for path, message in cases.items():
        err = _bad_start(args(path, tmp_path / "run", "model.vocab_size=256"), capsys)
        assert err == f"error: data.path: {message}", err
        assert not (tmp_path / "run").exists()


def test_each_bad_data_path_gets_its_own_fix(tmp_path, capsys):
    (tmp_path / "mds" / "train").mkdir(parents=True)
    (tmp_path / "mds" / "train" / "index.json").write_text("{}")
    (tmp_path / "raw.jsonl").write_text('{"text": "a"}\n')
    cases = {
        tmp_path / "nowhere": "no such file or folder (write one with tools/preprocess_data.py --output "
                              f"{tmp_path / 'nowhere'}, or leave data.path empty for the built-in corpus)",
        tmp_path / "raw.jsonl": "is a file, not a .npy token file or an MDS folder: tokenize raw text first with "
                                f"tools/preprocess_data.py --input {tmp_path / 'raw.jsonl'} --tokenizer TOK.model "
                                "--output DIR, then data.path=DIR",
        tmp_path / "mds" / "train": f"is the train/ split of an MDS folder; pass the folder itself: "
                                    f"data.path={tmp_path / 'mds'}",
    }
    for path, fix in cases.items():
        err = _bad_start(args("", tmp_path / "run", f"data.path={path}"), capsys)
        assert err.startswith(f"error: data.path='{path}'") and err.endswith(fix), err
        assert not (tmp_path / "run").exists()


def test_resume_hints_and_warnings_and_init_from(byte_tokens, tmp_path, capsys):
    first = tmp_path / "first"
    assert main(args(byte_tokens, first, "train.steps=2", "data.eval_fraction=0", "train.eval_interval=1")) == 0
    out = capsys.readouterr().out
    assert "held-out: none" in out and "warning: train.eval_interval=1 asks for evaluation, but the data has no " \
                                       "held-out split, so none will run" in out
    # another model in the same run folder: the differing keys and the two ways out
    err = _bad_start_multiline(args(byte_tokens, first, "train.steps=2", "model.d_model=128"), capsys)
    assert "model.d_model: checkpoint 64 vs now 128" in err and "give it a new run.dir, or set run.resume=never" in err
    # train.steps changed on resume: said, with the exact way to split a run
    assert main(args(byte_tokens, first, "train.steps=3")) == 0
    assert "warning: train.steps changed from 2 (checkpoint) to 3: the learning-rate schedule (warmup + decay " \
           "over train.steps) changes from step 2 on; to split a run into parts keep train.steps and set " \
           "train.exit_after=N" in capsys.readouterr().out
    # run.init_from: a run folder, and the export of it, give the fresh run exactly its weights
    exported = tmp_path / "exported"
    assert convert_checkpoint.main([str(first), "--output", str(exported)]) == 0  # a run folder, not step-N
    saved = open_checkpoint(str(first))
    assert saved.step == 3
    from megatron_taper.config import load_config

    for source in (first, exported):
        cfg = load_config("configs/tiny_taper.yaml", args(byte_tokens, tmp_path / f"new-{source.name}", "train.steps=2",
                                     f"run.init_from={source}")[2:]).validate()
        trainer = Trainer(cfg)
        assert trainer.step == 0 and f"initialised from: {saved.path if source == first else source}" in \
            capsys.readouterr().out
        for name, param in trainer.pm.module.named_parameters():
            assert param.detach().equal(saved.tensor(name)), name
    err = _bad_start_multiline(args(byte_tokens, tmp_path / "other", "model.d_model=128",
                                    f"run.init_from={exported}"), capsys)
    assert f"run.init_from={exported} holds weights of another model" in err and "model.d_model" in err


def _bad_start_multiline(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    return err


def test_convert_checkpoint_help_names_only_its_options(capsys):
    with pytest.raises(SystemExit):
        convert_checkpoint.main(["--help"])
    out = capsys.readouterr().out
    assert "--list-keys lists the keys" in out and "see --list-keys" not in out
