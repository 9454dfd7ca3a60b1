"""Every model family's CPU training speed and operator counts before and after a change, side by
side in one run; prints JSON.

    git worktree add /tmp/before <commit>       # the code of before, beside this checkout
    python benchmarks/families_before_after.py --before /tmp/before [--steps 4] [--repeats 2]

For each recipe (every registered family's tiny recipe, and its smallest size-class recipe at
narrowed widths: the structure kept, i.e. blocks of the recipe's sequence length, chunks, segments
and memory levels, at d_model 64, 4 heads, MLP width 128, vocabulary 256, 2 blocks, micro-batch 1), each tree's
benchmarks/arch_throughput.py runs in its own process with that tree first on the path: before,
after, before, after, ... (`--repeats` pairs); tokens/s is the median over the pairs. `ops` is the
tree's cost/op_count.py count of the recipe's micro-batch (forward + backward ATen operators of
the whole model at its own number of blocks; the narrowed recipes at their 2 blocks).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
AFTER = os.path.dirname(HERE)
NARROW = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=0", "model.mlp_width=128",
          "model.vocab_size=256", "model.taper.multiple=16", "train.micro_batch=1"]
COUNT = """
import json, sys
from megatron_taper.config import load_config
from megatron_taper.cost.op_count import count_ops
cfg = load_config(sys.argv[1], sys.argv[2:]).model
ops = count_ops(cfg, cap=cfg.seq_len)
print(json.dumps(ops.ends + cfg.n_layers * ops.block))
"""


def run_in(tree: str, args: list[str]) -> str:
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    return subprocess.run([sys.executable, *args], cwd=tree, env=env, check=True, capture_output=True,
                          text=True).stdout


def speed(tree: str, recipe: str, overrides: list[str], steps: int) -> float:
    out = run_in(tree, [os.path.join(tree, "benchmarks", "arch_throughput.py"), "--config", recipe,
                        "--steps", str(steps), "--warmup", "1", *overrides])
    return json.loads(out)["results"][0]["tokens_per_s"]


def ops(tree: str, recipe: str, overrides: list[str]) -> int:
    return round(json.loads(run_in(tree, ["-c", COUNT, recipe, *overrides])))


def compare(before: str, recipe: str, overrides: list[str], steps: int, repeats: int) -> dict:
    speeds: dict[str, list[float]] = {"before": [], "after": []}
    for _ in range(repeats):
        for name, tree in (("before", before), ("after", AFTER)):
            speeds[name].append(speed(tree, recipe, overrides, steps))
    row = {"recipe": recipe, "narrowed": bool(overrides)}
    for name, tree in (("before", before), ("after", AFTER)):
        row[name] = {"tokens_per_s": round(statistics.median(speeds[name]), 1), "runs": speeds[name],
                     "ops": ops(tree, recipe, overrides)}
    row["speedup"] = round(row["after"]["tokens_per_s"] / row["before"]["tokens_per_s"], 2)
    row["ops_ratio"] = round(row["after"]["ops"] / row["before"]["ops"], 3)
    return row


def recipes() -> tuple[list[str], list[str]]:
    """(tiny, sized): every registered family's tiny recipe, and its smallest size-class recipe where
    it has one (gpu_families.family_recipes), in the registry's order."""
    sys.path.insert(0, HERE)
    from gpu_families import SIZE_CLASS, family_recipes

    from megatron_taper.models import cards

    configs = os.path.join(AFTER, "configs")
    tiny, smallest = family_recipes(configs, tiny=True), family_recipes(configs)
    return ([tiny[a] for a in cards() if a in tiny],
            [smallest[a] for a in cards() if a in smallest and SIZE_CLASS.match(smallest[a])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="a checkout of the code of before (git worktree add)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", help="comma-separated recipe names (default: every family's tiny recipe and "
                        "smallest size-class one)")
    args = parser.parse_args()
    tiny, sized = recipes()
    names = args.only.split(",") if args.only else tiny + sized
    rows = []
    for name in names:
        recipe = f"configs/{name}.yaml"
        rows.append(compare(os.path.abspath(args.before), recipe, [] if name in tiny else NARROW, args.steps,
                            args.repeats))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress
    print(json.dumps({"threads": os.environ.get("OMP_NUM_THREADS", "2"), "results": rows}, indent=1))


if __name__ == "__main__":
    main()
