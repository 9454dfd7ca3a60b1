"""Checkpoint work on rank 0 never holds up the other ranks' steps.

Two DDP ranks (every step all-reduces), a checkpoint every 2 steps, keep=1: the save at step 4
prunes step-2. Rank 0's delete is made slow in a way no timing can fake: it waits until rank 1
has finished step 5. Rank 1 can only finish step 5 if rank 0 takes part in its all-reduces, so
it does only if rank 0 deletes off the training thread after the save's last collective; a delete
inside the save (as before) would wait for a step that waits for it, and give up after WAIT_S.
"""
from __future__ import annotations

import os
import re
import time

import pytest

from tests.helpers.harness import run_distributed

pytestmark = pytest.mark.multiprocess

STEPS, INTERVAL, WAIT_S = 6, 2, 20.0
ARGS = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.vocab_size=256", "model.seq_len=16",
        "train.device=cpu", "train.precision=fp32", f"train.steps={STEPS}", "train.global_batch=4",
        "train.micro_batch=2", "train.log_interval=1", "train.eval_interval=0", "run.tensorboard=false",
        f"checkpoint.interval={INTERVAL}", "checkpoint.keep=1"]


def _fit_with_slow_delete(overrides: list[str], markers: str) -> dict:
    import megatron_taper.checkpoint.folders as folders
    from megatron_taper.config import load_config
    from megatron_taper.training.trainer import Trainer

    rank = int(os.environ["RANK"])
    waited: dict[int, bool] = {}
    real_remove = folders.remove_tree

    def slow_remove(path: str) -> None:
        pruned = re.search(r"step-(\d+)$", path)
        if pruned and int(pruned.group(1)) + INTERVAL < STEPS:
            # pruned by the save at step s = pruned + INTERVAL: wait for rank 1 to finish step s + 1
            marker = os.path.join(markers, f"rank1-step-{int(pruned.group(1)) + INTERVAL + 1}")
            deadline = time.monotonic() + WAIT_S
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.05)
            waited[int(pruned.group(1))] = os.path.exists(marker)
        real_remove(path)

    folders.remove_tree = slow_remove
    trainer = Trainer(load_config(None, overrides))
    if rank == 1:
        step = trainer.train_step

        def marked_step():
            record = step()
            open(os.path.join(markers, f"rank1-step-{trainer.step}"), "w").close()
            return record

        trainer.train_step = marked_step
    code = trainer.fit()
    return {"code": code, "waited": waited,
            "left": sorted(os.listdir(os.path.join(trainer.cfg.run.dir, "checkpoints")))}


def test_slow_prune_does_not_delay_other_ranks(byte_tokens, tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    out = run_distributed(_fit_with_slow_delete, 2,
                          [*ARGS, f"data.path={byte_tokens}", f"run.dir={tmp_path / 'run'}"], str(markers),
                          timeout=120)
    assert [r["code"] for r in out] == [0, 0]
    assert out[0]["waited"] == {2: True}  # rank 1 finished step 5 while rank 0 was still deleting step-2
    assert out[0]["left"] == [f"step-{STEPS}"]  # keep=1, and nothing else left behind
