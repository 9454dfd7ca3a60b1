"""The second prepared GPU check (docs/gpu.md): every model family on one CUDA GPU, and resume there.

1. Speed matrix (`speed`, issue 39), bf16: each registered family (models.cards(); its smallest
   size-class recipe configs/<name>_<size>_taper.yaml, else its tiny recipe) in IMPORTANCE order, at
   pp = 1, no ZeRO, no activation checkpointing, global batch = one micro-batch of each of
   --micro-batches (4, 16; all families at 4 first, then all at 16), one row per VARIANTS entry:
   eager, compiled (train.compile: each block), compiled with the Triton kernels
   (MEGATRON_TAPER_KERNELS=triton, where the family's eager step reaches a kernel choice; the other
   rows run the torch form) and compiled + CUDA graphs (train.cuda_graphs: each compiled block
   replayed as CUDA graphs; skipped on the CPU).
   Before a family's rows, its reference: the compiled Transformer of the same size class
   (transformer_<size>_taper at the family's sequence length; REFERENCE for the tiny ones), unless
   already run. Per row: step time, tokens/s, MFU (gpu_check's conventions), peak allocated and
   reserved GPU memory, the first step's time and `compile_s` (first step minus a steady one),
   kernels per step (CUDA kernels of one more step under torch.profiler; on the CPU the ATen
   operators of an eager step under a TorchDispatchMode, labelled), the losses and, for compiled
   rows, their difference from the eager row's on the same batches from the same weights; the
   ratios to the reference, and `goals` (GOALS) evaluated on them.
2. Parity per family: each family's tiny recipe (configs/tiny_*.yaml, byte tokens of real text) for
   10 Trainer steps on the CPU and on the GPU from the same weights and batches, in fp32 (tolerance
   gpu_check.PARITY_TOL) and in bf16 autocast (gpu_check.BF16_TOL).
3. Resume on the GPU: the tiny Transformer (fsdp2 at dp = 1) and tiny Titans in bf16, 6 steps
   straight and again stopped after 3 (train.exit_after) and resumed: are the loss sequences
   bitwise equal (`bitwise`), and the largest difference.

A budget (--budget-s, 480 s for the whole script): speed rows start until --budget-s minus
--reserve-s (kept for parts 2 and 3), those start until --budget-s; what is left is reported as
`skipped` with the reason, never estimated; a row's timed steps stop at its deadline (`truncated`).
Every row and part runs in its own try and the JSON is rewritten after each (gpu_check.attempt);
an out-of-memory row is recorded (`oom`) and the run goes on. Exit 1 when a parity or a resume is
off or a row or part failed other than by running out of memory. `--smoke` runs the same code on
the CPU: speed rows for the Transformer and linear memory caching at their tiny recipes (2 blocks), micro-batch
2, 2 steps, eager for both and compiled for the Transformer only (a CPU compile takes 20-40 s); fp32
parity for SMOKE's tiny recipes and the first resume, both on 2 sequences of 32 tokens a step
(gpu_check.SMOKE_STEP) (tests/launch/test_gpu_check.py).

    python benchmarks/gpu_families.py [--out benchmarks/results/gpu_families.json] [--smoke]
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_check import (  # noqa: E402
    SMOKE_STEP,
    attempt,
    byte_tokens,
    close_trainer,
    parity,
    peak_memory,
    prediction,
    random_tokens,
    release_memory,
    run_config,
    sync,
    write,
)

from megatron_taper.config import load_config  # noqa: E402
from megatron_taper.cost.flops import mfu, model_costs, peak_flops  # noqa: E402
from megatron_taper.models import cards  # noqa: E402
from megatron_taper.models.kernels import state_passing  # noqa: E402
from megatron_taper.training.metrics import read_metrics  # noqa: E402
from megatron_taper.training.trainer import Trainer  # noqa: E402

# the 2026-12-04 run's `sized` rows (global batch 8 of micro-batches 4, 2 for the 760M ones), which
# benchmarks/gpu_predictions.py rebuilds from these names; the speed matrix replaced that part
SIZED = {  # family -> (recipe, micro-batch)
    "transformer": ("transformer_125m_taper", 4), "gated_attention": ("gated_attention_125m_taper", 4),
    "titans": ("titans_125m_taper", 4), "hope_attention": ("hope_attention_125m_taper", 4),
    "linear_memory_caching": ("linear_memory_caching_760m_taper", 2),
    "deep_memory_caching": ("deep_memory_caching_760m_taper", 2),
    "tree": ("tiny_tree", 4), "bridge": ("tiny_bridge", 4)}
# a carried bridge state needs row streams, which read MDS shards (mosaicml-streaming, not on the GPU
# image): the bridge runs within each window there
EXTRA = {"bridge": ("model.bridge.carry_state=false",)}
SIZED_VARIANT = {"activation_checkpointing": "none", "compile": False}  # the 2026-12-04 sized runs: eager
SMOKE = ["transformer", "bridge"]  # --smoke: fp32 parity of these families' tiny recipes and the first resume
RESUMED = {"transformer": ("tiny_taper", ["parallel.zero=fsdp2"]), "titans": ("tiny_titans", [])}

# -- the speed matrix --------------------------------------------------------------------------------
# issue 39's order; registered families not named here follow in the registry's order
IMPORTANCE = ("transformer", "linear_memory", "titans", "deep_memory", "hope_attention", "gated_attention",
              "bridge", "tree")
SMOKE_SPEED = ("transformer", "linear_memory")
SMOKE_COMPILED = "transformer"  # --smoke compiles this family's row only (the reference of the others)
# --smoke's recipes at 2 blocks: a compiled row compiles one static graph per distinct block width
SMOKE_OVERRIDES = ("model.n_layers=2",)
# variant -> (train.compile, MEGATRON_TAPER_KERNELS, CUDA graphs)
VARIANTS = {"eager": (False, "torch", False), "compiled": (True, "torch", False),
            "compiled_kernels": (True, "triton", False), "compiled_graphs": (True, "torch", True)}
COMPILED = ("compiled", "compiled_kernels", "compiled_graphs")
# a family whose same-size Transformer is not transformer_<size>_taper / tiny_taper: the bridge's is
# its own recipe without the bridge (tiny_bridge_none.yaml), read in windows as the bridge rows are
REFERENCE = {"bridge": ("tiny_bridge_none", ("data.row_streams=false",))}
# issue 39's goals against the compiled Transformer of the same size and micro-batch in the same run:
# (family, the variants any of whose rows may meet it, conditions (measure, "<=" | ">=", bound), text)
TOKENS, STEP, PEAK = "tokens_per_s_vs_reference", "step_vs_reference", "peak_allocated_vs_reference"
GOALS = (
    ("linear_memory", COMPILED, ((TOKENS, ">=", 0.7),), "linear MC >= 0.7x tokens/s"),
    ("titans", ("compiled",), ((TOKENS, ">=", 0.35),), "Titans >= 0.35x tokens/s, torch form compiled"),
    ("titans", ("compiled_kernels",), ((TOKENS, ">=", 0.7),), "Titans >= 0.7x tokens/s with the kernels"),
    ("deep_memory", ("compiled",), ((TOKENS, ">=", 0.35),), "deep MC >= 0.35x tokens/s, torch form compiled"),
    ("deep_memory", ("compiled_kernels",), ((TOKENS, ">=", 0.7),), "deep MC >= 0.7x tokens/s with the kernels"),
    ("hope_attention", COMPILED, ((TOKENS, ">=", 0.3), (PEAK, "<=", 1.5)), "Hope >= 0.3x tokens/s, peak <= 1.5x"),
    ("bridge", COMPILED, ((STEP, "<=", 1.5),), "bridge step <= 1.5x"))
SIZE_CLASS = re.compile(r"^.+_(?P<size>\d+(?:\.\d+)?)(?P<unit>[mb])_taper$")


def sized_shape(family: str, micro: int, bf16: bool) -> list[str]:
    """The 2026-12-04 sized runs' step: global batch 8 of `micro`-sequence micro-batches."""
    return ["train.global_batch=8", f"train.micro_batch={micro}",
            "train.precision=bf16" if bf16 else "train.precision=fp32", *EXTRA.get(family, ())]


