"""Fault drill: one run of launch/torchrun.sh per injected fault (MEGATRON_TAPER_FAULT), each
against an uninterrupted run of the same config; run it on the cluster's nodes before a long run.

    python benchmarks/fault_drill.py [--nproc 2] [--faults kill,stop,...] [--step 6] [--rank 1]
                                     [--work DIR] [key=value ...]

Default config: a tiny model on the built-in corpus, 12 steps, a checkpoint every 2 steps,
fault.step_timeout_s=10 (for `stop`), fault.rollback_after=1 and fault.spike_factor=3 with
fault.spike_rollback=true (for `nan` and `spike`); key=value overrides are added. A run that ends
with exit 3 (`term`: stopped after a checkpoint) is started again with the same command, as the
slurm script's requeue would.

Prints one JSON object: {"config": ..., "rows": [one per fault]}, each row: fault, rank, step,
finished (the run reached train.steps), bitwise_equal (every step's loss and grad norm and every
checkpoint record's sha256 equal to the uninterrupted run's, extra_checkpoints: those it wrote
besides, e.g. a stop's own at the step it stopped; for nan and spike, to a run that
skipped the same data window from the start), seconds_to_training (the fault firing to the first
step after it, from RUN/logs/faults.jsonl; null where no restart or rollback happens), restarts,
and console: the lines the run printed about it (hang, rollback, spike, straggler, error,
torchrun.sh, and torchrun's line naming the worker that failed).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAULTS = ("kill", "stop", "term", "raise", "nan", "spike", "sleep", "write_fail")
BASE = ["--config", "configs/tiny_taper.yaml", "model.n_layers=2", "model.d_model=64", "model.n_heads=4",
        "model.mlp_width=128", "model.seq_len=32", "model.taper.multiple=16",
        "train.global_batch=8", "train.micro_batch=4", "train.steps=12", "train.log_interval=1",
        "train.eval_interval=0", "checkpoint.interval=2", "checkpoint.keep=0", "run.tensorboard=false",
        "fault.step_timeout_s=10", "fault.rollback_after=1", "fault.spike_factor=3", "fault.spike_rollback=true"]
# the trainer's lines about a fault, and torchrun's line naming the failed worker
SAID = ("hang:", "rollback:", "loss spike", "straggler:", "error:", "[torchrun.sh]", "resumed from", "not written",
        "failed (exitcode")


def launch(nproc: int, args: list[str], fault: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VENV": sys.prefix, "MEGATRON_TAPER_FAULT": fault,
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    return subprocess.run(["bash", "launch/torchrun.sh", str(nproc), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800)


def records(run_dir: Path) -> dict:
    from megatron_taper.training.metrics import read_metrics

    latest = {}
    for r in read_metrics(run_dir / "metrics.jsonl"):
        if "loss" in r:
            latest[r["step"]] = (r["loss"], r["grad_norm"])
    shas = {}
    for name in sorted(n for n in os.listdir(run_dir / "checkpoints") if n.startswith("step-")):
        meta = json.loads((run_dir / "checkpoints" / name / "meta.json").read_text())
        shas[name] = {k: [rec["sha256"] for rec in e["records"]] for k, e in meta["tensors"].items()}
    return {"metrics": sorted(latest.items()), "checkpoints": shas}


def same_run(got: dict, expected: dict) -> bool:
    """Every step's loss and grad norm equal, and every checkpoint of the expected run present with
    the same sha256s; a stop's own checkpoint (at a step between checkpoint.interval's) is extra,
    listed in the row's extra_checkpoints."""
    mine = got.get("checkpoints", {})
    return got["metrics"] == expected["metrics"] and all(mine.get(k) == v for k, v in expected["checkpoints"].items())


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "logs" / "faults.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--step", type=int, default=6)
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--work", default="")
    opts, overrides = parser.parse_known_args()
    work = Path(opts.work or f"/tmp/fault_drill-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    args = [*BASE, *overrides]
    steps = int(next(a for a in reversed(args) if a.startswith("train.steps=")).split("=")[1])
    reference = work / "uninterrupted"
    proc = launch(opts.nproc, [*args, f"run.dir={reference}"], "")
    if proc.returncode != 0:
        raise SystemExit(f"the uninterrupted run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    want = records(reference)
    rows = []
    for kind in opts.faults.split(","):
        run = work / kind
        fault = f"{kind}:{opts.rank}:{opts.step}" + (":20" if kind == "spike" else "")
        t0 = time.time()
        proc = launch(opts.nproc, [*args, f"run.dir={run}"], fault)
        said = proc.stdout + proc.stderr
        if proc.returncode == 3:  # stopped after a checkpoint: started again, as a requeue would
            proc = launch(opts.nproc, [*args, f"run.dir={run}"], fault)
            said += proc.stdout + proc.stderr
        expected = want
        if kind in ("nan", "spike"):
            skipped = work / f"{kind}-skipped-from-the-start"
            skipped.mkdir()
            shutil.copy(run / "data_skips.json", skipped / "data_skips.json")
            launch(opts.nproc, [*args, f"run.dir={skipped}"], "")
            expected = records(skipped)
        got = records(run) if (run / "metrics.jsonl").exists() else {"metrics": []}
        ev = events(run)
        fired = next((e for e in ev if e["event"] == "fired"), None)
        after = [e for e in ev if e["event"] == "first_step" and fired and e["time"] > fired["time"]]
        rollback = [line for line in said.splitlines() if "rollback:" in line]
        seconds = None
        if after:
            seconds = round(after[0]["time"] - fired["time"], 2)
        rows.append({
            "fault": kind, "rank": opts.rank, "step": opts.step,
            "finished": proc.returncode == 0 and [s for s, _ in got["metrics"]][-1:] == [steps],
            "bitwise_equal": same_run(got, expected), "seconds_to_training": seconds,
            "extra_checkpoints": sorted(set(got.get("checkpoints", {})) - set(expected["checkpoints"])),
            "restarts": len(after), "rolled_back": bool(rollback), "wall_s": round(time.time() - t0, 1),
            "console": [line[:300] for line in said.splitlines() if any(s in line for s in SAID)][:8],
        })
    print(json.dumps({"config": {"nproc": opts.nproc, "args": args}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
