"""Measured peak memory of a whole training step per layout, next to the memory model's prediction.

    python benchmarks/layout_memory.py [--layouts fsdp2_dp2,fsdp2_pp2_dp2,fsdp2_hsdp_2x2,deepspeed_dp2]
                                       [--precisions fp32,bf16] [--steps 1] [key=value ...]

Each layout and precision runs in fresh gloo processes through benchmarks/activation_memory.py
`--full-step` (the same measurement as the activation tests: host RSS with
MALLOC_MMAP_THRESHOLD_=65536, VmHWM reset through /proc/self/clear_refs): `--steps` warm-up
training steps, then the peak of one more, per rank, against that rank's predicted peak
(cost/memory.py, with the AdamW state). The model (SHAPE: 4 layers, d_model 512, MLP width 1536
tapered, vocabulary 16384, 29M parameters; 16 sequences of 128 tokens per step, micro-batches of
4, so at dp = 2 every rank accumulates gradients over 2 micro-batches, and the pipeline's 8
sequences per rank are 4 micro-batches of 2: 1F1B then reaches its steady state, where the first
stage holds 2 micro-batches' activations next to the fp32 gradients accumulated so far) is large
enough that the state terms under test (fp32 gradients accumulated between the pipeline's
micro-batches, DeepSpeed's fp32 partitions and moments, bf16 cast copies) are tens of MiB.
Layouts (LAYOUTS) also include fsdp2_pp2_dp2_interleaved and fsdp2_pp2_dp2_zbv: 2 chunks of one
block per pp rank, each its own FSDP root; their prediction is the rank's (PipelinePlan
.rank_peak_bytes: interleaved 1F1B's rule, ZB-V's walk of torch's action list); fsdp2_cp2, fsdp2_cp2_dp2 and
fsdp2_cp2_pp2: context parallelism at cp = 2, the state sharded over dp x cp.
Prints one JSON object: per layout, precision and rank, measured and predicted peaks and their
ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

SHAPE = ["model.n_layers=4", "model.d_model=512", "model.n_heads=8", "model.mlp_width=1536", "model.taper.multiple=64",
         "model.vocab_size=16384", "model.seq_len=128", "train.global_batch=16", "train.micro_batch=4",
         "parallel.deepspeed.param_persistence_threshold=0"]
LAYOUTS = {  # name -> (processes, overrides)
    "none_dp1": (1, ["parallel.zero=none"]),
    "fsdp2_dp2": (2, ["parallel.zero=fsdp2"]),
    "fsdp2_pp2_dp2": (4, ["parallel.zero=fsdp2", "parallel.pp=2", "parallel.microbatches=4"]),
    # 2 chunks of 1 block per rank, each its own FSDP root
    "fsdp2_pp2_dp2_interleaved": (4, ["parallel.zero=fsdp2", "parallel.pp=2", "parallel.microbatches=4",
                                      "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual=2"]),
    "fsdp2_pp2_dp2_zbv": (4, ["parallel.zero=fsdp2", "parallel.pp=2", "parallel.microbatches=4",
                              "parallel.pp_schedule=zbv"]),
    "fsdp2_hsdp_2x2": (4, ["parallel.zero=fsdp2", "parallel.dp_replicate=2", "parallel.dp_shard=2"]),
    "deepspeed_dp2": (2, ["parallel.zero=deepspeed"]),
    # context parallelism: fsdp2 shards over dp x cp (each sequence split over the cp ranks)
    "fsdp2_cp2": (2, ["parallel.zero=fsdp2", "parallel.cp=2"]),
    "fsdp2_cp2_dp2": (4, ["parallel.zero=fsdp2", "parallel.cp=2"]),
    "fsdp2_cp2_pp2": (4, ["parallel.zero=fsdp2", "parallel.cp=2", "parallel.pp=2", "parallel.microbatches=4"]),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="fsdp2_dp2,fsdp2_pp2_dp2,deepspeed_dp2")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--steps", type=int, default=1, help="warm-up training steps before the measured one")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from activation_memory import measure

    rows = []
    for name in args.layouts.split(","):
        nproc, layout = LAYOUTS[name]
        for precision in args.precisions.split(","):
            overrides = SHAPE + layout + [f"train.precision={precision}", *args.overrides]
            for row in measure(overrides, "none", nproc, args.steps, full=True):
                rows.append({"layout": name, "precision": precision, "rank": row["rank"],
                             "measured_peak_mib": round(row["measured_peak_bytes"] / 2**20, 1),
                             "predicted_peak_mib": _mib(row["predicted_peak_bytes"]),
                             "ratio": None if row["peak_ratio"] is None else round(row["peak_ratio"], 3),
                             "resident_before_step_mib": round(row["resident_before_step_bytes"] / 2**20, 1),
                             "predicted_static_mib": round(row["predicted_static_bytes"] / 2**20, 1)})
                print(json.dumps(rows[-1]), file=sys.stderr)
    print(json.dumps({"benchmark": "layout_memory", "shape": SHAPE + args.overrides, "rows": rows}))


def _mib(n: float | None) -> float | None:
    return None if n is None else round(n / 2**20, 1)


if __name__ == "__main__":
    main()