def family_recipes(configs: str = "configs", tiny: bool = False) -> dict[str, str]:
    """model.arch -> its recipe's name: the smallest size class (<name>_<size>_taper.yaml), else (and
    with `tiny` always) the shortest-named configs/tiny_*.yaml of that arch."""
    found: dict[str, tuple] = {}
    for path in sorted(Path(configs).glob("*.yaml")):
        match = SIZE_CLASS.match(path.stem)
        if match and not tiny:
            rank = (0, float(match["size"]) * (1e3 if match["unit"] == "b" else 1.0), path.stem)
        elif path.stem.startswith("tiny_"):
            rank = (1, len(path.stem), path.stem)
        else:
            continue
        try:
            arch = load_config(str(path), []).model.arch
        except Exception:  # noqa: BLE001 - a recipe that does not load is not a candidate
            continue
        if arch not in found or rank < found[arch][0]:
            found[arch] = (rank, path.stem)
    return {arch: name for arch, (_, name) in found.items()}


def reference_of(arch: str, recipe: str, seq_len: int) -> tuple[str, tuple[str, ...]] | None:
    """(recipe, overrides) of the compiled Transformer that `arch`'s rows are measured against."""
    if arch in REFERENCE:
        return REFERENCE[arch]
    match = SIZE_CLASS.match(recipe)
    ref = f"transformer_{match['size']}{match['unit']}_taper" if match else "tiny_taper"
    if not Path(f"configs/{ref}.yaml").exists():
        return None
    return ref, () if load_config(f"configs/{ref}.yaml", []).model.seq_len == seq_len else (f"model.seq_len={seq_len}",)


