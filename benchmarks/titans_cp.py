"""Titans under context parallelism (models/titans/cp.py): step time at cp=2 against one process,
the chain's message bytes beside titans/cost.py cp_state_bytes, and the wavefront's predicted ratio.

    python benchmarks/titans_cp.py [--seq-lens 1024,4096] [--variants mag,mal,mac] [--cps 1,2]
                                   [--steps 3] [key=value ...]

Each (variant, seq_len, cp) is one run of benchmarks/context_parallel.py's measurement (`launch`:
`cp` fresh processes of one thread each; rank 0's activation peak beside the memory model, the
median step time, the c10d calls of one forward_backward) on Titans with context_parallel.py's
narrow shape (2 layers, d_model 64, 4 heads over 2 kv heads, one sequence per micro-batch, fp32
on the CPU) and the Titans defaults (window 64, chunk 16, 4 persistent tokens, a depth-2 memory,
convolutions of 4 taps). Added to each row:
  comm_theory            rank 0 sends its state message once per layer forward and nothing
                         backward (it receives the gradient): n_layers x cp_state_bytes(rank 1)
                         point-to-point (context_parallel.py's theory is the attention families')
  measured_time_ratio    step time / the cp = 1 step time of the same (variant, seq_len)
  predicted_time_ratio   the wavefront's (L + cp - 1) / (L cp), with each rank on its own core
                         and the messages free (titans/cost.py wavefront_ratio)

Prints one JSON object: {"config": ..., "results": [...]}. Where the ranks share cores (this
project's 2-core test machine) the cp = 2 processes cannot run in parallel and the measured ratio
says so rather than measuring the wavefront.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]


def main() -> None:
    from context_parallel import SHAPE, launch

    from megatron_taper.config import load_config
    from megatron_taper.models.titans.cost import cp_state_bytes, wavefront_ratio

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", default="1024,4096")
    parser.add_argument("--variants", default="mag,mal,mac")
    parser.add_argument("--cps", default="1,2")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    results = []
    for variant in args.variants.split(","):
        for seq in (int(x) for x in args.seq_lens.split(",")):
            base = None
            for cp in (int(x) for x in args.cps.split(",")):
                overrides = ["model.arch=titans", f"model.titans.variant={variant}", f"model.seq_len={seq}",
                             *args.overrides]
                row = launch(overrides, cp, args.steps)
                cfg = load_config(None, SHAPE + overrides + [f"parallel.cp={cp}"])
                per_layer = cp_state_bytes(cfg.model, 1, cp, cfg.train.micro_batch) if cp > 1 else 0
                row["variant"] = variant
                row["comm_theory"] = {"p2p_send": {"calls_per_layer": 1 if cp > 1 else 0,
                                                   "bytes": cfg.model.n_layers * per_layer}}
                base = row["step_time_s"] if cp == 1 else base
                row["measured_time_ratio"] = row["step_time_s"] / base if base else None
                row["predicted_time_ratio"] = wavefront_ratio(cfg.model.n_layers, cp)
                results.append(row)
                print(json.dumps({k: row[k] for k in ("variant", "seq_len", "cp", "step_time_s",
                                                      "measured_time_ratio", "predicted_time_ratio")}),
                      file=sys.stderr)
    print(json.dumps({"config": SHAPE + args.overrides, "results": results}, indent=1))


if __name__ == "__main__":
    main()
