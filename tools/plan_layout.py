"""Plan a run before launching it: the best layouts of a recipe on N devices, and why the others
were dropped.

    megatron-taper-plan-layout --config C (--gpus N | --nodes N) [--device h100|h200|b200|cpu]
        [--gpus-per-node K] [--gpu-memory GIB | --free-memory] [--top K] [--json] [key=value ...]
    megatron-taper-plan --config C --gpus N ...     (the same: --gpus selects the layout search)

`--nodes N` plans N nodes x `--gpus-per-node` (default: the device's, cost/devices.json) devices.

Every layout of megatron_taper/cost/plan.py's SEARCH_SPACE (tp, pp, schedule and virtual stages, ZeRO
engine, HSDP replicas, sequence parallelism, context parallelism and its attention, expert
parallelism of MoE models, micro-batch and so gradient accumulation, activation checkpointing,
float8) that the trainer's own checks
accept at N processes is predicted: peak memory per rank (cost/memory.py, max over pipeline
ranks) and step time (cost/step_time.py, with the device's numbers from cost/devices.json;
`--gpus-per-node` replaces the device's). Printed: the fastest `--top` that fit 90% of
`--gpu-memory` (default: the device's memory; `--free-memory`: what is free now on this machine),
with the overrides that select each, the largest micro-batch that fits at the fastest layout's
other settings (plan.py micro_batch_advice), then the count of layouts dropped per reason.
Nothing fits: exit 2 with one error naming the nearest layout and the memory it needs. Meta only: no weights are built.
`--json` prints one object: `device`, `assumptions`, `layouts` (each with `overrides`,
`peak_gib`, `rank_peaks_gib`, `step_s` and its parts, `tokens_per_s`, `mfu`), `micro_batch_advice`
(`micro_batch`, `peak_gib`, `step_s`, or null), `dropped` (layouts
per kind of refusal, its numbers as N), `dropped_examples` (per kind, the first refusal with its
values), `candidates`, `legal`.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import sys
import time

from megatron_taper.cli import OVERRIDES_HELP, add_config_arguments, handle_info_flags, parse_with_overrides
from megatron_taper.config import load_config
from megatron_taper.cost.auto_layout import host_memory_gib
from megatron_taper.cost.devices import profiles
from megatron_taper.cost.memory import GIB
from megatron_taper.cost.plan import (
    SEARCH_SPACE,
    USABLE_FRACTION,
    PlanResult,
    Prediction,
    micro_batch_advice,
    no_fit_message,
    overrides,
    search,
)


def layout_json(x: Prediction) -> dict:
    shape = {k: getattr(x.layout, k) for k in ("tp", "pp", "dp", "cp", "ep", "virtual", "schedule", "zero",
                                                 "micro_batch", "microbatches")}
    return {"layout": x.describe(), "overrides": overrides(x.values), "values": x.values, **shape,
            "peak_gib": x.peak / GIB, "rank_peaks_gib": [p / GIB for p in x.rank_peaks], "step_s": x.step.total,
            "step_parts_s": {k: getattr(x.step, k) for k in ("compute", "bubble", "tp", "cp", "ep", "pp", "dp",
                                                               "optimizer")},
            "tokens_per_s": x.tokens_per_s, "mfu": x.mfu, "fits": x.fits}


def _advice_json(result: PlanResult) -> dict | None:
    advice = micro_batch_advice(result)
    return None if advice is None else {"micro_batch": advice[0], "peak_gib": advice[1].peak / GIB,
                                        "step_s": advice[1].step.total}


def free_memory_gib(gpus: int) -> float:
    """GiB free now: on the first CUDA device (torch.cuda.mem_get_info), else this machine's
    available RAM (/proc/meminfo MemAvailable) / `gpus` processes."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.mem_get_info(0)[0] / GIB
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    return available * 1024 / GIB / gpus


def assumptions(result: PlanResult) -> str:
    d = result.device
    return (f"{d.profile} ({d.name}): matmuls at {d.mfu:.0%} of peak (bf16 {d.bf16_tflops:g}, fp8 {d.fp8_tflops:g}, "
            f"fp32 {d.fp32_tflops:g} TFLOP/s), links {d.intra_node_gb_per_s:g} GB/s in a node of "
            f"{d.gpus_per_node or 'all'}, {d.inter_node_gb_per_s:g} GB/s between nodes; a layout fits under "
            f"{result.memory_limit / GIB:.1f} GiB per rank")