def plan(families: list[str], micro_batches: list[int], smoke: bool, cuda: bool) -> list[dict]:
    """The speed rows in running order, each {"label": the row's fields, "skip": a reason or None}."""
    recipes = family_recipes(tiny=smoke)
    rows, planned = [], set()
    for micro in micro_batches:
        for arch in families:
            recipe = recipes.get(arch)
            if recipe is None:
                rows.append({"label": {"family": arch, "micro_batch": micro}, "skip": "no recipe in configs/"})
                continue
            extra = SMOKE_OVERRIDES if smoke else ()
            overrides = (*EXTRA.get(arch, ()), *extra)
            reference = reference_of(arch, recipe, load_config(f"configs/{recipe}.yaml", []).model.seq_len)
            reference = reference and (reference[0], (*reference[1], *extra))
            if reference == (recipe, overrides):  # the family is its own reference (the Transformer)
                planned.add((reference, micro))
            elif reference is not None and (reference, micro) not in planned:
                planned.add((reference, micro))
                rows.append({"label": row_label("transformer", "reference", reference, "compiled", micro, None),
                             "skip": None})
            for variant, (compiled, kernels, cuda_graphs) in VARIANTS.items():
                skip = None
                if smoke and compiled and arch != SMOKE_COMPILED:
                    skip = "--smoke compiles one family's row only (a CPU compile takes 20-40 s)"
                if kernels == "triton" and not cuda:
                    skip = "the Triton kernels need CUDA"
                if cuda_graphs and not cuda:
                    skip = "CUDA graphs need CUDA"
                rows.append({"label": row_label(arch, "family", (recipe, overrides), variant, micro, reference),
                             "skip": skip})
    return rows


def row_label(arch: str, role: str, recipe: tuple[str, tuple[str, ...]], variant: str, micro: int,
              reference: tuple[str, tuple[str, ...]] | None) -> dict:
    compiled, kernels, graphs = VARIANTS[variant]
    label = {"family": arch, "role": role, "recipe": recipe[0], "overrides": list(recipe[1]), "variant": variant,
             "micro_batch": micro, "compile": compiled, "kernels": kernels, "cuda_graphs": graphs}
    if reference is not None:
        label["reference"] = {"recipe": reference[0], "overrides": list(reference[1]), "variant": "compiled"}
    return label


