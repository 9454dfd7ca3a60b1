"""What the benchmarks that time whole training steps in rounds, next to one process, share
(dp_scaling.py, moe_ep.py): the command line and the one JSON object they print."""
from __future__ import annotations

import argparse
import json
import sys


def parse_round_args(doc: str, steps: int) -> argparse.Namespace:
    """--steps (per round, default `steps`), --rounds (default 3) and key=value overrides."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    return parser.parse_args()


def print_round_result(benchmark: str, shape: list[str], args: argparse.Namespace, one_process_tokens_per_s: float,
                       **fields) -> None:
    """Print the benchmark's JSON object: its name, shape and rounds, the one-process baseline
    (each process runs 1 thread), then `fields` in order."""
    json.dump({"benchmark": benchmark, "shape": shape + args.overrides, "steps_per_round": args.steps,
               "rounds": args.rounds, "threads_per_process": 1,
               "one_process_tokens_per_s": one_process_tokens_per_s, **fields}, sys.stdout)
    print()
