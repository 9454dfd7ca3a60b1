"""The layout planner's predictions against measurements on this CPU: per layout, predicted and
measured peak memory per rank and step time, their ratios, and the rank correlation of the step
times with the spread of its repeats.

    nice -n 10 python benchmarks/layout_check.py [--layouts none_dp1,ddp_dp2,...] [--repeats 3] [--steps 3]
                                                 [--measured-profile FILE | none] [key=value ...]

Each layout runs in fresh gloo processes (1, 2 or 4, 1 thread each: OMP_NUM_THREADS=1 also for the
one-process layout, as the cpu profile rates a rank by one core) through
benchmarks/activation_memory.py `--full-step` on layout_memory.py's model shape in fp32: `--steps`
training steps, then one more. The peaks come from one run per layout with MALLOC_MMAP_THRESHOLD_
(activation_memory.py: every large tensor its own mapping, so the host-RSS peak is exact); the step
times from `--repeats` further runs with glibc's default allocator, as a training run has it (the
low threshold makes each large allocation fault its pages in again: it slowed tp = 2 by 40% and
DDP by 17% here). A run's step time is rank 0's fastest step after the first (the first warms up:
allocations, the pipeline's shape inference). The timing runs are interleaved (every layout once,
then again), so a change of the machine's load falls on all of them alike. A layout's step time
is the fastest of its runs (`measured_step_fastest_s`: on a machine shared with other jobs the
noise only adds time, and each run's figure is already its fastest step); the median of its runs
(`measured_step_s`) and their spread (max - min) / median are reported beside it. Spearman's rank
correlation is computed on the fastest (`spearman_step_time`), for both profiles and statistics
(`spearman`), on every repeat alone (`spearman_per_repeat`) and between the repeats themselves
(`spearman_between_repeats`: how well the measurement agrees with itself, the ceiling of any
prediction's). Beside the wall time, each run
records the step's CPU time per process (all its threads; `measured_step_cpu_s`: the largest
rank's, median over repeats): other engineers' jobs on a shared machine lengthen the wall time
but much less the CPU time; it leaves out waiting (the pipeline bubble, a collective's wait for
a slower rank), so `spearman_step_cpu_time` is a second, load-robust view, not a replacement.
`peak_ratio_after_runtime` takes out the runtime's own ~31 MiB per process that the memory model
does not count (RUNTIME_BYTES).

Predictions come from megatron_taper/cost/plan.py's Predictor with this machine's cores (os.cpu_count():
the processes share them) and two device profiles: `measured`, the cpu profile measured on this
machine by benchmarks/cpu_profile.py --write just before the layouts run (or read from
`--measured-profile FILE`), which the ratios and `spearman_step_time` use, and `stored`, the cpu
entry of cost/devices.json as it stands (another machine's numbers, `predicted_step_by_profile_s`).
The measured profile fits nothing to the layouts (its `mfu` is cpu_profile's MLP block's rate over
its matmul peak). The stored one's `mfu` and `concurrent_efficiency` were fitted on its machine
from two of these layouts (FITTED), as `cpu_mfu_fitted` (the fraction of the profile's fp32 matmul
peak the one-process layout's median step implies: its predicted compute over the measured step
less the rest of its prediction) and `cpu_concurrent_efficiency_fitted` (what DDP dp=2's ranks
keep of a core: half the one-process step over a rank's CPU time) report them here; the
correlations' `unfitted` entries rank the other layouts alone.
Prints one JSON object: `rows` (per layout and rank), `layouts` (per layout: the largest rank's
peaks, the step times of every repeat and their median, ratios) and the correlations.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

LAYOUTS = {  # name -> (processes, overrides)
    "none_dp1": (1, ["parallel.zero=none"]),
    "none_dp1_full": (1, ["parallel.zero=none", "train.activation_checkpointing=full"]),
    "ddp_dp2": (2, ["parallel.zero=none"]),
    "ddp_dp2_full": (2, ["parallel.zero=none", "train.activation_checkpointing=full"]),
    "none_dp1_op": (1, ["parallel.zero=none", "train.activation_checkpointing=op"]),
    "ddp_dp2_op": (2, ["parallel.zero=none", "train.activation_checkpointing=op"]),
    "tp2": (2, ["parallel.tp=2"]),
    "pp2": (2, ["parallel.pp=2", "parallel.microbatches=4"]),
    "fsdp2_dp2": (2, ["parallel.zero=fsdp2"]),
    "deepspeed_dp2": (2, ["parallel.zero=deepspeed"]),
    "tp2_dp2": (4, ["parallel.tp=2"]),
    "fsdp2_pp2_dp2": (4, ["parallel.zero=fsdp2", "parallel.pp=2", "parallel.microbatches=4"]),
    "cp2": (2, ["parallel.cp=2"]),  # context parallelism, K/V all-gathered
    "cp2_ring": (2, ["parallel.cp=2", "parallel.cp_attention=ring"]),
}
FITTED = ("none_dp1", "ddp_dp2")  # the cpu profile's mfu and concurrent_efficiency were fitted from these
RUNTIME_BYTES = 31 * 2**20  # resident between steps beyond the modelled state, 28-33 MiB (docs/memory_model.md)


def ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):  # ties share their mean rank
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2.0
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation; NaN for fewer than 2 values."""
    if len(a) < 2:
        return float("nan")
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=3, help="runs of every layout, interleaved")
    parser.add_argument("--steps", type=int, default=3, help="training steps before the measured one")
    parser.add_argument("--measured-profile", default="", metavar="FILE",
                        help="this machine's measured cpu profile (benchmarks/cpu_profile.py --write); default: "
                             "measured by cpu_profile.py now, before the layouts; 'none': the table's only")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    import dataclasses
    import itertools
    import subprocess
    import tempfile

    from activation_memory import DEFAULT, measure
    from layout_memory import SHAPE

    from megatron_taper.config import load_config
    from megatron_taper.cost.devices import profiles
    from megatron_taper.cost.memory import GIB
    from megatron_taper.cost.plan import Predictor
    from megatron_taper.cost.preflight import preflight

    cores = os.cpu_count() or 1
    devices = {"stored": dataclasses.replace(profiles()["cpu"], cores=cores)}
    if args.measured_profile and args.measured_profile != "none":
        devices["measured"] = dataclasses.replace(profiles(measured=args.measured_profile)["cpu"], cores=cores)
    elif not args.measured_profile:  # this machine's numbers, measured before the layouts (about a minute)
        with tempfile.TemporaryDirectory() as tmp:
            measured_file = os.path.join(tmp, "cpu_measured.json")
            subprocess.run([sys.executable, os.path.join(HERE, "cpu_profile.py"), "--write", measured_file],
                           check=True, stdout=sys.stderr, stderr=subprocess.DEVNULL,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
            devices["measured"] = dataclasses.replace(profiles(measured=measured_file)["cpu"], cores=cores)
    names = args.layouts.split(",")
    setups = {}
    for name in names:
        nproc, layout = LAYOUTS[name]
        overrides = SHAPE + layout + ["train.precision=fp32", *args.overrides]
        cfg = load_config(None, DEFAULT + overrides)
        dp = preflight(cfg, nproc).dp
        setups[name] = (nproc, overrides, cfg, dp, {k: Predictor(cfg, d).predict(cfg, dp, float("inf"))
                                                    for k, d in devices.items()})
    main_profile = "measured" if "measured" in devices else "stored"
    peaks = {name: measure(setups[name][1], setups[name][2].train.activation_checkpointing, setups[name][0],
                           args.steps, full=True, threads=1) for name in names}
    runs: dict[str, list[list[dict]]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names:
            nproc, overrides, cfg, *_ = setups[name]  # the worker takes checkpointing as its mode
            runs[name].append(measure(overrides, cfg.train.activation_checkpointing, nproc, args.steps, full=True,
                                      threads=1, timing=True))
            last = runs[name][-1]
            print(json.dumps({"repeat": repeat, "layout": name, "step_s": last[0]["step_s"],
                              "step_cpu_s": max(r["step_cpu_s"] for r in last),
                              "peaks_mib": [round(r["measured_peak_bytes"] / 2**20, 1) for r in peaks[name]]}),
                  file=sys.stderr)
    rows, layouts = [], []
    for name in names:
        nproc, _, cfg, dp, by_profile = setups[name]
        predicted = by_profile[main_profile]
        first = peaks[name]
        for row in first:
            pp_rank = row["rank"] // (dp * cfg.parallel.cp * cfg.parallel.tp)
            want = predicted.rank_peaks[pp_rank]
            rows.append({"layout": name, "processes": nproc, "rank": row["rank"],
                         "measured_peak_mib": round(row["measured_peak_bytes"] / 2**20, 1),
                         "predicted_peak_mib": round(want / 2**20, 1),
                         "peak_ratio": round(row["measured_peak_bytes"] / want, 3),
                         "peak_ratio_after_runtime": round((row["measured_peak_bytes"] - RUNTIME_BYTES) / want, 3)})
        steps = [run[0]["step_s"] for run in runs[name]]
        step = median(steps)
        cpu_steps = [max(r["step_cpu_s"] for r in run) for run in runs[name]]
        top = max(rows[-len(first):], key=lambda r: abs(r["peak_ratio_after_runtime"] - 1.0))
        layouts.append({"layout": name, "processes": nproc, "predicted_step_s": predicted.step.total,
                        "predicted_step_by_profile_s": {k: p.step.total for k, p in by_profile.items()},
                        "predicted_parts_s": {"compute": predicted.step.compute, "bubble": predicted.step.bubble,
                                              "tp": predicted.step.tp, "cp": predicted.step.cp,
                                              "pp": predicted.step.pp,
                                              "dp": predicted.step.dp, "optimizer": predicted.step.optimizer},
                        "measured_step_s": step, "measured_step_fastest_s": min(steps), "measured_step_runs_s": steps,
                        "step_spread": (max(steps) - min(steps)) / step, "step_ratio": step / predicted.step.total,
                        "step_ratio_fastest": min(steps) / predicted.step.total,
                        "measured_step_cpu_s": median(cpu_steps), "measured_step_cpu_runs_s": cpu_steps,
                        "predicted_peak_gib": predicted.peak / GIB,
                        "measured_peak_gib": max(r["measured_peak_bytes"] for r in first) / GIB,
                        "worst_rank_peak_ratio_after_runtime": top["peak_ratio_after_runtime"]})
    predicted_steps = [x["predicted_step_s"] for x in layouts]
    runs_by_repeat = [[x["measured_step_runs_s"][k] for x in layouts] for k in range(args.repeats)]
    per_repeat = [spearman(predicted_steps, run) for run in runs_by_repeat]
    between = [spearman(a, b) for a, b in itertools.combinations(runs_by_repeat, 2)]
    unfitted = [k for k, name in enumerate(names) if name not in FITTED]
    correlations = {}
    for key, statistic in (("median", "measured_step_s"), ("fastest", "measured_step_fastest_s")):
        measured = [x[statistic] for x in layouts]
        for profile in devices:
            guess = [x["predicted_step_by_profile_s"][profile] for x in layouts]
            correlations[f"{profile}_profile_{key}"] = {
                "all": spearman(guess, measured),
                "unfitted": spearman([guess[k] for k in unfitted], [measured[k] for k in unfitted]),
                "step_ratios": [min(ratios := [m / g for m, g in zip(measured, guess)]), max(ratios)]}
    fitted, concurrent, cpu = None, None, devices[main_profile]
    if "none_dp1" in names:
        one = layouts[names.index("none_dp1")]
        rest = one["predicted_step_s"] - one["predicted_parts_s"]["compute"]
        fitted = cpu.mfu * one["predicted_parts_s"]["compute"] / max(one["measured_step_s"] - rest, 1e-9)
        if "ddp_dp2" in names:  # half the one-process work per rank, both ranks computing at once
            concurrent = one["measured_step_s"] / 2 / layouts[names.index("ddp_dp2")]["measured_step_cpu_s"]
    print(json.dumps({"benchmark": "layout_check", "device": "cpu", "cores": cpu.cores, "repeats": args.repeats,
                      "steps": args.steps, "shape": SHAPE + args.overrides, "profile": main_profile,
                      "profiles": {k: dataclasses.asdict(d) for k, d in devices.items()},
                      "rows": rows, "layouts": layouts,
                      "spearman_step_time": correlations[f"{main_profile}_profile_fastest"]["all"],
                      "spearman_step_time_unfitted": correlations[f"{main_profile}_profile_fastest"]["unfitted"],
                      "spearman": correlations, "spearman_per_repeat": per_repeat,
                      "spearman_between_repeats": between, "cpu_mfu_fitted": fitted,
                      "cpu_concurrent_efficiency_fitted": concurrent,
                      "spearman_step_cpu_time": spearman(predicted_steps, [x["measured_step_cpu_s"] for x in layouts]),
                      "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
