"""Taper vs uniform at 125M on one GPU, at equal tokens: held-out loss, the paired difference and the
noise between two seeds (issue 45). benchmarks/gpu_science.sh is the command; this is its driver.

1. Corpus (benchmarks/science_corpus.py): the installed Python packages' .py/.rst/.md/.txt files,
   deduplicated, held out by package, as jsonl.
2. Tokenizer and shards with the project's tools, as a user runs them: tools/train_tokenizer.py
   on the training documents (the recipe's vocabulary), tools/preprocess_data.py on the training
   and on the held-out documents (both at --val-fraction 0, side by side); the held-out folder's
   shards become the data folder's val/ split, so the runs evaluate on packages they never saw.
3. Arms, each `python -m megatron_taper.train --config RECIPE key=value...` in its own process
   (a fresh CUDA context and compile state each), in this order: `taper` (cosine 1.5 -> 0.5),
   `uniform` (its twin), `uniform_seed2` (the uniform arm with train.seed + 1: the seed noise),
   then `reverse` (start 0.5) when the time left is more than the longest arm so far took. The
   first three always run. Same recipe settings, steps, batch, seed and data (so the same
   tokens in the same order) for the taper arms and `uniform`; precision and compile are the
   recipe's `auto` (bf16 autocast and compiled blocks on CUDA, fp32 eager on a CPU).
4. Steps: `--steps`, else planned after the data is ready: the time left before --budget-s
   shared by the three arms, less --arm-overhead-s each (start-up, compile, evaluations, the
   final checkpoint), times a planning rate: the layout planner's predicted tokens/s for this run
   on this device (megatron_taper/cost/plan.py) times --plan-margin (compile's speed on this model
   is not yet measured on a GPU, so the margin is wide; time it leaves goes to `reverse`).
5. The JSON (--out/gpu_science.json, rewritten after each stage, so a kill keeps what finished):
   corpus and token counts, the plan, per arm its curves (`train`: [step, tokens, loss] per logged
   step; `eval`: [step, tokens, held-out loss] every steps/evals steps and at the end, each over
   the whole held-out split up to a cap, so every arm and seed is scored on the same tokens),
   tokens seen, throughput and the device line it printed; `comparison`: final held-out losses at
   equal tokens, `paired_difference` (taper - uniform, same seed), `seed_noise` (|uniform_seed2 -
   uniform|), `reverse_minus_uniform`, the same as curves over the evaluations, and whether taper
   is below uniform by more than twice the noise. A plot beside it (gpu_science.png).

`--cpu`: the same code at toy sizes (a 0.6 MB corpus subset, at most 30 KB a package, a 512-piece
tokenizer, 2-layer d_model 32 variants of configs/tiny_taper.yaml, 6 steps), about 34 s of CPU
time on this 2-core machine;
tests/launch/test_gpu_science.py runs it. Large files (corpus, shards, runs and their checkpoints)
go to --work (default: a temporary folder, removed at the end unless --keep-work); --out holds
only the JSON, the plot, corpus.json, the data's stats.json and each arm's console log.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.dirname(os.path.abspath(__file__))]

from science_corpus import build_corpus  # noqa: E402 - after the path setup

from megatron_taper.config import load_config  # noqa: E402
from megatron_taper.training.metrics import read_metrics  # noqa: E402


@dataclass(frozen=True)
class Mode:
    taper: str  # recipe of the cosine taper
    uniform: str  # recipe of its uniform twin
    uniform_overrides: tuple[str, ...]  # what makes `uniform` uniform when it is the taper recipe
    shape: tuple[str, ...]  # overrides of every arm: sizes, batch
    corpus_max_mb: float  # 0 = every file of the roots
    corpus_max_package_kb: float  # 0 = no cap on one package's share
    tokenizer_lines: int  # --max-sentences of tools/train_tokenizer.py
    steps: int  # 0 = planned from the time budget
    evals: int  # held-out evaluations per run (the last at the end)
    max_eval_batches: int  # an evaluation reads the whole held-out split, up to this many micro-batches


CONFIGS = os.path.join(REPO, "configs")
GPU = Mode(os.path.join(CONFIGS, "transformer_125m_taper.yaml"), os.path.join(CONFIGS, "transformer_125m_uniform.yaml"),
           (),
           ("train.global_batch=32", "train.micro_batch=16"),  # 65,536 tokens a step, 2 micro-batches
           corpus_max_mb=0.0, corpus_max_package_kb=0.0, tokenizer_lines=300_000, steps=0, evals=5,
           max_eval_batches=128)
CPU = Mode(os.path.join(CONFIGS, "tiny_taper.yaml"), os.path.join(CONFIGS, "tiny_taper.yaml"),
           ("model.taper.schedule=uniform", "model.taper.start=1.0"),
           ("model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.mlp_width=96", "model.taper.multiple=16",
            "model.seq_len=32", "model.vocab_size=512", "train.global_batch=8", "train.micro_batch=8"),
           corpus_max_mb=0.6, corpus_max_package_kb=30.0, tokenizer_lines=20_000, steps=6, evals=2,
           max_eval_batches=64)
REVERSE_START = "model.taper.start=0.5"  # cosine 0.5 -> 1.5: widths grow with depth
ARMS = ("taper", "uniform", "uniform_seed2", "reverse")
REQUIRED_ARMS = 3  # taper, uniform, uniform_seed2 always run; reverse when the time left allows


def log(message: str) -> None:
    print(f"[gpu_science] {message}", file=sys.stderr, flush=True)


def write(report: dict, out: str) -> None:
    path = os.path.join(out, "gpu_science.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)


def tool(name: str, args: list[str], log_file: str) -> subprocess.Popen:
    """`python tools/NAME.py ARGS` with its console output in `log_file`."""
    cmd = [sys.executable, os.path.join(REPO, "tools", f"{name}.py"), *args]
    log(" ".join(cmd[1:]))
    with open(log_file, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=child_env())


def child_env() -> dict:
    return {**os.environ, "PYTHONPATH": REPO + (os.pathsep + os.environ["PYTHONPATH"]
                                                if os.environ.get("PYTHONPATH") else "")}


def finish(proc: subprocess.Popen, log_file: str) -> None:
    if proc.wait() != 0:
        with open(log_file) as f:
            tail = f.read()[-2000:]
        raise RuntimeError(f"{' '.join(proc.args[1:3])} failed (exit {proc.returncode}): {tail}")


def prepare_data(mode: Mode, args: argparse.Namespace, work: str, vocab: int, report: dict) -> str:
    """Corpus -> tokenizer -> train and held-out shards -> WORK/data (train/ and val/); returns its path."""
    started = time.perf_counter()
    corpus = build_corpus(os.path.join(work, "corpus"), args.root, max_bytes=int(mode.corpus_max_mb * 1e6),
                          max_package_bytes=int(mode.corpus_max_package_kb * 1e3),
                          held_out_fraction=args.held_out_fraction, key=args.held_out_key)
    shutil.copyfile(os.path.join(work, "corpus", "corpus.json"), os.path.join(args.out, "corpus.json"))
    report["corpus"] = {"roots": corpus["roots"], "files_read": corpus["files_read"],
                        "bytes_read": corpus["bytes_read"], "skipped": corpus["skipped"],
                        "held_out_fraction": corpus["held_out_fraction"], "held_out_key": corpus["key"],
                        **{s: {"documents": v["documents"], "bytes": v["bytes"], "packages": len(v["packages"])}
                           for s, v in corpus["splits"].items()},
                        "held_out_packages": corpus["splits"]["held_out"]["packages"],
                        "seconds": round(time.perf_counter() - started, 1)}
    log(f"corpus: {corpus['splits']['train']['bytes']:,} bytes for training "
        f"({len(corpus['splits']['train']['packages'])} packages), {corpus['splits']['held_out']['bytes']:,} held "
        f"out ({len(corpus['splits']['held_out']['packages'])} packages)")
    logs, threads = os.path.join(args.out, "logs"), str(os.cpu_count() or 1)
    jsonl = {s: os.path.join(work, "corpus", f"{s}.jsonl") for s in ("train", "held_out")}
    prefix = os.path.join(work, "tokenizer", "spm")
    os.makedirs(os.path.dirname(prefix))
    started = time.perf_counter()
    finish(tool("train_tokenizer", ["--input", jsonl["train"], "--vocab-size", str(vocab), "--output", prefix,
                                    "--max-sentences", str(mode.tokenizer_lines), "--threads", threads,
                                    "--no-progress"], os.path.join(logs, "train_tokenizer.log")),
           os.path.join(logs, "train_tokenizer.log"))
    with open(prefix + ".json") as f:
        settings = json.load(f)
    report["tokenizer"] = {"vocab_size": vocab, "training_lines": settings.get("training_lines"),
                           "seconds": round(time.perf_counter() - started, 1)}
    started = time.perf_counter()
    shards = {s: os.path.join(work, f"shards_{s}") for s in jsonl}
    procs = {s: tool("preprocess_data", ["--input", jsonl[s], "--tokenizer", prefix + ".model", "--output", shards[s],
                                         "--val-fraction", "0", "--workers", threads, "--no-progress"],
                     os.path.join(logs, f"preprocess_{s}.log")) for s in jsonl}
    for s, proc in procs.items():
        finish(proc, os.path.join(logs, f"preprocess_{s}.log"))
    data = os.path.join(work, "data")
    os.replace(shards["train"], data)
    os.replace(os.path.join(shards["held_out"], "train"), os.path.join(data, "val"))
    with open(os.path.join(data, "stats.json")) as f:
        stats = json.load(f)
    with open(os.path.join(shards["held_out"], "stats.json")) as f:
        held_out = json.load(f)
    stats["splits"]["val"] = held_out["splits"]["train"]
    stats["val_split"] = "held out by package (benchmarks/science_corpus.py), tokenized on its own"
    with open(os.path.join(data, "stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    shutil.copyfile(os.path.join(data, "stats.json"), os.path.join(args.out, "data_stats.json"))
    report["tokens"] = {"train": stats["splits"]["train"]["tokens"], "held_out": stats["splits"]["val"]["tokens"],
                        "seconds": round(time.perf_counter() - started, 1)}
    log(f"shards: {report['tokens']['train']:,} training tokens, {report['tokens']['held_out']:,} held out")
    return data


def arm_overrides(mode: Mode, name: str, seed: int) -> tuple[str, list[str]]:
    """(recipe, overrides) of arm `name` before the run settings shared by every arm."""
    if name == "taper":
        return mode.taper, [f"train.seed={seed}"]
    if name == "reverse":
        return mode.taper, [REVERSE_START, f"train.seed={seed}"]
    return mode.uniform, [*mode.uniform_overrides, f"train.seed={seed + (name == 'uniform_seed2')}"]


def plan_steps(mode: Mode, args: argparse.Namespace, shared: list[str], time_left: float, held_out: int) -> dict:
    """The steps of every arm: --steps, the mode's, or the three required arms' share of `time_left`
    at the planner's predicted tokens/s for this device times --plan-margin; and the micro-batches
    of an evaluation: all that the `held_out` tokens fill, at most the mode's cap (every arm and
    seed then evaluates on the same tokens, only packed in another order)."""
    from megatron_taper.cost.auto_layout import local_device
    from megatron_taper.cost.plan import Predictor

    cfg = load_config(mode.uniform, [*mode.uniform_overrides, *shared])
    tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
    profile, _, where = local_device(cfg.train.device, 1)
    predicted = tokens_per_step / Predictor(cfg, profile).predict(cfg, 1, float("inf")).step.total
    plan = {"tokens_per_step": tokens_per_step, "global_batch": cfg.train.global_batch, "seq_len": cfg.model.seq_len,
            "predicted_tokens_per_s": predicted, "profile": where, "plan_margin": args.plan_margin,
            "eval_batches": max(1, min(mode.max_eval_batches,
                                       held_out // (cfg.train.micro_batch * (cfg.model.seq_len + 1))))}
    if args.steps or mode.steps:
        plan.update(steps=args.steps or mode.steps, steps_from="--steps" if args.steps else "--cpu")
    else:
        train_s = time_left / REQUIRED_ARMS - args.arm_overhead_s
        rate = predicted * args.plan_margin
        steps = int(train_s * rate / tokens_per_step)
        if steps < 20:
            raise RuntimeError(f"{time_left:.0f} s left for {REQUIRED_ARMS} arms of {args.arm_overhead_s:.0f} s "
                               f"overhead each leaves {steps} steps at {rate:,.0f} tokens/s: raise --budget-s")
        plan.update(steps=steps, steps_from="planned", time_left_s=time_left, arm_overhead_s=args.arm_overhead_s,
                    planned_tokens_per_s=rate, planned_train_s_per_arm=train_s)
    plan["tokens"] = plan["steps"] * tokens_per_step
    return plan


def run_settings(mode: Mode, data: str, steps: int, eval_batches: int = 1) -> list[str]:
    """Overrides every arm shares after its own: data, steps, schedule, evaluation, logging."""
    evaluate_every = max(1, steps // mode.evals)
    return [*mode.shape, f"data.path={data}", f"train.steps={steps}", f"train.warmup_steps={max(1, steps // 20)}",
            f"train.eval_interval={evaluate_every}", f"train.eval_batches={eval_batches}",
            f"train.log_interval={max(1, min(10, evaluate_every))}", "run.tensorboard=false", "run.resume=never"]


def run_arm(name: str, recipe: str, overrides: list[str], work: str, out: str, deadline: float) -> dict:
    """One arm as `python -m megatron_taper.train`; stopped (SIGTERM: a checkpoint, then exit) at `deadline`."""
    run_dir = os.path.join(work, "runs", name)
    cmd = [sys.executable, "-m", "megatron_taper.train", "--config", recipe, *overrides, f"run.dir={run_dir}"]
    log_file = os.path.join(out, "logs", f"{name}.log")
    log(f"arm {name}: {' '.join(cmd[1:])}")
    started = time.perf_counter()
    with open(log_file, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=child_env())
        try:
            proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=20)  # its checkpoint on SIGTERM; worst case ends by --budget-s + 20 s
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    result = {"recipe": recipe, "overrides": overrides, "returncode": proc.returncode,
              "wall_s": round(time.perf_counter() - started, 1), "log": os.path.relpath(log_file, out)}
    with open(log_file) as f:
        console = f.read()
    result["device_line"] = next((line.strip() for line in console.splitlines()
                                  if line.strip().startswith("device: ")), None)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    records = read_metrics(metrics) if os.path.isfile(metrics) else []
    steps = [r for r in records if "loss" in r]
    if steps:
        per_step = steps[-1]["tokens_seen"] // steps[-1]["step"]
        result.update(
            steps=steps[-1]["step"], tokens_seen=steps[-1]["tokens_seen"],
            tokens_per_s=sorted(r["tokens_per_s"] for r in steps)[len(steps) // 2],  # median of the logged steps
            train=[[r["step"], r["tokens_seen"], r["loss"]] for r in steps],
            eval=[[r["step"], r["step"] * per_step, r["eval_loss"]] for r in records if "eval_loss" in r])
        if result["eval"]:
            result["final_eval_loss"] = result["eval"][-1][2]
    if proc.returncode != 0:
        result["failed"] = f"exit {proc.returncode}: " + console[-1500:]
    return result


def compare(arms: dict, steps: int) -> dict:
    """Final held-out losses of the arms that ran all `steps` (equal tokens), their differences to
    `uniform`, and the same at each evaluation."""
    finished = {n: a for n, a in arms.items() if a.get("steps") == steps and a.get("final_eval_loss") is not None}
    if "taper" not in finished or "uniform" not in finished:
        return {"missing": sorted({"taper", "uniform"} - set(finished))}
    curves = {n: {step: (tokens, loss) for step, tokens, loss in a["eval"]} for n, a in finished.items()}

    def curve(a: str, b: str, absolute: bool = False) -> list[list]:
        common = sorted(set(curves[a]) & set(curves[b]))
        diffs = [[s, curves[a][s][0], curves[a][s][1] - curves[b][s][1]] for s in common]
        return [[s, t, abs(d)] for s, t, d in diffs] if absolute else diffs

    result = {"tokens": finished["taper"]["tokens_seen"],
              **{f"{n}_eval_loss": a["final_eval_loss"] for n, a in finished.items()},
              "paired_difference": finished["taper"]["final_eval_loss"] - finished["uniform"]["final_eval_loss"],
              "paired_difference_curve": curve("taper", "uniform")}
    if "uniform_seed2" in finished:
        noise = abs(finished["uniform_seed2"]["final_eval_loss"] - finished["uniform"]["final_eval_loss"])
        below = -result["paired_difference"] > 2 * noise
        result.update(seed_noise=noise, seed_noise_curve=curve("uniform_seed2", "uniform", absolute=True),
                      taper_below_uniform_by_twice_noise=below,
                      verdict=(f"taper - uniform = {result['paired_difference']:+.4f} at {result['tokens']:,} "
                               f"tokens; twice the seed noise = {2 * noise:.4f}; taper below uniform by more "
                               f"than that: {'yes' if below else 'no'}"))
    if "reverse" in finished:
        reverse, uniform = finished["reverse"]["final_eval_loss"], finished["uniform"]["final_eval_loss"]
        result["reverse_minus_uniform"] = reverse - uniform
        result["reverse_minus_uniform_curve"] = curve("reverse", "uniform")
    return result


def plot(report: dict, path: str) -> None:
    """Training loss, held-out loss and the differences to uniform (with +-2x the seed noise) against tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (train_ax, eval_ax, diff_ax) = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, arm in report["arms"].items():
        if arm.get("train"):
            train_ax.plot([t for _, t, _ in arm["train"]], [loss for _, _, loss in arm["train"]], label=name, lw=1)
        if arm.get("eval"):
            eval_ax.plot([t for _, t, _ in arm["eval"]], [loss for _, _, loss in arm["eval"]], marker="o", label=name)
    comparison = report.get("comparison", {})
    for key, label in (("paired_difference_curve", "taper - uniform"), ("reverse_minus_uniform_curve",
                                                                      "reverse - uniform")):
        points = comparison.get(key)
        if points:
            diff_ax.plot([t for _, t, _ in points], [d for _, _, d in points], marker="o", label=label)
    if comparison.get("seed_noise_curve"):
        tokens = [t for _, t, _ in comparison["seed_noise_curve"]]
        band = [2 * n for _, _, n in comparison["seed_noise_curve"]]
        diff_ax.fill_between(tokens, [-b for b in band], band, color="grey", alpha=0.25, label="+-2x seed noise")
    diff_ax.axhline(0.0, color="black", lw=0.8)
    for ax, title in ((train_ax, "training loss"), (eval_ax, "held-out loss (unseen packages)"),
                      (diff_ax, "held-out loss minus uniform, same seed")):
        ax.set_xlabel("tokens")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['device']}: {report.get('plan', {}).get('tokens', 0):,} tokens per arm")
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=110)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "benchmarks", "results",
                                                                                "gpu_science"),
                        help="folder for gpu_science.json, gpu_science.png and the logs (default: $OUT, else "
                             "benchmarks/results/gpu_science)")
    parser.add_argument("--work", default="", help="folder for corpus, shards and runs (default: a temporary one)")
    parser.add_argument("--keep-work", action="store_true",
                        help="keep the temporary work folder (a --work folder is always kept)")
    parser.add_argument("--cpu", action="store_true", help="toy sizes, a few steps (a CPU check of the script)")
    parser.add_argument("--budget-s", type=float, default=510.0,
                        help="seconds from start for everything (arms running past it are stopped: the script ends "
                             "by --budget-s + ~25 s; 510 keeps it inside 9 minutes)")
    parser.add_argument("--steps", type=int, default=0, help="steps of every arm (default: planned, or 6 with --cpu)")
    parser.add_argument("--plan-margin", type=float, default=0.6, help="share of the predicted tokens/s planned on")
    parser.add_argument("--arm-overhead-s", type=float, default=60.0,
                        help="seconds of an arm beside its steps: start-up, compile, evaluations, final checkpoint")
    parser.add_argument("--seed", type=int, default=0, help="train.seed of the arms (uniform_seed2: + 1)")
    parser.add_argument("--no-reverse", dest="reverse", action="store_false", help="never run the reverse arm")
    parser.add_argument("--root", action="append", help="a folder the corpus reads (default: site-packages)")
    parser.add_argument("--held-out-fraction", type=float, default=0.05)
    parser.add_argument("--held-out-key", type=int, default=0)
    args = parser.parse_args(argv)
    began = time.perf_counter()
    deadline = began + args.budget_s
    mode = CPU if args.cpu else GPU
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu:
        print("gpu_science: error: no CUDA device (use --cpu for the toy run on a CPU)", file=sys.stderr)
        return 2
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    if args.work and os.path.isdir(args.work) and os.listdir(args.work):
        print(f"gpu_science: error: --work {args.work} is not empty (its runs would resume)", file=sys.stderr)
        return 2
    work = args.work or tempfile.mkdtemp(prefix="gpu_science-")
    os.makedirs(work, exist_ok=True)
    report: dict = {"benchmark": "gpu_science", "mode": "cpu" if args.cpu else "gpu",
                    "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                    "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                    "budget_s": args.budget_s, "seed": args.seed, "arms": {}}
    try:
        vocab = load_config(mode.taper, mode.shape).model.vocab_size
        data = prepare_data(mode, args, work, vocab, report)
        report["data_s"] = round(time.perf_counter() - began, 1)
        write(report, args.out)
        plan = plan_steps(mode, args, run_settings(mode, data, 1), deadline - time.perf_counter(),
                          report["tokens"]["held_out"])
        report["plan"] = plan
        log(f"plan: {plan['steps']} steps x {plan['tokens_per_step']:,} tokens = {plan['tokens']:,} tokens per arm "
            f"({plan['steps_from']}; predicted {plan['predicted_tokens_per_s']:,.0f} tokens/s)")
        shared = run_settings(mode, data, plan["steps"], plan["eval_batches"])
        for n, name in enumerate(ARMS):
            longest = max((a["wall_s"] for a in report["arms"].values()), default=0.0)
            time_left = deadline - time.perf_counter()
            why = ("time budget spent" if time_left <= 0 else "--no-reverse" if not args.reverse
                   else f"{time_left:.0f} s left, the longest arm took {longest} s")
            if time_left <= 0 or (n >= REQUIRED_ARMS and (not args.reverse or time_left < 1.1 * longest)):
                report["arms"][name] = {"skipped": why}
                continue
            recipe, own = arm_overrides(mode, name, args.seed)
            report["arms"][name] = run_arm(name, recipe, [*own, *shared], work, args.out, deadline)
            report["comparison"] = compare(report["arms"], plan["steps"])
            write(report, args.out)
    except Exception as e:  # noqa: BLE001 - recorded in the JSON, which keeps what finished
        report["failed"] = f"{type(e).__name__}: {e}"
        log(f"failed: {report['failed']}")
    finally:
        if not args.keep_work and not args.work:
            shutil.rmtree(work, ignore_errors=True)
    report["elapsed_s"] = round(time.perf_counter() - began, 1)
    if report["arms"]:
        try:
            plot(report, os.path.join(args.out, "gpu_science.png"))
        except Exception as e:  # noqa: BLE001 - e.g. no matplotlib: the JSON holds every number the plot shows
            report["plot_failed"] = f"{type(e).__name__}: {e}"
    write(report, args.out)
    json.dump(report, sys.stdout)
    print()
    failed = report.get("failed") or any("failed" in a for a in report["arms"].values())
    return 1 if failed or "paired_difference" not in report.get("comparison", {}) else 0


if __name__ == "__main__":
    sys.exit(main())
