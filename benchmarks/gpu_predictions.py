"""The layout planner's predictions for measured GPU runs again, with today's cost model: reads the
JSON of benchmarks/gpu_check.py (`throughput`) and of benchmarks/gpu_families.py (`sized`), rebuilds
each run's Config as those scripts did, and predicts it with a device profile of
megatron_taper/cost/devices.json (default: h200). Runs on any machine (no GPU), so a change to the
cost model is checked against the recorded measurements without a GPU at hand.

    python benchmarks/gpu_predictions.py docs/results/gpu_check_h200_2026-12-04.json \\
        docs/results/gpu_families_h200_2026-12-04.json [--profile h200]

Prints one JSON object: per run its measured and predicted step time and peak memory and their
ratios (or `refused`: the error today's rules give that run, e.g. float8 without compile), and the
range [min, max] of each ratio over the runs predicted.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_check import SHAPE, predict, run_config  # noqa: E402
from gpu_families import SIZED, SIZED_VARIANT, sized_shape  # noqa: E402

from megatron_taper.validation import ConfigError  # noqa: E402

# the recorded runs (2026-12-04) predate the GPU recipes' taper unit of 128: their widths were in units of 64
RECORDED_UNIT = ["model.taper.multiple=64"]
# and the float8 rule of a row that does not name its train.float8_min_dim: every block linear whose
# dimensions are multiples of 16 was converted
RECORDED_FLOAT8 = ["train.float8_min_dim=16"]
VARIANT_KEYS = ("activation_checkpointing", "compile", "float8", "float8_recipe", "float8_min_dim", "loss_chunk",
                "overrides")


def rows(report: dict) -> list[tuple[str, list[str], dict, str, dict]]:
    """(recipe, shape, variant, ZeRO engine, measured row) of every run that measured a step, as
    gpu_check.py (fsdp2) and gpu_families.py (no ZeRO) ran it."""
    out = []
    for row in report.get("throughput", []):
        if "step_s" in row:
            variant = {k: row[k] for k in VARIANT_KEYS if k in row}
            rule = [] if "float8_min_dim" in row else RECORDED_FLOAT8
            shape = [*SHAPE, "train.precision=bf16", *RECORDED_UNIT, *rule]
            out.append(("configs/transformer_1.3b_taper.yaml", shape, variant, "fsdp2", row))
    for row in report.get("sized", []):
        if "step_s" in row:
            recipe, micro = SIZED[row["family"]]
            out.append((f"configs/{recipe}.yaml", [*sized_shape(row["family"], micro, True), *RECORDED_UNIT],
                        SIZED_VARIANT, "none", row))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+")
    from megatron_taper.cost.devices import profiles

    known = profiles()
    parser.add_argument("--profile", default="h200", choices=sorted(known))
    args = parser.parse_args()
    profile = known[args.profile]
    results = []
    for path in args.reports:
        try:
            with open(path) as f:
                report = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            parser.error(f"{path}: not a gpu_check / gpu_families JSON ({e})")
        for recipe, shape, variant, zero, measured in rows(report):
            row = {"recipe": os.path.basename(recipe), **variant, "measured_step_s": measured["step_s"]}
            try:
                cfg = run_config(recipe, shape, "/tmp/gpu_predictions", variant, zero)
            except ConfigError as e:  # a run today's rules refuse (eager float8)
                results.append({**row, "refused": str(e)})
                continue
            peak = measured.get("peak_allocated_gib", 0.0) * 2**30 or None
            result = predict(cfg, measured["step_s"], peak, profile)
            results.append({**row, **{k: v for k, v in result.items() if k != "profile"}})
    steps = [r["step_ratio"] for r in results if "step_ratio" in r]
    if not steps:
        parser.error(f"no measured run today's rules accept (a `throughput` or `sized` row with step_s) in "
                     f"{', '.join(args.reports)}")
    peaks = [r["peak_ratio"] for r in results if "peak_ratio" in r]
    print(json.dumps({"benchmark": "gpu_predictions", "profile": args.profile, "runs": results,
                      "step_ratio_range": [min(steps), max(steps)],
                      "peak_ratio_range": [min(peaks), max(peaks)] if peaks else None}))


if __name__ == "__main__":
    main()