def speed_row(recipe: str, overrides: list[str], variant: str, micro: int, data: str, folder: str, device: str,
              warmup: int, steps: int, row_s: float, deadline: float, index: int) -> dict:
    """One row of the matrix: `warmup` steps (the first timed alone: compile), then up to `steps`
    timed ones (fewer once `row_s` or `deadline` has passed), then one counted step."""
    compiled, kernels, graphs = VARIANTS[variant]
    cuda = device == "cuda"
    shape = [f"train.global_batch={micro}", f"train.micro_batch={micro}", f"train.device={device}",
             f"data.path={data}", f"train.precision={'bf16' if cuda else 'fp32'}"]
    extra = [*overrides, f"run.dir={folder}/speed_{index:03d}_{recipe}_{variant}_mb{micro}"]
    cfg = run_config(f"configs/{recipe}.yaml", shape, folder, {"activation_checkpointing": "none", "compile": compiled,
                                                                "cuda_graphs": graphs, "overrides": extra}, "none")
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    env = mock.patch.dict(os.environ, {state_passing.KERNELS_ENV: kernels})
    from torch._dynamo.utils import counters

    graphs_before = counters["stats"]["unique_graphs"]
    breaks_before = sum(counters["graph_break"].values())
    with env:
        trainer = Trainer(cfg)
        step = functools.partial(train_loss, trainer)
        try:
            dev = trainer.ctx.device
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            # eager rows count the memory recurrences' kernel choices (kernels.state_passing) of their first step
            watch = mock.patch.object(state_passing, "kernel_choice", wraps=state_passing.kernel_choice)
            start = time.perf_counter()
            with (contextlib.nullcontext() if compiled else watch) as choices:
                losses = [step()]
            sync(dev)
            first_s = time.perf_counter() - start
            losses += [step() for _ in range(warmup - 1)]
            sync(dev)
            start, done = time.perf_counter(), 0
            while done < steps and (done == 0 or (time.perf_counter() < deadline
                                                  and time.perf_counter() - start < row_s)):
                losses.append(step())
                done += 1
            sync(dev)
            step_s = (time.perf_counter() - start) / done
            tokens = micro * cfg.model.seq_len
            peak = peak_flops(dev, trainer.bf16)
            causal, full = model_costs(cfg.model), model_costs(cfg.model, causal=False)
            result = {"seq_len": cfg.model.seq_len, "precision": cfg.train.precision, "bf16": trainer.bf16,
                      "params": causal.total_params, "steps": done, "truncated": done < steps,
                      "step_s": step_s, "tokens_per_s": tokens / step_s, "first_step_s": first_s,
                      "mfu_causal": mfu(tokens / step_s, causal.total_flops, peak),
                      "mfu_full_attention": mfu(tokens / step_s, full.total_flops, peak)}
            if choices is not None:
                result["kernel_calls"] = choices.call_count  # torch form or Triton, per step
            if compiled:
                result.update(compile_s=first_s - step_s,
                              graphs=counters["stats"]["unique_graphs"] - graphs_before,
                              graph_breaks=sum(counters["graph_break"].values()) - breaks_before)
            peak_bytes, peaks = peak_memory(dev)
            result.update(peaks)
            if time.perf_counter() < deadline:
                try:
                    result.update(count_step(step, dev, compiled, losses))
                except Exception as e:  # noqa: BLE001 - the row stands without its count
                    result["kernels_failed"] = f"{type(e).__name__}: {e}"
            else:
                result["kernels_skipped"] = "time budget spent"
            result["losses"] = [float(loss) for loss in losses]
            result["first_loss"] = result["losses"][0]
            if not compiled:  # the planner models eager steps (compile's fusion is not modelled)
                result.update(prediction(cfg, step_s, peak_bytes))
            return result
        finally:
            close_trainer(trainer)
            del trainer, step
            release_memory()


