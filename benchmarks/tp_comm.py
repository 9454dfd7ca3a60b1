"""Tensor-parallel communication per training step: counted on a real run vs the Megatron formula.

    python benchmarks/tp_comm.py [--tp 2] [--config configs/tiny_taper.yaml] [key=value ...]

Re-launches itself under torchrun with `--tp` processes (gloo on CPU, NCCL on GPUs), builds the
recipe's model with parallel.tp, and runs one optimizer step's forward_backward (train.global_batch
/ train.micro_batch micro-batches of random tokens) + reduce_gradients + clip_gradients under a
dispatch mode that records every c10d collective. Prints one JSON object (rank 0):

  measured[op] = {"calls", "bytes"}: bytes of the full-size buffer of each call (all-reduce:
      the reduced tensor; all-gather: the gathered output; reduce-scatter: the input)
  analytic: the same per-step counts from the shapes, after Megatron (Shoeybi et al. 2019;
      Korthikanti et al. 2022): per layer and micro-batch 4 all-reduces of B x S x D activations
      (2 forward: after attention and after the MLP; 2 backward: their inputs), plus one for the
      vocab-parallel embedding (forward) and one for the LM head input (backward), plus the
      vocab-parallel loss statistics (3 x B x S fp32) and the clipping norm (one fp32 scalar).
      With sequence parallelism each all-reduce becomes a reduce-scatter + an all-gather of the
      same size, and the norm weights' gradients are summed once per step.
  ring_bytes_per_rank: what a ring algorithm sends per rank (all-reduce 2 (tp-1)/tp x bytes,
      all-gather / reduce-scatter (tp-1)/tp x bytes).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_taper.build import build_run
from megatron_taper.config import load_config
from megatron_taper.parallel.context import init_parallel, shutdown, world_size
from megatron_taper.preflight import preflight
from megatron_taper.taper import layer_widths

KINDS = {  # c10d dispatcher op -> (kind, index of the full-size tensor argument)
    "allreduce_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
}


class CollectiveCounter(TorchDispatchMode):
    """Counts calls and buffer bytes of c10d collectives issued while active."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func._schema.name.split("::")[-1]
            if name in KINDS:
                kind, idx = KINDS[name]
                self.calls[kind] += 1
                self.bytes[kind] += _nbytes(args[idx])
            elif name not in ("barrier", "monitored_barrier_"):
                self.calls[f"other:{name}"] += 1
        return func(*args, **(kwargs or {}))


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(t) for t in x)  # lists (of lists) of tensors


def analytic(cfg, micro_batches: int, act_bytes: int) -> dict:
    m, p = cfg.model, cfg.parallel
    b, s, d, n = cfg.train.micro_batch, m.seq_len, m.d_model, m.n_layers
    act = b * s * d * act_bytes
    per_micro = (4 * n + 2) * act  # 4 per layer + embedding (fwd) + LM-head input (bwd)
    loss_stats = 3 * b * s * 4  # max [B*S] + (sum-exp, target logit) [2, B*S], fp32
    if not p.sequence_parallel:
        return {"all_reduce": {"calls": micro_batches * (4 * n + 2 + 2) + 1,
                               "bytes": micro_batches * (per_micro + loss_stats) + 4}}
    norm_grads = (2 * n + 1) * d * 4  # attn_norm, mlp_norm per layer, final norm (fp32 weights)
    return {
        "all_gather": {"calls": micro_batches * (4 * n + 2), "bytes": micro_batches * per_micro},
        "reduce_scatter": {"calls": micro_batches * (4 * n + 2), "bytes": micro_batches * per_micro},
        "all_reduce": {"calls": micro_batches * 2 + 2, "bytes": micro_batches * loss_stats + norm_grads + 4},
    }


def ring(kind: str, nbytes: int, tp: int) -> float:
    return nbytes * (2 if kind == "all_reduce" else 1) * (tp - 1) / tp


def run(config: str, overrides: list[str]) -> dict:
    cfg = load_config(config, overrides)
    preflight(cfg, world_size())
    ctx = init_parallel(cfg.parallel, cfg.train.device)
    try:
        pm = build_run(cfg, ctx).model
        micro = cfg.train.global_batch // cfg.train.micro_batch
        gen = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.model.seq_len + 1),
                                 generator=gen) for _ in range(micro)]
        counter = CollectiveCounter()
        with counter:
            pm.forward_backward(batches, contextlib.nullcontext)
            pm.reduce_gradients()
            pm.clip_gradients(cfg.train.grad_clip)
        measured = {k: {"calls": counter.calls[k], "bytes": counter.bytes.get(k, 0)} for k in sorted(counter.calls)}
        expected = analytic(cfg, micro, torch.finfo(torch.float32).bits // 8)
        tp = ctx.tp
        total_measured = sum(v["bytes"] for v in measured.values())
        total_expected = sum(v["bytes"] for v in expected.values())
        return {
            "tp": tp,
            "sequence_parallel": cfg.parallel.sequence_parallel,
            "model": {"n_layers": cfg.model.n_layers, "d_model": cfg.model.d_model, "n_heads": cfg.model.n_heads,
                      "n_kv_heads": cfg.model.kv_heads, "vocab_size": cfg.model.vocab_size,
                      "mlp_widths": layer_widths(cfg.model)},
            "micro_batch": cfg.train.micro_batch, "seq_len": cfg.model.seq_len, "micro_batches_per_step": micro,
            "dtype": "float32",
            "measured": measured,
            "analytic": expected,
            "measured_bytes_total": total_measured,
            "analytic_bytes_total": total_expected,
            "measured_over_analytic": total_measured / total_expected,
            "ring_bytes_per_rank": sum(ring(k, v["bytes"], tp) for k, v in measured.items() if k in expected),
        }
    finally:
        shutdown(ctx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--config", default="configs/tiny_taper.yaml")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if "WORLD_SIZE" not in os.environ:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.tp),
               __file__, "--tp", str(args.tp), "--config", args.config, *args.overrides]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        sys.exit(subprocess.run(cmd, env=env).returncode)
    result = run(args.config, [f"parallel.tp={args.tp}", "train.precision=fp32", *args.overrides])
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
