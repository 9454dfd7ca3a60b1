"""One-process Trainer: loss falls, exact resume, crash safety, signals, bad inputs. Runs that are
killed or signalled are processes of their own; the others run in this process."""
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_taper.train import main
from megatron_taper.training.metrics import PERF_KEYS
from tests.helpers.runner import REPO, TINY, losses, read_metrics, train_in_process

pytestmark = pytest.mark.multiprocess


def args(tokens, run_dir, *extra):
    return ["--config", "configs/tiny_taper.yaml", *TINY, f"data.path={tokens}", f"run.dir={run_dir}", *extra]


def test_loss_falls_and_metrics_are_complete(byte_tokens, tmp_path):
    train_in_process(args(byte_tokens, tmp_path / "run", "train.steps=40", "run.tensorboard=true"))
    records = read_metrics(tmp_path / "run")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 41))
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_seen"):
        assert key in steps[0]
    assert steps[-1]["tokens_seen"] == 40 * 8 * 32
    first, last = sum(r["loss"] for r in steps[:5]) / 5, sum(r["loss"] for r in steps[-5:]) / 5
    assert last < first - 1.0, (first, last)
    assert any("eval_loss" in r for r in records)
    assert (tmp_path / "run" / "config.yaml").exists()
    assert (tmp_path / "run" / "checkpoints" / "step-40" / "meta.json").exists()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 41))


