"""The config's walk through the planning code: which package parts call which, and how often a call
climbs back up the floors of the package (tests/config/test_layering.py FLOORS, README "Layout").

Traces (sys.setprofile, this process only, no torch needed) every call between functions of
megatron_taper while a recipe passes the launch's planning steps: preflight (the layout checks),
the pipeline plan of parallel.pp stages (layers per stage by parallel.pp_balance, the memory model's
per-stage peaks), the layout search of parallel.layout=auto for --gpus devices of --device, and the
step-time prediction of the chosen layout. A call from a module on a lower floor into one on a higher
floor is a climb: the lower floor had to be handed code from above (a callback, a function-level
import), the tangle issue 40 counts. Prints one JSON object: per step the calls and climbs, the
distinct climbing edges (caller -> callee, by function), and the totals.

    python benchmarks/config_walk.py [--config configs/transformer_1.3b_taper.yaml] [--gpus 8] [--device h100]
        [key=value ...]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.config.test_layering import floor  # noqa: E402 - the floors are defined once, by the layering test

PACKAGE = "megatron_taper"


def module_of(frame) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name == PACKAGE or name.startswith(PACKAGE + ".") else None


def trace(fn, *args, **kwargs) -> tuple[object, Counter, Counter]:
    """Run fn, counting package-internal calls by (caller module, callee module) and the climbing
    ones by (caller function, callee function)."""
    calls, climbs = Counter(), Counter()

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = module_of(frame)
        caller_frame = frame.f_back
        caller = module_of(caller_frame) if caller_frame is not None else None
        if callee is None or caller is None or callee == caller:
            return
        calls[(caller, callee)] += 1
        if floor(callee) > floor(caller):
            climbs[(f"{caller}.{caller_frame.f_code.co_name}", f"{callee}.{frame.f_code.co_name}")] += 1

    sys.setprofile(profile)
    try:
        result = fn(*args, **kwargs)
    finally:
        sys.setprofile(None)
    return result, calls, climbs


def summary(calls: Counter, climbs: Counter) -> dict:
    down = sum(n for (a, b), n in calls.items() if floor(b) < floor(a))
    return {"calls_between_modules": sum(calls.values()), "calls_down": down, "climbs": sum(climbs.values()),
            "climbing_edges": len(climbs),
            "edges": [f"{a} -> {b} (x{n})" for (a, b), n in sorted(climbs.items())]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/transformer_1.3b_taper.yaml")
    parser.add_argument("--gpus", type=int, default=8, help="devices the layout search plans for")
    parser.add_argument("--device", default="h100", help="a device of cost/devices.json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from megatron_taper.config import load_config
    from megatron_taper.cost.devices import profiles

    cfg = load_config(args.config, args.overrides)
    device = profiles()[args.device]
    steps = {}
    total_calls, total_climbs = Counter(), Counter()

    def step(name, fn, *a, **k):
        result, calls, climbs = trace(fn, *a, **k)
        steps[name] = summary(calls, climbs)
        total_calls.update(calls)
        total_climbs.update(climbs)
        return result

    from megatron_taper.cost.partition import plan_pipeline
    from megatron_taper.cost.plan import Predictor, search, with_values
    from megatron_taper.cost.preflight import preflight

    world = args.gpus
    p = cfg.parallel
    step("preflight", preflight, cfg, p.tp * p.pp * p.cp)  # the recipe's own layout at dp = 1
    step("pipeline_plan", plan_pipeline, cfg.model, max(p.pp, 2), virtual=p.virtual_stages,
         balance=p.pp_balance if p.pp_balance != "profile" else "flops")
    memory_gib = device.memory_gb * 1e9 / 2**30
    result = step("layout_search", search, cfg, world, memory_gib, device)
    if result.layouts:
        best = with_values(cfg, result.layouts[0].values)
        dp = world // (best.parallel.tp * best.parallel.pp * best.parallel.cp)
        step("step_time", Predictor(best, device).predict, best, dp, memory_gib * 2**30)
    report = {"config": args.config, "overrides": args.overrides, "gpus": world, "device": args.device,
              "steps": steps, "total": summary(total_calls, total_climbs)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
