"""Run a grid of training runs from one recipe and collect their final held-out losses.

    python tools/sweep.py sweeps/taper_cpu.yaml --out runs/sweep            # run (resumable), collect
    python tools/sweep.py sweeps/taper_cpu.yaml --out runs/sweep --dry-run  # list the runs
    python tools/sweep.py sweeps/taper_cpu.yaml --out runs/sweep --slurm -- -t 4:00:00
    python tools/sweep.py sweeps/taper_cpu.yaml --out runs/sweep --collect  # table + plot only
    python tools/sweep.py sweeps/taper_cpu.yaml --out runs/sweep --corpus my_text.txt.gz  # own raw text
    python tools/sweep.py sweeps/taper_cpu.yaml --out runs/sweep --only arch=transformer  # a part

The sweep file format is in megatron_taper/sweep.py. Locally the unfinished runs go seed by seed
(every configuration's first seed, then the second, ...), one after another or --jobs at a time
(`--nproc N` runs each with torchrun on N processes, its rendezvous store on 127.0.0.1 only:
megatron_taper.torchrun), each logging to OUT/logs/<run>.log; a failed run is reported and the others
go on. With --slurm the unfinished runs are submitted as one job array of launch/sweep.sbatch
(each task is launch/train.sbatch for one run: requeue and resume included); arguments after `--`
go to sbatch. Collecting writes OUT/results.json,
OUT/results.md (the table) and OUT/results.png (matplotlib, when installed). Exit status: 0, 1 if
a run failed, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from megatron_taper.sweep import SweepRun, collect, final_record, load_sweep, markdown_table, plot, prepare_data
from megatron_taper.validation import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_local(run: SweepRun, nproc: int, env: dict | None = None) -> int:
    os.makedirs(os.path.dirname(run.log_file), exist_ok=True)
    if nproc > 1:
        cmd = [sys.executable, "-m", "megatron_taper.torchrun", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "megatron_taper.train", *run.args]
    else:
        cmd = [sys.executable, "-m", "megatron_taper.train", *run.args]
    with open(run.log_file, "a") as log:
        return subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def select(sweep, only: list[str]) -> list[SweepRun]:
    """The runs whose labels match every --only AXIS=LABEL[,LABEL...]."""
    wanted: dict[str, set[str]] = {}
    for item in only:
        axis, _, labels = item.partition("=")
        if axis not in sweep.axes or not labels:
            raise ConfigError(f"--only {item}: give AXIS=LABEL[,LABEL...] with AXIS one of {', '.join(sweep.axes)}")
        known = {label for run in sweep.runs for a, label in run.labels if a == axis}
        unknown = sorted(set(labels.split(",")) - known)
        if unknown:
            raise ConfigError(f"--only {item}: {unknown[0]!r} is not a label of axis {axis} "
                              f"({', '.join(sorted(known))})")
        wanted.setdefault(axis, set()).update(labels.split(","))
    return [r for r in sweep.runs if all(dict(r.labels)[a] in labels for a, labels in wanted.items())]


def run_all(todo: list[SweepRun], nproc: int, jobs: int) -> list[str]:
    """Runs `todo` with at most `jobs` at a time; returns the names of the failed ones."""
    threads = max(1, (os.cpu_count() or 1) // (jobs * nproc))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads))}
    failed = []

    def one(i: int, run: SweepRun) -> None:
        print(f"[sweep] {i + 1}/{len(todo)} {run.name}", flush=True)
        if run_local(run, nproc, env) != 0:
            failed.append(run.name)
            print(f"[sweep] {run.name} failed: see {run.log_file}", file=sys.stderr, flush=True)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(one, range(len(todo)), todo))
    return failed


def submit_slurm(runs: list[SweepRun], out: str, sbatch_args: list[str]) -> str:
    plan = os.path.join(out, "plan.json")
    tmp = plan + ".tmp"
    with open(tmp, "w") as f:
        json.dump([{"name": r.name, "args": r.args} for r in runs], f, indent=1)
    os.replace(tmp, plan)
    os.makedirs(os.path.join(out, "slurm"), exist_ok=True)
    cmd = ["sbatch", "--parsable", f"--array=0-{len(runs) - 1}", "--output", os.path.join(out, "slurm", "%A_%a.out"),
           *sbatch_args, os.path.join(REPO, "launch", "sweep.sbatch"), os.path.abspath(plan)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"sbatch failed: {proc.stderr.strip()}")
    return proc.stdout.strip().split(";")[0]


def write_results(sweep, out: str) -> dict:
    result = collect(sweep)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(markdown_table(result))
    try:
        plot(result, os.path.join(out, "results.png"))
    except ImportError:
        print("[sweep] matplotlib is not installed: no results.png (pip install matplotlib)", file=sys.stderr)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/sweep.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", help="sweep file (YAML)")
    parser.add_argument("--out", required=True, help="sweep folder (runs/, results.*)")
    parser.add_argument("--nproc", type=int, default=1, help="processes per run (local: torchrun)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="local runs at the same time (default 1; each gets OMP_NUM_THREADS = cores / jobs)")
    parser.add_argument("--only", action="append", default=[], metavar="AXIS=LABEL[,LABEL...]",
                        help="run only the runs with one of these labels on AXIS (repeatable; the table still "
                             "lists every run)")
    parser.add_argument("--corpus", nargs="+", metavar="PATH",
                        help="raw text to tokenize into OUT/data and train on (replaces the sweep file's data.corpus)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the runs and whether they are finished")
    mode.add_argument("--collect", action="store_true", help="only collect the finished runs")
    mode.add_argument("--slurm", action="store_true", help="submit the unfinished runs as a Slurm job array")
    argv = list(sys.argv[1:] if argv is None else argv)
    sbatch_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if sbatch_args and not args.slurm:
        parser.error("arguments after -- are for sbatch: only with --slurm")
    try:
        sweep = load_sweep(args.sweep, args.out, args.corpus)
        if sweep.data is not None and not (args.dry_run or args.collect):
            prepare_data(sweep.data)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    try:
        selected = select(sweep, args.only)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    todo = [r for r in selected if final_record(r, sweep.metric) is None]
    if args.dry_run:
        for r in selected:
            print(json.dumps({"name": r.name, "finished": r not in todo, "args": r.args}))
        return 0
    if args.slurm:
        if not todo:
            print("[sweep] every run is finished")
            return 0
        job = submit_slurm(todo, args.out, sbatch_args)
        print(f"[sweep] submitted {len(todo)} run(s) as job array {job}; then: python tools/sweep.py "
              f"{args.sweep} --out {args.out} --collect")
        return 0
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    todo.sort(key=lambda r: sweep.seeds.index(r.seed))  # seed by seed (stable within a seed)
    failed = [] if args.collect else run_all(todo, args.nproc, args.jobs)
    result = write_results(sweep, args.out)
    sys.stdout.write(markdown_table(result))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