def test_resume_is_bitwise_exact(byte_tokens, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    train_in_process(args(byte_tokens, straight, "train.steps=40", "train.eval_interval=15"))
    train_in_process(args(byte_tokens, split, "train.steps=40", "train.eval_interval=15", "train.exit_after=20"))
    assert len(losses(split)) == 20
    assert sorted(os.listdir(split / "checkpoints")) == ["step-20"]
    train_in_process(args(byte_tokens, split, "train.steps=40", "train.eval_interval=15"))
    assert losses(split) == losses(straight)
    def computed(records):  # timing and memory (PERF_KEYS) differ between any two runs
        return [{k: v for k, v in r.items() if k not in PERF_KEYS} for r in records]

    assert computed(read_metrics(split)) == computed(read_metrics(straight))


def _start(argv):
    cmd = [sys.executable, "-m", "megatron_taper.train", *argv]
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigkill_while_writing_a_checkpoint(byte_tokens, tmp_path):
    common = ["train.steps=30", "checkpoint.interval=5", "checkpoint.keep=0", "model.d_model=128",
              "model.mlp_width=512"]
    straight = tmp_path / "straight"
    train_in_process(args(byte_tokens, straight, *common))
    for attempt in range(4):
        run = tmp_path / f"killed{attempt}"
        ckpts = run / "checkpoints"
        proc = _start(args(byte_tokens, run, *common))
        torn = None
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if ckpts.is_dir():
                tmp = [d for d in os.listdir(ckpts) if d.startswith(".tmp-step-") and d != ".tmp-step-5"]
                if tmp:
                    proc.send_signal(signal.SIGKILL)
                    torn = tmp[0]
                    break
            time.sleep(0.0005)
        proc.wait()
        if torn is not None and (ckpts / torn).exists():
            break
    else:
        pytest.fail("never caught the trainer while it was writing a checkpoint")
    complete = sorted(int(d.split("-")[1]) for d in os.listdir(ckpts) if d.startswith("step-"))
    assert int(torn.split("-")[-1]) not in complete  # the torn one is not visible as complete
    result = train_in_process(args(byte_tokens, run, *common))
    assert f"resumed from: {ckpts / f'step-{complete[-1]}'}" in result.stdout
    assert losses(run) == losses(straight)


def test_sigusr1_checkpoints_and_exits_3(byte_tokens, tmp_path):
    common = ["train.steps=400"]
    run = tmp_path / "sig"
    proc = _start(args(byte_tokens, run, *common))
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    stopped = losses(run)
    assert 3 <= len(stopped) < 400 and f"step-{len(stopped)}" in os.listdir(run / "checkpoints")
    train_in_process(args(byte_tokens, run, *common, "train.exit_after=10"))
    straight = tmp_path / "straight"
    train_in_process(args(byte_tokens, straight, *common, f"train.exit_after={len(stopped) + 10}"))
    assert losses(run) == losses(straight)


def test_non_finite_losses_stop_with_a_message(byte_tokens, tmp_path, capsys):
    code = main(args(byte_tokens, tmp_path / "nan", "model.init_std=1e30", "train.max_nonfinite=3"))
    assert code == 1
    assert "non-finite for 3 steps in a row" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["model.n_layer=2"], "unknown key 'model.n_layer'; did you mean 'model.n_layers'"),
    (["train.steps=many"], "train.steps must be an integer"),
    (["model.taper.start=2.5"], "model.taper.start=2.5 is outside the allowed range (0.0, 2.0)"),
    (["model.n_heads=3"], "model.n_heads=3 must divide model.d_model=64"),
    (["data.path=/nonexistent/tokens.npy"], "data.path: token file not found: /nonexistent/tokens.npy"),
])
def test_bad_input_is_one_clear_error_and_no_run_folder(byte_tokens, tmp_path, capsys, extra, message):
    run = tmp_path / "run"
    assert main(args(byte_tokens, run, "train.steps=2", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert not run.exists()


def _checkpointed_run(byte_tokens, tmp_path):
    run = tmp_path / "run"
    train_in_process(args(byte_tokens, run, "train.steps=4"))
    return run, run / "checkpoints" / "step-4"


def _resume_error(byte_tokens, run, capsys, *extra):
    assert main(args(byte_tokens, run, "train.steps=8", *extra)) == 2
    return capsys.readouterr().err


def test_truncated_checkpoint_is_refused(byte_tokens, tmp_path, capsys):
    run, ckpt = _checkpointed_run(byte_tokens, tmp_path)
    shard = ckpt / "shards" / "rank-00000.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    err = _resume_error(byte_tokens, run, capsys)
    assert f"{shard}: truncated or altered" in err and "no checkpoint under" in err
    assert sorted(os.listdir(run / "checkpoints")) == ["step-4"]


def test_corrupted_checkpoint_is_refused(byte_tokens, tmp_path, capsys):
    run, ckpt = _checkpointed_run(byte_tokens, tmp_path)
    shard = ckpt / "shards" / "rank-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside some record's bytes (the header is a few KB of ~100 KB)
    shard.write_bytes(bytes(data))
    err = _resume_error(byte_tokens, run, capsys, f"run.resume={ckpt}")
    assert f"{shard}: record" in err and "is corrupted (checksum mismatch)" in err
    (ckpt / "meta.json").write_text("{not json")
    assert f"{ckpt / 'meta.json'}: unreadable checkpoint metadata" in _resume_error(byte_tokens, run, capsys)


def test_auto_resume_skips_a_corrupted_newest_checkpoint(byte_tokens, tmp_path):
    straight, run = tmp_path / "straight", tmp_path / "run"
    train_in_process(args(byte_tokens, straight, "train.steps=8"))
    train_in_process(args(byte_tokens, run, "train.steps=8", "train.exit_after=6", "checkpoint.interval=3",
                   "checkpoint.keep=0"))
    assert sorted(os.listdir(run / "checkpoints")) == ["step-3", "step-6"]
    shard = run / "checkpoints" / "step-6" / "shards" / "rank-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = train_in_process(args(byte_tokens, run, "train.steps=8"))
    assert "skipping checkpoint" in proc.stderr and str(shard) in proc.stderr
    assert losses(run) == losses(straight)  # resumed at step 3, bitwise the uninterrupted run


def test_checkpoint_of_another_model_shape_is_refused(byte_tokens, tmp_path, capsys):
    run, ckpt = _checkpointed_run(byte_tokens, tmp_path)
    err = _resume_error(byte_tokens, run, capsys, "model.d_model=128", "model.taper.start=1.25")
    assert f"{ckpt} was written for another model" in err
    assert "model.d_model: checkpoint 64 vs now 128" in err and "model.taper.start: checkpoint 1.5 vs now 1.25" in err


def test_a_second_job_on_a_run_folder_in_use_is_refused_naming_the_holder(byte_tokens, tmp_path):
    """issue 41: two runs started 3 s apart on one run.dir both trained, interleaving metrics.jsonl
    and config.yaml. The main rank holds RUN/.lock (flock: freed by the kernel when its process
    ends, so a dead job's lock is taken over); a second Trainer is refused before writing anything."""
    from megatron_taper.config import ConfigError, load_config
    from megatron_taper.training.trainer import Trainer

    overrides = [*TINY, "train.steps=1", "train.device=cpu", f"data.path={byte_tokens}", f"run.dir={tmp_path / 'run'}"]
    first = Trainer(load_config(str(REPO / "configs/tiny_taper.yaml"), overrides))
    config_before = (tmp_path / "run" / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"is in use by another job .*\"pid\": " + str(os.getpid())):
        Trainer(load_config(str(REPO / "configs/tiny_taper.yaml"), overrides + ["train.lr=1e-2"]))
    assert (tmp_path / "run" / "config.yaml").read_text() == config_before  # the refused one wrote nothing
    assert first.fit() == 0  # fit releases the lock at its end
    assert Trainer(load_config(str(REPO / "configs/tiny_taper.yaml"), overrides)).step == 1  # free: it resumes


def test_the_trainer_class_is_a_loop_over_named_parts():
    """issue 40: the policies live in the parts (recovery, checkpointing, step log, train state);
    the Trainer class that calls them stays under 220 lines."""
    import ast

    tree = ast.parse((REPO / "megatron_taper/training/trainer.py").read_text())
    trainer = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Trainer")
    assert trainer.end_lineno - trainer.lineno + 1 < 220
