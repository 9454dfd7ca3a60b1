"""The layout planner's predictions against measurements on this CPU: per layout, predicted and
measured peak memory per rank and step time, their ratios, and the rank correlation of the step
times.

    python benchmarks/layout_check.py [--layouts none_dp1,ddp_dp2,...] [--steps 2] [key=value ...]

Each layout runs in fresh gloo processes (1, 2 or 4) through benchmarks/activation_memory.py
`--full-step` (host RSS peaks of one whole training step after `--steps` warm-up steps, and the
fastest step after the first) on layout_memory.py's model shape, in fp32. Predictions come from
megatron_taper/plan.py's Predictor with the `cpu` device profile (cost/devices.json) at the
machine's RAM / processes. Prints one JSON object: `rows` (per layout and rank), `layouts` (per
layout: the largest rank's peaks, the step time of rank 0, ratios) and `spearman_step_time`.
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
    "ddp_dp2": (2, ["parallel.zero=none"]),
    "tp2": (2, ["parallel.tp=2"]),
    "pp2": (2, ["parallel.pp=2", "parallel.microbatches=4"]),
    "fsdp2_dp2": (2, ["parallel.zero=fsdp2"]),
    "deepspeed_dp2": (2, ["parallel.zero=deepspeed"]),
    "tp2_dp2": (4, ["parallel.tp=2"]),
    "fsdp2_pp2_dp2": (4, ["parallel.zero=fsdp2", "parallel.pp=2", "parallel.microbatches=4"]),
}


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
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--steps", type=int, default=2, help="warm-up training steps before the measured one")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from activation_memory import DEFAULT, measure
    from layout_memory import SHAPE

    from megatron_taper.config import load_config
    from megatron_taper.cost.devices import profiles
    from megatron_taper.cost.memory import GIB
    from megatron_taper.plan import Predictor
    from megatron_taper.preflight import preflight

    cpu = profiles()["cpu"]
    rows, layouts = [], []
    for name in args.layouts.split(","):
        nproc, layout = LAYOUTS[name]
        overrides = SHAPE + layout + ["train.precision=fp32", *args.overrides]
        cfg = load_config(None, DEFAULT + overrides)
        dp = preflight(cfg, nproc).dp
        predicted = Predictor(cfg, cpu).predict(cfg, dp, float("inf"))
        measured = measure(overrides, "none", nproc, args.steps, full=True)
        for row in measured:
            pp_rank = row["rank"] // (dp * cfg.parallel.tp)
            rows.append({"layout": name, "processes": nproc, "rank": row["rank"],
                         "measured_peak_mib": round(row["measured_peak_bytes"] / 2**20, 1),
                         "predicted_peak_mib": round(predicted.rank_peaks[pp_rank] / 2**20, 1),
                         "peak_ratio": round(row["measured_peak_bytes"] / predicted.rank_peaks[pp_rank], 3),
                         "measured_step_s": round(row["step_s"], 4)})
            print(json.dumps(rows[-1]), file=sys.stderr)
        step = measured[0]["step_s"]
        peak = max(r["measured_peak_bytes"] for r in measured)
        layouts.append({"layout": name, "processes": nproc, "predicted_step_s": predicted.step.total,
                        "measured_step_s": step, "step_ratio": step / predicted.step.total,
                        "predicted_peak_gib": predicted.peak / GIB, "measured_peak_gib": peak / GIB,
                        "peak_ratio": peak / predicted.peak})
        print(json.dumps(layouts[-1]), file=sys.stderr)
    rho = spearman([x["predicted_step_s"] for x in layouts], [x["measured_step_s"] for x in layouts])
    print(json.dumps({"benchmark": "layout_check", "device": "cpu", "shape": SHAPE + args.overrides, "rows": rows,
                      "layouts": layouts, "spearman_step_time": rho}))


if __name__ == "__main__":
    main()