def train_loss(trainer: Trainer) -> torch.Tensor:
    """One Trainer step; its loss, on the device."""
    return trainer.train_step()["loss"]


def count_step(step, device: torch.device, compiled: bool, losses: list) -> dict:
    """One more step, counted: its CUDA kernels (torch.profiler, CUPTI) on a GPU; on the CPU the ATen
    operators an eager step dispatches (a TorchDispatchMode, as cost/op_count.py counts)."""
    if device.type == "cuda":
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            losses.append(step())
            sync(device)
        events = [e for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CUDA]
        kernels = sum(1 for e in events if e.activity_type() == "kernel")
        if kernels == 0:
            raise RuntimeError(f"the profiler recorded no CUDA kernel ({len(events)} device events): CUPTI missing?")
        return {"kernels_per_step": kernels, "kernel_count": "CUDA kernels of one step (torch.profiler)"}
    if compiled:
        # under a dispatch mode dynamo runs the blocks eagerly, so an ATen count says nothing of compile
        return {"kernels_per_step": None, "kernel_count": "not counted: compiled, on the CPU (no CUDA kernels)"}
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    counter = Counter()
    with counter:
        losses.append(step())
    return {"kernels_per_step": counter.n, "kernel_count": "ATen operators of one step (CPU: TorchDispatchMode)"}


def finish_row(row: dict, rows: list[dict]) -> None:
    """Add to a measured row its ratios to its reference and its loss difference from eager (again
    after every row: a reference or an eager row may come later)."""
    if "tokens_per_s" not in row:
        return
    for key in ("ratio_missing", "loss_diff_missing"):
        row.pop(key, None)
    ref = row.get("reference") or (row if row["variant"] == "compiled" else None)
    if ref is not None:
        base = find(rows, ref["recipe"], ref["overrides"], row["micro_batch"], "compiled")
        if base is None or "tokens_per_s" not in base:
            row["ratio_missing"] = f"the reference {ref['recipe']} compiled has no measurement: " + (
                "not run" if base is None else base.get("skipped") or base.get("failed", "?"))
        else:
            row[TOKENS] = row["tokens_per_s"] / base["tokens_per_s"]
            row[STEP] = row["step_s"] / base["step_s"]
            if "peak_allocated_gib" in row and "peak_allocated_gib" in base:
                row[PEAK] = row["peak_allocated_gib"] / base["peak_allocated_gib"]
    if row["compile"]:
        eager = find(rows, row["recipe"], row["overrides"], row["micro_batch"], "eager")
        if eager is not None and "losses" in eager:
            row["loss_diff_first_step"] = abs(row["first_loss"] - eager["first_loss"])  # same weights, same batch
            row["loss_max_abs_diff"] = max(abs(a - b) for a, b in zip(row["losses"], eager["losses"]))
        else:
            row["loss_diff_missing"] = "no eager row measured at this micro-batch"


def find(rows: list[dict], recipe: str, overrides: list[str], micro: int, variant: str) -> dict | None:
    for row in rows:
        if (row.get("recipe"), row.get("overrides"), row.get("micro_batch"), row.get("variant")) == (
                recipe, list(overrides), micro, variant):
            return row
    return None


def goals(rows: list[dict], micro_batches: list[int]) -> list[dict]:
    """GOALS per micro-batch: `met` true when a row of the goal's variants meets every condition,
    false when rows were measured and none does, null (with `missing`) when there was none to judge."""
    out = []
    for arch, variants, conditions, text in GOALS:
        for micro in micro_batches:
            mine = [r for r in rows if r.get("family") == arch and r.get("role") == "family"
                    and r.get("micro_batch") == micro and r.get("variant") in variants]
            judged = [r for r in mine if all(measure in r for measure, _, _ in conditions)]
            entry = {"goal": text, "family": arch, "micro_batch": micro, "variants": list(variants),
                     "conditions": [list(c) for c in conditions]}
            if not judged:
                why = sorted({r.get("skipped") or r.get("failed") or r.get("ratio_missing")
                              or "no " + "/".join(m for m, _, _ in conditions) for r in mine})
                out.append({**entry, "met": None, "missing": "; ".join(why) or "no row of these variants in this run"})
                continue
            passing = [r for r in judged if all(meets(r[m], op, bound) for m, op, bound in conditions)]
            measure, op, _ = conditions[0]
            best = passing[0] if passing else (max if op == ">=" else min)(judged, key=lambda r: r[measure])
            out.append({**entry, "met": bool(passing), "variant": best["variant"],
                        "values": {m: best[m] for m, _, _ in conditions}})
    return out