def to_text(result: PlanResult, top: int, seconds: float) -> str:
    nodes = -(-result.gpus // result.device.gpus_per_node) if result.device.gpus_per_node else 1
    lines = [f"planned for {result.gpus} x {result.device.name} ({nodes} node(s)), {assumptions(result)}",
             f"{result.candidates} layouts tried, {result.legal} legal, {len(result.layouts)} fit "
             f"({seconds:.1f} s)",
             f"{'#':>2} {'step s':>8} {'tok/s':>10} {'MFU':>5} {'peak GiB':>8}  layout"]
    for i, x in enumerate(result.layouts[:top]):
        s = x.step
        lines.append(f"{i + 1:>2} {s.total:>8.3g} {x.tokens_per_s:>10.4g} {x.mfu:>5.0%} {x.peak / GIB:>8.2f}  "
                     f"{x.describe()}")
        ep = f" ep {s.ep:.3g}" if x.experts else ""
        lines.append(f"{'':>38}compute {s.compute:.3g} bubble {s.bubble:.3g} tp {s.tp:.3g} cp {s.cp:.3g}{ep} pp "
                     f"{s.pp:.3g} dp {s.dp:.3g} optimizer {s.optimizer:.3g} s; {' '.join(overrides(x.values))}")
    advice = micro_batch_advice(result)
    if advice:
        micro, x = advice
        searched = dict(SEARCH_SPACE)["train.micro_batch"]
        lines.append(f"micro-batch: train.micro_batch={micro} is the largest of {searched} that fits "
                     f"{result.memory_limit / GIB:.1f} GiB per rank at layout 1's other settings (predicted peak "
                     f"{x.peak / GIB:.2f} GiB, step {x.step.total:.3g} s; layout 1 takes "
                     f"{result.layouts[0].values['train.micro_batch']})")
    lines.append("dropped (layouts, the first refusal of each kind):")
    for why, n in result.dropped.items():
        example, kinds = result.examples.get(why, (why, 1))
        lines.append(f"{n:>7}  {example}" + (f" (and {kinds - 1} more of this kind)" if kinds > 1 else ""))
    return "\n".join(lines)


def _refuse_unknown_options(parser: argparse.ArgumentParser, extra: list[str]) -> None:
    """A `--name value` that is neither an option of this tool nor a config key (keys are section.key):
    one error naming the nearest option, not 'unknown key'."""
    options = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    for override in extra:
        key = override.split("=", 1)[0]
        if "." not in key:
            near = difflib.get_close_matches(f"--{key}", options, n=1)
            parser.error(f"unknown option --{key}" + (f"; did you mean {near[0]}?" if near else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-taper-plan-layout", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False, epilog=OVERRIDES_HELP)
    add_config_arguments(parser)
    known = profiles()
    parser.add_argument("--gpus", type=int, default=0, help="devices (processes) of the run, all nodes together")
    parser.add_argument("--nodes", type=int, default=0, help="nodes of the run: --gpus is nodes x --gpus-per-node")
    parser.add_argument("--measured-profile", default="", metavar="FILE",
                        help="this cluster's measured device numbers over cost/devices.json's (JSON: "
                             "{\"devices\": {profile: {field: number, \"sources\": {...}}}}; "
                             "benchmarks/cpu_profile.py --write makes the CPU's)")
    parser.add_argument("--gpu-memory", type=float, default=0.0,
                        help="GiB per device (default: the device's, cost/devices.json; cpu: RAM / --gpus)")
    parser.add_argument("--free-memory", action="store_true",
                        help="plan for the memory free now on this machine's first CUDA device (else its available "
                             "RAM / --gpus) instead of --gpu-memory")
    parser.add_argument("--gpus-per-node", type=int, default=0, help="devices per node (default: the device's)")
    parser.add_argument("--device", choices=sorted(known), default="h100", help="device profile (default h100)")
    parser.add_argument("--top", type=int, default=5, help="layouts to print (default 5)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args, extra = parse_with_overrides(parser, argv)
    try:
        if handle_info_flags(args, extra):
            return 0
        _refuse_unknown_options(parser, extra)
        if (args.gpus > 0) == (args.nodes > 0):
            parser.error("give one of --gpus (devices of the run) and --nodes (nodes x --gpus-per-node)")
        if min(args.gpus, args.nodes) < 0 or args.top < 1 or args.gpu_memory < 0 or args.gpus_per_node < 0:
            parser.error("--gpus, --nodes and --top must be at least 1, --gpu-memory and --gpus-per-node not negative")
        device = profiles(measured=args.measured_profile)[args.device]
        if args.gpus_per_node:
            device = dataclasses.replace(device, gpus_per_node=args.gpus_per_node)
        if args.nodes:
            args.gpus = args.nodes * (device.gpus_per_node or 1)
        # the cpu profile: this machine's RAM shared by the processes
        own = device.memory_gb * 1e9 / GIB if device.memory_gb else host_memory_gib() / args.gpus
        memory = free_memory_gib(args.gpus) if args.free_memory else args.gpu_memory or own
        cfg = load_config(args.config, extra)
        start = time.perf_counter()
        result = search(cfg, args.gpus, memory, device)
        seconds = time.perf_counter() - start
    except ValueError as e:  # ConfigError included
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"device": dataclasses.asdict(result.device), "gpus": args.gpus, "gpu_memory_gib": memory,
                          "usable_fraction": USABLE_FRACTION, "assumptions": assumptions(result),
                          "candidates": result.candidates, "legal": result.legal, "search_s": seconds,
                          "layouts": [layout_json(x) for x in result.layouts[:args.top]],
                          "micro_batch_advice": _advice_json(result),
                          "nearest": layout_json(result.nearest) if result.nearest else None,
                          "dropped": result.dropped,
                          "dropped_examples": {k: example for k, (example, _) in result.examples.items()}}))
    else:
        print(to_text(result, args.top, seconds))
    if not result.layouts:
        print(f"error: {no_fit_message(result, memory)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
