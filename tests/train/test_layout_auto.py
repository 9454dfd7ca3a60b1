"""parallel.layout=auto (2 processes; 4 marked slow): the trainer picks the fastest predicted
layout that fits the memory per rank it finds (megatron_taper/cost/auto_layout.py choose_layout), says why,
and trains; a model that cannot fit is refused before any process group with one error naming
the nearest layout; ranks that chose differently (nodes with other memory) stop alike before the
mesh is built."""
from __future__ import annotations

import re

import pytest
import yaml

from tests.helpers.harness import run_distributed
from tests.helpers.runner import TINY, read_metrics, run_train, train_in_process


@pytest.mark.multiprocess
def test_layout_auto_picks_a_layout_and_trains(tmp_path, byte_tokens):
    run = tmp_path / "run"
    proc = run_train([*TINY, f"data.path={byte_tokens}", "parallel.layout=auto", "train.steps=2",
                      f"run.dir={run}", "checkpoint.interval=0"], nproc=2)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("layout auto: ")]
    assert len(lines) == 1, proc.stdout[-2000:]
    chosen = dict(kv.split("=", 1) for kv in re.search(r"\(([^()]*)\): the fastest", lines[0]).group(1).split())
    assert "fit" in lines[0] and "CPU:" in lines[0]
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    for key, value in chosen.items():
        section, name = key.split(".")
        assert str(resolved[section][name]).lower() == value, key
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2]


def test_layout_auto_refuses_a_model_that_cannot_fit(tmp_path):
    proc = train_in_process([*TINY, "parallel.layout=auto", "parallel.layout_memory_gb=0.0001",
                             f"run.dir={tmp_path / 'run'}"], check=False)
    assert proc.returncode == 2
    assert "parallel.layout=auto: no legal layout fits 1 x 0.0001 GiB (cpu): the nearest, " in proc.stderr
    assert "i.e. devices of" in proc.stderr and not (tmp_path / "run").exists()


def _join_with(chosen_by_rank: list[str]) -> str:
    import torch.distributed as dist

    from megatron_taper.config import ParallelConfig
    from megatron_taper.parallel.context import init_parallel
    from megatron_taper.validation import ConfigError

    try:
        init_parallel(ParallelConfig(), "cpu", chosen_layout=chosen_by_rank[dist.get_rank()])
    except ConfigError as e:
        return str(e)
    return "joined"


@pytest.mark.multiprocess
def test_ranks_that_chose_different_layouts_stop_before_the_mesh():
    assert run_distributed(_join_with, 2, ["parallel.tp=1", "parallel.tp=1"]) == ["joined", "joined"]
    errors = run_distributed(_join_with, 2, ["parallel.tp=1", "parallel.tp=2"])
    assert errors[0] == errors[1] and errors[0].startswith(
        "parallel.layout=auto chose different layouts on different ranks (1 rank(s) from rank 0: parallel.tp=1; "
        "1 rank(s) from rank 1: parallel.tp=2)")