def meets(value: float, op: str, bound: float) -> bool:
    return value >= bound if op == ">=" else value <= bound


def resume(folder: str, device: str, config: str, extra: list[str], steps: int) -> dict:
    """`steps` steps straight, and stopped at half then resumed, by the command line's main."""
    from megatron_taper.train import main

    common = ["--config", f"configs/{config}.yaml", "model.vocab_size=256", f"data.path={byte_tokens(folder)}",
              "run.tensorboard=false", f"train.device={device}", f"train.steps={steps}", "train.log_interval=1",
              f"checkpoint.interval={steps // 2}", "train.compile=false", *extra]
    if device == "cuda":
        common.append("train.precision=bf16")

    def losses(run: str) -> list[float]:
        return [r["loss"] for r in read_metrics(Path(folder) / run / "metrics.jsonl") if "loss" in r]

    codes = [main([*common, f"run.dir={folder}/{config}_straight"]),
             main([*common, f"run.dir={folder}/{config}_split",
                   f"train.exit_after={steps // 2}"]),
             main([*common, f"run.dir={folder}/{config}_split"])]
    straight, split = losses(f"{config}_straight"), losses(f"{config}_split")
    diff = max((abs(a - b) for a, b in zip(straight, split)), default=float("inf"))
    return {"config": config, "exit_codes": codes, "straight": straight, "resumed": split,
            "bitwise": straight == split, "max_abs_diff": diff,
            "ok": codes == [0, 0, 0] and straight == split and len(straight) == steps}


def ordered_families(only: str | None, smoke: bool) -> list[str]:
    if only:
        return only.split(",")
    if smoke:
        return list(SMOKE_SPEED)
    registered = list(cards())
    return [f for f in IMPORTANCE if f in registered] + [f for f in registered if f not in IMPORTANCE]


