"""The second prepared GPU check (docs/gpu.md): every model family on one CUDA GPU, and resume there.

1. Parity per family: each family's tiny recipe (configs/tiny_*.yaml, byte tokens of real text) for
   10 Trainer steps on the CPU and on the GPU from the same weights and batches, in fp32 (tolerance
   gpu_check.PARITY_TOL) and in bf16 autocast (gpu_check.BF16_TOL).
2. Memory and speed per family in bf16: each family's smallest size-class recipe (125M; 760M for
   the memory-caching families; the tree and the bridge have tiny recipes only, at vocab 4096; the
   bridge without its carried state, EXTRA) at
   pp = 1, no ZeRO, global batch 8 of micro-batches 4 (2 for the 760M ones): step time, tokens/s,
   peak allocated GPU memory and the layout planner's predicted peak and step (gpu_check.throughput).
3. Resume on the GPU: the tiny Transformer (fsdp2 at dp = 1) and tiny Titans in bf16, 6 steps
   straight and again stopped after 3 (train.exit_after) and resumed: are the loss sequences
   bitwise equal (`bitwise`), and the largest difference.

Every part runs in its own try and the JSON is rewritten after each (gpu_check.attempt); exit 1
when a parity or a resume is off or a part failed. `--smoke` runs the same code on the CPU at 2
steps for SMOKE's tiny recipes, fp32 only, and the first resume (tests/launch/test_gpu_check.py).

    python benchmarks/gpu_families.py [--out benchmarks/results/gpu_families.json] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_check import attempt, byte_tokens, parity, random_tokens, throughput, write  # noqa: E402

from megatron_taper.config import load_config  # noqa: E402

TINY = ["taper", "gated_attention", "titans", "hope_attention", "linear_memory_caching",
        "deep_memory_caching", "tree", "bridge"]
SIZED = {  # family -> (recipe, micro-batch)
    "transformer": ("transformer_125m_taper", 4), "gated_attention": ("gated_attention_125m_taper", 4),
    "titans": ("titans_125m_taper", 4), "hope_attention": ("hope_attention_125m_taper", 4),
    "linear_memory_caching": ("linear_memory_caching_760m_taper", 2),
    "deep_memory_caching": ("deep_memory_caching_760m_taper", 2),
    "tree": ("tiny_tree", 4), "bridge": ("tiny_bridge", 4)}
# a carried bridge state needs row streams, which read MDS shards (mosaicml-streaming, not on the GPU
# image): the bridge runs within each window there
EXTRA = {"bridge": ("model.bridge.carry_state=false",)}
SIZED_VARIANT = {"activation_checkpointing": "none"}
SMOKE = ["taper", "bridge"]  # --smoke: fp32 parity, the sized run (bridge) and the first resume
RESUMED = {"transformer": ("tiny_taper", ["parallel.zero=fsdp2"]), "titans": ("tiny_titans", [])}


def sized_shape(family: str, micro: int, bf16: bool) -> list[str]:
    """The sized runs' step: global batch 8 of `micro`-sequence micro-batches."""
    return ["train.global_batch=8", f"train.micro_batch={micro}",
            "train.precision=bf16" if bf16 else "train.precision=fp32", *EXTRA.get(family, ())]


def resume(folder: str, device: str, config: str, extra: list[str], steps: int) -> dict:
    """`steps` steps straight, and stopped at half then resumed, by the command line's main."""
    from megatron_taper.train import main

    common = ["--config", f"configs/{config}.yaml", "model.vocab_size=256", f"data.path={byte_tokens(folder)}",
              "run.tensorboard=false", f"train.device={device}", f"train.steps={steps}", "train.log_interval=1",
              f"checkpoint.interval={steps // 2}", *extra]
    if device == "cuda":
        common.append("train.precision=bf16")

    def losses(run: str) -> list[float]:
        with open(Path(folder) / run / "metrics.jsonl") as f:
            return [r["loss"] for r in map(json.loads, f) if "loss" in r]

    codes = [main([*common, f"run.dir={folder}/{config}_straight"]),
             main([*common, f"run.dir={folder}/{config}_split",
                   f"train.exit_after={steps // 2}"]),
             main([*common, f"run.dir={folder}/{config}_split"])]
    straight, split = losses(f"{config}_straight"), losses(f"{config}_split")
    diff = max((abs(a - b) for a, b in zip(straight, split)), default=float("inf"))
    return {"config": config, "exit_codes": codes, "straight": straight, "resumed": split,
            "bitwise": straight == split, "max_abs_diff": diff,
            "ok": codes == [0, 0, 0] and straight == split and len(straight) == steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/gpu_families.json")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="the tiny recipes on any device, 2 steps")
    args = parser.parse_args()
    began = time.perf_counter()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("error: no CUDA device (use --smoke to exercise the script on the CPU)", file=sys.stderr)
        return 2
    device = "cuda" if cuda else "cpu"
    steps = 2 if args.smoke else args.steps
    report: dict = {"benchmark": "gpu_families", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                    "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                    "smoke": args.smoke}
    write(report, args.out)
    with tempfile.TemporaryDirectory() as folder:
        for family in SMOKE if args.smoke else TINY:
            for precision in ("fp32",) if args.smoke else ("fp32", "bf16"):
                attempt(report, args.out, "parity", parity, folder, device, steps, precision,
                        f"configs/tiny_{family}.yaml", EXTRA.get(family, ()), append=True)
        for family, (config, extra) in list(RESUMED.items())[:1 if args.smoke else None]:
            attempt(report, args.out, "resume", resume, folder, device, config, extra, 6, append=True, family=family)
        for family, (recipe, micro) in SIZED.items():
            if args.smoke and family not in SMOKE:
                continue
            config = f"configs/{recipe}.yaml"
            vocab = load_config(config, []).model.vocab_size
            shape = [*sized_shape(family, micro, cuda), f"train.device={device}",
                     f"data.path={random_tokens(folder, vocab, 2_000_000)}"]
            attempt(report, args.out, "sized", throughput, shape, folder, SIZED_VARIANT,
                    steps, 2, float("inf"), config, "none", append=True, family=family, recipe=recipe)
    report["elapsed_s"] = time.perf_counter() - began
    write(report, args.out)
    json.dump(report, sys.stdout)
    print()
    parts = report["parity"] + report["resume"]
    ok = all(r.get("ok") for r in parts) and not any("failed" in r for r in report.get("sized", []))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
