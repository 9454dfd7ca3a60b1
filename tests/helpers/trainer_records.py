"""Trainer runs inside a process group for the layout-parity tests: each override list trained in
turn by this process (all ranks), rank 0's logged loss and grad norm per step."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from megatron_taper.config import load_config


def logged(run_dir: str, keys: tuple[str, ...] = ("loss", "grad_norm")) -> dict[str, dict[int, float]]:
    """key -> {step: value} from RUN/metrics.jsonl."""
    with open(Path(run_dir) / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    return {key: {r["step"]: r[key] for r in records if key in r} for key in keys}


def fit_all(runs: list[list[str]]) -> list[dict]:
    """Train each complete override list with the Trainer, one after another in this process
    group; rank 0's logged losses and grad norms of each (other ranks: {})."""
    from megatron_taper.training.trainer import Trainer

    torch.set_num_threads(1)
    out = []
    for overrides in runs:
        cfg = load_config(None, overrides)
        Trainer(cfg).fit()
        out.append(logged(cfg.run.dir) if int(os.environ.get("RANK", 0)) == 0 else {})
    return out
