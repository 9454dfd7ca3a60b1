"""Per-layer MLP width, parameters and forward FLOPs per token of a model config, and the same
totals for its uniform twin. An MoE layer (model.moe) shows the width of each of its experts and
its active FLOPs (the router's, the top_k experts' and the shared expert's).

    python tools/show_model.py --config configs/X.yaml [key=value ...] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys

from megatron_taper.cli import OVERRIDES_HELP, add_config_arguments, handle_info_flags, parse_with_overrides
from megatron_taper.config import load_config
from megatron_taper.cost.flops import model_costs, uniform_twin
from megatron_taper.cost.preflight import preflight
from megatron_taper.models import family
from megatron_taper.taper import expert_width, moe_layers


def describe(cfg) -> dict:
    costs = model_costs(cfg.model)
    twin = model_costs(uniform_twin(cfg.model))
    spec = family(cfg.model.arch)  # what the family adds to its blocks (e.g. the memory bridge)
    extra = (sum(spec.block_extra_cost(cfg.model, i, True).params for i in range(cfg.model.n_layers))
             if spec.block_extra_cost is not None else 0)
    t, m = cfg.model.taper, cfg.model
    moe = moe_layers(m)
    budget = sum(expert_width(m) if is_moe else m.mlp_width for is_moe in moe)  # each group's, taper.py
    shortfall = budget - sum(costs.widths)
    return {
        "arch": cfg.model.arch,
        "schedule": t.schedule,
        "start": t.start,
        "widths": costs.widths,
        "moe_layers": moe,  # whether each layer holds experts (its width is then each expert's)
        "experts": f"{m.moe.experts} x top-{m.moe.top_k}" if m.moe.enabled else "",
        "width_budget_shortfall": shortfall,
        "layer_params": [c.params for c in costs.layers],
        "layer_flops": [c.flops for c in costs.layers],
        "embedding_params": costs.embedding.params,
        "head_params": costs.head.params,
        "head_flops": costs.head.flops,
        "total_params": costs.total_params,
        "extra_params": extra,
        "uniform_total_params": twin.total_params,
        "total_flops": costs.total_flops,
        "uniform_total_flops": twin.total_flops,
        "seq_len": cfg.model.seq_len,
    }


def print_table(info: dict) -> None:
    print(f"{info['arch']}: {info['schedule']} taper, start {info['start']} "
          f"(forward FLOPs per token at seq_len {info['seq_len']}, causal)")
    print(f"{'layer':>5} {'mlp width':>10} {'params':>14} {'FLOPs/token':>13}"
          + (f" {'experts':>12}" if info["experts"] else ""))
    for i, (w, p, f) in enumerate(zip(info["widths"], info["layer_params"], info["layer_flops"])):
        experts = (info["experts"] if info["moe_layers"][i] else "dense") if info["experts"] else ""
        print(f"{i:>5} {w:>10} {p:>14,} {f:>13.4e}" + (f" {experts:>12}" if experts else ""))
    print(f"{'embedding':>16} {info['embedding_params']:>14,}")
    print(f"{'head':>16} {info['head_params']:>14,} {info['head_flops']:>13.4e}")
    print(f"{'total':>16} {info['total_params']:>14,} {info['total_flops']:>13.4e}")
    print(f"{'uniform twin':>16} {info['uniform_total_params']:>14,} {info['uniform_total_flops']:>13.4e}")
    if info["extra_params"]:
        base = info["total_params"] - info["extra_params"]
        print(f"{info['arch']} adds {info['extra_params']:,} parameters to its blocks: "
              f"+{info['extra_params'] / base:.1%} over the same model without them")
    if info["width_budget_shortfall"]:
        print(f"note: widths sum to {info['width_budget_shortfall']} less than n_layers x mlp_width (MoE layers: "
              f"x model.moe.expert_width; the budget is not a multiple of model.taper.multiple)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False, epilog=OVERRIDES_HELP)
    add_config_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args, overrides = parse_with_overrides(parser, argv)
    try:
        if handle_info_flags(args, overrides):
            return 0
        cfg = load_config(args.config, overrides)
        preflight(cfg, cfg.parallel.pp * cfg.parallel.tp)  # the layout of one data-parallel replica
        info = describe(cfg)
    except ValueError as e:  # ConfigError included
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info))
    else:
        print_table(info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