def run_speed(report: dict, args, folder: str, device: str, deadline: float, spent: str) -> None:
    micro_batches = [2] if args.smoke else [int(m) for m in args.micro_batches.split(",")]
    steps, warmup = (2, 1) if args.smoke else (args.speed_steps, args.warmup)
    report["speed_settings"] = {"families": ordered_families(args.families, args.smoke),
                                "micro_batches": micro_batches, "steps": steps, "warmup": warmup,
                                "row_s": args.row_s}
    rows, data = report.setdefault("speed", []), {}
    for index, spec in enumerate(plan(report["speed_settings"]["families"], micro_batches, args.smoke,
                                      device == "cuda")):
        label, skip = spec["label"], spec["skip"]
        if skip is None and label.get("kernels") == "triton":
            probed = [r.get("kernel_calls") for r in rows if r.get("family") == label["family"]
                      and r.get("variant") == "eager" and "kernel_calls" in r]
            if probed and not any(probed):
                skip = "the family's eager step reaches no kernel choice (kernels.state_passing)"
        if skip is None and time.perf_counter() > deadline:
            skip = spent
        if skip is not None:
            rows.append({**label, "skipped": skip})
            write(report, args.out)
            continue
        vocab = load_config(f"configs/{label['recipe']}.yaml", label["overrides"]).model.vocab_size
        if vocab not in data:
            data[vocab] = random_tokens(tempfile.mkdtemp(dir=folder), vocab, 2_000_000)
        attempt(report, args.out, "speed", speed_row, label["recipe"], label["overrides"], label["variant"],
                label["micro_batch"], data[vocab], folder, device, warmup, steps, args.row_s, deadline, index,
                append=True, **label)
        row = rows[-1]
        failed = row.get("failed", "")
        if "OutOfMemoryError" in failed or "out of memory" in failed.lower():
            row["oom"] = True
        for measured in rows:
            finish_row(measured, rows)
        report["goals"] = goals(rows, micro_batches)
        write(report, args.out)
    report["goals"] = goals(rows, micro_batches)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/gpu_families.json")
    parser.add_argument("--steps", type=int, default=10, help="parity steps")
    parser.add_argument("--smoke", action="store_true", help="the tiny recipes on any device, 2 steps")
    parser.add_argument("--budget-s", type=float, default=480.0, help="the whole script's time budget")
    parser.add_argument("--reserve-s", type=float, default=100.0,
                        help="of the budget, kept for parity and resume (speed rows stop starting before)")
    parser.add_argument("--parts", default="speed,parity,resume", help="which parts, in this order")
    parser.add_argument("--families", help="comma-separated model.arch names for the speed matrix")
    parser.add_argument("--micro-batches", default="4,16")
    parser.add_argument("--speed-steps", type=int, default=5, help="timed steps per speed row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per speed row (the first: compile)")
    parser.add_argument("--row-s", type=float, default=20.0, help="a row's timed steps stop after this")
    args = parser.parse_args()
    began = time.perf_counter()
    deadline = began + args.budget_s
    parts = args.parts.split(",")
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("error: no CUDA device (use --smoke to exercise the script on the CPU)", file=sys.stderr)
        return 2
    device = "cuda" if cuda else "cpu"
    steps = 2 if args.smoke else args.steps
    small = SMOKE_STEP if args.smoke else ()  # --smoke's parity and resume: 64 tokens a step
    report: dict = {"benchmark": "gpu_families", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                    "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                    "cuda": torch.version.cuda, "smoke": args.smoke, "budget_s": args.budget_s,
                    "reserve_s": args.reserve_s, "parts": parts}
    write(report, args.out)
    spent = f"time budget of {args.budget_s:.0f} s spent"
    with tempfile.TemporaryDirectory() as folder:
        if "speed" in parts:
            reserve = args.reserve_s if any(p in parts for p in ("parity", "resume")) else 0.0
            run_speed(report, args, folder, device, deadline - reserve,
                      f"{spent} ({reserve:.0f} s of it kept for parity and resume)" if reserve else spent)
        if "parity" in parts:
            tiny = family_recipes(tiny=True)  # every family that has a configs/tiny_*.yaml, registry order
            for family in [f for f in (SMOKE if args.smoke else ordered_families(None, False)) if f in tiny]:
                for precision in ("fp32",) if args.smoke else ("fp32", "bf16"):
                    config = f"configs/{tiny[family]}.yaml"
                    if time.perf_counter() > deadline:
                        report.setdefault("parity", []).append({"config": config, "precision": precision,
                                                                "skipped": spent})
                        continue
                    attempt(report, args.out, "parity", parity, folder, device, steps, precision, config,
                            (*EXTRA.get(family, ()), *small), append=True)
        if "resume" in parts:
            for family, (config, extra) in list(RESUMED.items())[:1 if args.smoke else None]:
                if time.perf_counter() > deadline:
                    report.setdefault("resume", []).append({"family": family, "config": config, "skipped": spent})
                    continue
                attempt(report, args.out, "resume", resume, folder, device, config, [*extra, *small], 6,
                        append=True, family=family)
    report["elapsed_s"] = time.perf_counter() - began
    write(report, args.out)
    json.dump(report, sys.stdout)
    print()
    ran = [r for r in report.get("parity", []) + report.get("resume", []) if "skipped" not in r]
    broken = [r for r in report.get("speed", []) if "failed" in r and not r.get("oom")]
    return 0 if all(r.get("ok") for r in ran) and not broken else 1


if __name__ == "__main__":
    sys.exit(main())
