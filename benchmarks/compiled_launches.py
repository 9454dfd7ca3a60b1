"""Host launches of a compiled block against the eager operators the planner counts for it,
measured on the CPU with a real inductor compile (the numbers cost/speedups.json
`compiled_launches` holds, for the step-time model's host term under train.compile).

    python benchmarks/compiled_launches.py [--recipe configs/X.yaml ...] [--seq-len 256] [--fp32] [--device cuda]

Per recipe: one block of the model narrowed as cost/op_count.py counts it (`narrowed`), compiled
as train.compile compiles it (parallel/block_options.py: inductor, static shapes, the block's
forward), then one forward and backward under bf16 autocast (how the GPU runs train: fp32 modules
under autocast; --fp32: without). inductor's generated code is read (run_and_get_code): in the
`call` function of the forward graph and of the backward graph, every call that runs work on the
device counts one launch: a fused kernel (`cpp_fused_*` on the CPU; `triton_*` kernels on CUDA),
an extern kernel (`extern_kernels.mm`, ...) or an ATen fallback (`torch.ops....(`, e.g. SDPA).
Buffer allocations and tensor views are not counted. Beside them, cost/op_count.py's eager counts
of one block (forward, and forward + backward) and the ratios launches / eager operators.

What the CPU's code is and is not: the same graphs and fusion decisions up to the backend's
codegen. The C++ backend may put loops of several reductions in one kernel where Triton on a GPU
emits one kernel per reduction, so a GPU's count can be higher. `--device cuda` counts the Triton
code of a GPU the same way (not run yet: no GPU was lent when this was written).

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import time

import torch
from torch._inductor.utils import run_and_get_code

from megatron_taper.config import load_config
from megatron_taper.cost.op_count import count_ops, narrowed
from megatron_taper.models import build_model
from megatron_taper.parallel.block_options import apply_block_options

RECIPES = ("configs/transformer_125m_taper.yaml", "configs/gated_attention_125m_taper.yaml")
KINDS = {"fused": re.compile(r"^\s+(?:\w+ = )?((?:cpp_fused|triton)_\w+)(?:\.run)?\(", re.M),
         "extern": re.compile(r"extern_kernels\.(\w+)\("),
         "aten": re.compile(r"torch\.ops\.\w+\.(\w+)\.\w+\(")}


def launches(code: str) -> dict[str, list[str]]:
    """The launches of one generated module's `call` function, by kind (module doc)."""
    call = code[code.index("def call("):]
    return {kind: pattern.findall(call) for kind, pattern in KINDS.items()}


def measure(recipe: str, seq_len: int, bf16: bool, device: torch.device) -> dict:
    cfg = narrowed(load_config(recipe, []).model, 1, seq_len)
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    apply_block_options(model, "none", 1, compile_blocks=True)
    tokens = torch.randint(0, cfg.vocab_size, (1, seq_len), device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            out = model(tokens)
        (out if torch.is_tensor(out) else out[0]).float().mean().backward()

    start = time.perf_counter()
    _, codes = run_and_get_code(step)
    seconds = time.perf_counter() - start
    graphs = [launches(code) for code in codes]
    assert len(graphs) == 2, f"{recipe}: {len(graphs)} graphs compiled for one block, expected its forward and backward"
    forward, backward = (sum(len(v) for v in g.values()) for g in graphs)
    eager = count_ops(load_config(recipe, []).model, seq_len)
    return {"recipe": recipe, "seq_len": seq_len, "autocast": "bf16" if bf16 else "none",
            "forward_launches": forward, "backward_launches": backward,
            "eager_forward_ops": eager.block_forward, "eager_block_ops": eager.block,
            "forward_ratio": forward / eager.block_forward, "block_ratio": (forward + backward) / eager.block,
            "launches_by_kind": [{kind: len(names) for kind, names in g.items()} for g in graphs],
            "compile_and_run_s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", action="append", help=f"default: {', '.join(RECIPES)}")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--fp32", action="store_true", help="without bf16 autocast")
    parser.add_argument("--device", default="cpu", help="cpu (C++ kernels) or cuda (Triton kernels)")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = [measure(recipe, args.seq_len, not args.fp32, device) for recipe in args.recipe or RECIPES]
    print(json.dumps({"benchmark": "compiled_launches", "device": device.type, "torch": torch.__version__,
                      "rows": rows}))


if __name__ == "__main__":
    main()
