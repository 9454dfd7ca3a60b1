"""Show how a recipe's layers are split over pipeline stages, and how balanced that split is.

    python tools/plan_pipeline.py --config configs/transformer_1.3b_taper.yaml parallel.pp=8 [--json]

Per stage: layers, forward FLOPs per token (embedding on the first stage, final norm + LM head +
loss on the last), parameters, and the predicted memory of one rank (megatron_taper/cost/memory.py):
static (parameters, gradients and optimizer state after tp / ZeRO sharding, plus weights held
unsharded or cast), activations (the micro-batches in flight under the schedule, the largest
backward moment, the head's loss buffers, pipeline buffers) and their sum, the peak; then
bottleneck / ideal (slowest stage over the mean) for the chosen split (`parallel.pp_balance`)
and for the layer-count split. The memory model assumes the config's parallel.tp /
sequence_parallel / zero, train.activation_checkpointing and train.precision on the target device
(`--device`, default train.device, and cuda where that is auto: train.precision=auto plans bf16,
as the run on a GPU with bf16 does, whatever machine the planner runs on; `--device cpu` plans
fp32); the memory line says which. Micro-batches are the trainer's (preflight.step_split): at pp=1
train.micro_batch sequences x the accumulation steps (parallel.microbatches is unused there), at
pp>1 the pipeline's parallel.microbatches.
`--json` prints one object with `stages` (layer-index lists), `stage_flops`,
`bottleneck_over_ideal`, `uniform_bottleneck_over_ideal`, the other columns and `memory` (what
the memory columns assumed).

With `--gpus N` (or `--nodes N`) it is the layout search instead (tools/plan_layout.py: the best
layouts of the recipe on N devices): `megatron-taper-plan --config C --gpus N --gpu-memory GIB ...`.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys

import torch

from megatron_taper.cli import OVERRIDES_HELP, add_config_arguments, handle_info_flags, parse_with_overrides
from megatron_taper.config import load_config
from megatron_taper.cost.memory import MemorySetup
from megatron_taper.cost.partition import PipelinePlan
from megatron_taper.cost.preflight import preflight
from megatron_taper.models import build_model
from megatron_taper.parallel.context import choose_device
from megatron_taper.parallel.pp.profile import profile_layer_times
from megatron_taper.parallel.pp.schedule import plan_stages


def default_dp(cfg) -> int:
    """The data-parallel size at which each pipeline micro-batch is train.micro_batch sequences."""
    t, p = cfg.train, cfg.parallel
    return max(1, t.global_batch // (t.micro_batch * p.microbatches)) if p.microbatches else 1


def target_device(cfg, device: str = "") -> str:
    """The device the plan is for: `device`, else train.device, else (auto) cuda."""
    return device or (cfg.train.device if cfg.train.device != "auto" else "cuda")


def target_bf16(cfg, device: str) -> bool:
    """train.precision on the target device (auto: bf16 on cuda, as on GPUs with bf16)."""
    return cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and device == "cuda")


def build_plan(cfg, dp: int, memory_gb: list[float] | None, bytes_per_param: float | None = None,
               memory_key: str | None = None, device: str = "") -> PipelinePlan:
    """The plan the trainer makes for `cfg` at data-parallel size `dp` on the target device."""
    measured = None
    if cfg.parallel.pp_balance == "profile":
        device = choose_device(cfg.train.device)
        model = build_model(cfg.model)
        model.init_weights(cfg.train.seed)
        measured = profile_layer_times(model, cfg.train.micro_batch, cfg.model.seq_len, device)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return plan_stages(cfg.model, cfg.parallel, cfg.train, dp, measured, memory_gb, bytes_per_param,
                       memory_key or "parallel.pp_memory_gb", bf16=target_bf16(cfg, target_device(cfg, device)))


def to_json(plan: PipelinePlan) -> dict:
    return {
        "pp": plan.pp,
        "virtual": plan.virtual,
        "balance": plan.balance,
        "stages": plan.stage_layers,
        "stage_ranks": [s.rank for s in plan.stages],
        "stage_flops": [s.flops for s in plan.stages],
        "stage_params": [s.params for s in plan.stages],
        "stage_static_bytes": [s.static_bytes for s in plan.stages],
        "stage_act_bytes": [s.act_bytes for s in plan.stages],
        "stage_peak_bytes": [s.peak_bytes for s in plan.stages],
        "stage_cost": [s.cost for s in plan.stages],
        # per pp rank, all its chunks (null: not modelled for interleaved_zero_bubble and dualpipev)
        "rank_static_bytes": [plan.rank_static_bytes(r) for r in range(plan.pp)],
        "rank_peak_bytes": [plan.rank_peak_bytes(r) for r in range(plan.pp)],
        "bottleneck_over_ideal": plan.bottleneck_over_ideal,
        "uniform_stages": plan.uniform_stages,
        "uniform_bottleneck_over_ideal": plan.uniform_bottleneck_over_ideal,
        "memory": dataclasses.asdict(plan.memory) if plan.memory else None,
    }


def _span(layers: list[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])


def memory_line(setup: MemorySetup | None, precision: str = "", device: str = "") -> str:
    if setup is None:
        return ""
    m = setup
    state = f"{m.state_bytes_per_param():.3g} B/param" + (" (--bytes-per-param)" if m.bytes_per_param else "")
    split = (f"micro_batch {m.micro_batch} x {m.microbatches} pipeline micro-batches" if m.pipelined else
             f"micro_batch {m.micro_batch} x {m.microbatches} accumulation")
    target = f" (train.precision={precision} on {device})" if precision else ""
    hsdp = f" (dp_shard={m.dp_shard})" if m.dp_shard and m.dp_shard != m.dp else ""
    return (f"memory per rank: tp={m.tp}{' +sp' if m.sequence_parallel else ''} dp={m.dp}{hsdp} zero={m.zero} "
            f"({state}), "
            f"{'bf16' if m.bf16 else 'fp32'}{target}, checkpointing={m.activation_checkpointing}, {split}")


def to_text(plan: PipelinePlan, name: str, precision: str = "", device: str = "") -> str:
    total = sum(s.flops for s in plan.stages)
    v = f" x {plan.virtual} virtual" if plan.virtual > 1 else ""
    lines = [f"{name}: pp={plan.pp}{v}, balance={plan.balance}", memory_line(plan.memory, precision, device),
             f"{'stage':>5} {'rank':>4} {'layers':>8} {'n':>3} {'GFLOP/tok':>10} {'share':>6} "
             f"{'params(M)':>10} {'static(GiB)':>11} {'act(GiB)':>9} {'peak(GiB)':>9}"]
    profile = plan.balance == "profile"
    if profile:
        lines[2] += f" {'fwd+bwd ms':>10}"
    for c, s in enumerate(plan.stages):
        lines.append(f"{c:>5} {s.rank:>4} {_span(s.layers):>8} {len(s.layers):>3} {s.flops / 1e9:>10.3f} "
                     f"{s.flops / total:>6.1%} {s.params / 1e6:>10.1f} {s.static_bytes / 2**30:>11.2f} "
                     f"{s.act_bytes / 2**30:>9.2f} {s.peak_bytes / 2**30:>9.2f}"
                     + (f" {s.cost * 1e3:>10.2f}" if profile else ""))
    sizes = ", ".join(str(len(s)) for s in plan.uniform_stages)
    lines.append(f"bottleneck / ideal (FLOPs): {plan.bottleneck_over_ideal:.3f} for this split, "
                 f"{plan.uniform_bottleneck_over_ideal:.3f} for the layer-count split ({sizes} layers)")
    return "\n".join(lines)


def sibling_tool(name: str):
    """tools/<name>.py, next to this file, as a module (installed or run as a file alike)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"megatron_taper_tools.{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a.split("=", 1)[0] in ("--gpus", "--nodes", "--gpu") for a in argv):  # --gpu: plan_layout says --gpus
        return sibling_tool("plan_layout").main(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False, epilog=OVERRIDES_HELP)
    add_config_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--virtual", type=int, default=0,
                        help="chunks per pp rank: plans parallel.pp_schedule=interleaved_1f1b with "
                             "parallel.pp_virtual=N (default: as the config says)")
    parser.add_argument("--dp", type=int, default=0,
                        help="data-parallel size (default: the one at which a pipeline micro-batch is "
                             "train.micro_batch sequences)")
    parser.add_argument("--memory-gb", type=float, nargs="+", default=None,
                        help="per-stage memory limit in GiB, one per stage (default: parallel.pp_memory_gb for all)")
    parser.add_argument("--bytes-per-param", type=float, default=None,
                        help="parameter + gradient + optimizer bytes per tp-local parameter, replacing the "
                             "engine's (default: 16 for zero=none, 16/dp for fsdp2, (param + 4 + 12)/dp for "
                             "deepspeed)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="",
                        help="the device the run is for, which decides train.precision=auto (default: "
                             "train.device, cuda where that is auto)")
    args, overrides = parse_with_overrides(parser, argv)
    try:
        if args.virtual:
            overrides += ["parallel.pp_schedule=interleaved_1f1b", f"parallel.pp_virtual={args.virtual}"]
        if handle_info_flags(args, overrides):
            return 0
        cfg = load_config(args.config, overrides)
        if args.memory_gb and cfg.parallel.virtual_stages > 1:
            parser.error("--memory-gb: per-stage memory limits are only modelled for non-interleaved schedules")
        dp = args.dp or default_dp(cfg)
        preflight(cfg, cfg.parallel.pp * cfg.parallel.tp * dp)
        device = target_device(cfg, args.device)
        plan = build_plan(cfg, dp, args.memory_gb, args.bytes_per_param, "--memory-gb" if args.memory_gb else None,
                          device)
    except ValueError as e:  # ConfigError included
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**to_json(plan), "device": device, "precision": cfg.train.precision}))
    else:
        print(to_text(plan, args.config or "defaults", cfg.train.precision, device))
    return 0


if __name__ == "__main__":
    sys.exit(main())

