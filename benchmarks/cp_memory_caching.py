"""Memory Caching under context parallelism: per-rank step time, activation memory and
communication at cp = 1 and 2, beside the memory model and the communication theory
(models/memory_caching/cp.py).

    python benchmarks/cp_memory_caching.py [--cases linear_memory:grm,deep_memory:grm]
                                           [--seq-lens 1024,2048] [--cps 1,2] [--steps 2] [key=value ...]

Shape: benchmarks/context_parallel.py's narrow model (2 layers, d_model 64, 4 heads of 16,
vocabulary 256, MLP 176, one sequence per micro-batch, fp32 on the CPU, gloo) with
model.arch / model.memory_caching.variant from each case and model.memory_caching.segment=256
(overrides after the flags apply to every run). Each (case, seq_len, cp) runs on `cp` fresh
processes through context_parallel.worker (the same measurements: the host-RSS peak of one
forward+backward after a warm-up, beside memory.model_memory's activations; the median step time;
the c10d calls of one forward_backward), on EVERY rank, since the ranks differ here: a later
slice reads more cached states, and in the deep memory's chain rank r sends the handover of r + 1
slices. The communication theory per rank and micro-batch (`theory`): all-reduces as the
Transformer's (two scalars and DDP's fp32 gradients); linear memory: per layer 2 (3 gated)
all-gathers of the segments' summaries forward and as many reduce-scatters backward
(summary_sizes); p2p sends per layer: the convolution halo forward (ranks r < cp - 1) and its
gradient backward (r > 0), and for the deep memory the chain's handover forward (r < cp - 1, after
r + 1 slices) and its gradient backward (r > 0, after r slices) (halo_bytes, handover_sizes).
With parallel.cp_attention=ulysses (memory_caching/cp.py ulysses_reads) neither: per layer two
all-to-alls forward (the memory's inputs, the reads back) and two backward, each call's buffer
(cost/cp.py cp_messages' all-to-all bytes, twice).

Prints one JSON object: {"config": ..., "results": [one per (case, seq_len, cp), with "ranks"]}.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, HERE]

EXTRA = ["model.memory_caching.segment=256"]


def theory(mcfg, cp: int, rank: int, micro_batch: int, params: int, attention: str = "allgather") -> dict:
    """c10d calls and bytes of one micro-batch's forward_backward on cp rank `rank` (module doc)."""
    from megatron_taper.cost.cp import ALLTOALL, cp_messages
    from megatron_taper.models.memory_caching.cost import halo_bytes, handover_sizes, segments_per_slice, summary_sizes

    if cp == 1:
        return {}
    layers = mcfg.n_layers
    out = {"all_reduce": {"bytes": 8 + 4 * params}}
    if attention == "ulysses":
        blocks = cp_messages(mcfg, micro_batch, mcfg.seq_len, cp, attention=attention)
        return {**out, "all_to_all": {"calls": 4 * layers, "bytes": 2 * sum(m.bytes for block in blocks
                                                                            for m in block if m.kind == ALLTOALL)}}
    sends = [(1, halo_bytes(mcfg, micro_batch))] * ((rank < cp - 1) + (rank > 0)) if halo_bytes(mcfg, 1) else []
    if mcfg.arch == "deep_memory":
        n = segments_per_slice(mcfg, cp)
        sends += [handover_sizes(mcfg, micro_batch, (rank + 1) * n)] if rank < cp - 1 else []
        sends += [handover_sizes(mcfg, micro_batch, rank * n)] if rank > 0 else []
    else:
        calls, size = summary_sizes(mcfg, cp, micro_batch)
        out["all_gather"] = {"calls": layers * calls, "bytes": layers * size}
        out["reduce_scatter"] = dict(out["all_gather"])
    if sends:
        out["p2p_send"] = {"calls": layers * sum(c for c, _ in sends), "bytes": layers * sum(b for _, b in sends)}
    return out


def worker(overrides: list[str], steps: int, out_dir: str) -> None:
    import torch.distributed as dist
    from context_parallel import SHAPE
    from context_parallel import worker as measure

    from megatron_taper.config import load_config
    from megatron_taper.models import build_model

    row = measure(overrides, steps)
    cfg = load_config(None, SHAPE + overrides)
    params = sum(p.numel() for p in build_model(cfg.model).parameters())
    row["comm_theory"] = theory(cfg.model, cfg.parallel.cp, row["rank"], cfg.train.micro_batch, params,
                                cfg.parallel.cp_attention)
    row.pop("comm_ring_bytes_per_rank")
    with open(os.path.join(out_dir, f"rank{row['rank']}.json"), "w") as f:
        json.dump(row, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def launch(overrides: list[str], cp: int, steps: int) -> list[dict]:
    """One measurement on `cp` fresh processes; every rank's row."""
    from context_parallel import launch_ranks

    return launch_ranks(__file__, overrides, cp, steps)


def main() -> None:
    from context_parallel import add_worker_arguments

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="linear_memory:grm,deep_memory:grm", help="arch:variant, comma-separated")
    parser.add_argument("--seq-lens", default="1024,2048")
    parser.add_argument("--cps", default="1,2")
    add_worker_arguments(parser)
    args = parser.parse_args()
    if args.worker:
        worker(args.overrides, args.steps, args.out)
        return
    results = []
    for case in args.cases.split(","):
        arch, variant = case.split(":")
        for seq in (int(x) for x in args.seq_lens.split(",")):
            base = None
            for cp in (int(x) for x in args.cps.split(",")):
                overrides = [f"model.arch={arch}", f"model.memory_caching.variant={variant}", f"model.seq_len={seq}",
                             *EXTRA, *args.overrides]
                ranks = launch(overrides, cp, args.steps)
                row = {"arch": arch, "variant": variant, "seq_len": seq, "cp": cp,
                       "cp_attention": ranks[0]["cp_attention"],
                       "step_time_s": max(r["step_time_s"] for r in ranks),
                       "peak_activation_bytes": max(r["measured_activation_bytes"] for r in ranks),
                       "predicted_activation_bytes": ranks[0]["predicted_activation_bytes"], "ranks": ranks}
                base = base or row
                row["vs_cp1"] = {"step_time": row["step_time_s"] / base["step_time_s"],
                                 "peak_activation": row["peak_activation_bytes"] / base["peak_activation_bytes"]}
                results.append(row)
    print(json.dumps({"config": EXTRA + args.overrides, "results": results}, indent=1))


if __name__ == "__main__":
    main()
