"""Length extrapolation: the balanced-tree single-layer LM against an ALiBi Transformer of about
the same parameters, trained at length N, held-out loss at N, 2N, 4N, 8N; prints JSON.

    python benchmarks/length_extrapolation.py [--corpus ../shared/data/kjv.txt.gz] [--out DIR]
        [--seq-len 64] [--steps 300] [--vocab-size 1024] [--eval-tokens 32768] [key=value ...]

Data: the corpus (text, paragraphs as documents) gets a sentencepiece tokenizer of --vocab-size
pieces and MDS shards with 5% of the documents held out, made once by tools/train_tokenizer.py and
tools/preprocess_data.py into a cache folder keyed by the corpus file (its path, size and mtime)
and the settings (--cache, default ~/.cache/megatron_taper/length_extrapolation).

Models (`MODELS`; key=value overrides apply to both): the tree (configs/tiny_tree.yaml's shape,
d_model 128, cell width 256, MLP 404) and a 2-layer Transformer with model.position=alibi
(d_model 128, 4 heads, MLP 288): 352,896 vs 352,768 parameters besides the embedding and head
(the same for both). Each is trained by the Trainer (`python -m megatron_taper.train`, one
process) for --steps steps of 16 sequences of N tokens into OUT/<name> (a finished run is
reused), then evaluated by tools/evaluate.py on the held-out split at N, 2N, 4N and 8N, each on
--eval-tokens held-out tokens (micro-batches of 8 sequences of that length). Training tokens/s:
both models built in this process, their training steps (forward + backward + AdamW on one
micro-batch of 8 x N random tokens) alternating for --speed-steps steps after one warm-up step,
median per model (benchmarks/arch_throughput.py's timed_step), so a changing load on a shared
machine hits both alike. The tree's sequential cell levels at every length are printed with it
(models/tree/cost.py: tree_depth).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

import torch  # noqa: E402
from arch_throughput import timed_step  # noqa: E402

from megatron_taper.config import load_config  # noqa: E402
from megatron_taper.cost.flops import model_costs  # noqa: E402
from megatron_taper.data import is_complete  # noqa: E402
from megatron_taper.models import build_model  # noqa: E402
from megatron_taper.models.tree.cost import tree_depth  # noqa: E402
from megatron_taper.training.metrics import read_metrics  # noqa: E402

DEFAULT_CORPUS = REPO.parent / "shared" / "data" / "kjv.txt.gz"
VAL_FRACTION = 0.05
MICRO_BATCH = 8
COMMON = ["model.d_model=128", "model.n_heads=4", "model.tie_embeddings=false", "model.taper.schedule=uniform",
          "model.taper.start=1.0", "train.global_batch=16", f"train.micro_batch={MICRO_BATCH}", "train.lr=3e-3",
          "train.warmup_steps=30", "train.log_interval=10", "train.eval_interval=0", "train.eval_batches=4",
          "checkpoint.interval=0", "checkpoint.keep=1", "run.tensorboard=false"]
MODELS = {  # name -> (recipe, overrides)
    "tree": ("configs/tiny_tree.yaml", ["model.mlp_width=404", "model.taper.multiple=4", "model.tree.cell_width=256"]),
    "alibi_transformer": ("configs/tiny_taper.yaml", ["model.n_layers=2", "model.mlp_width=288",
                                                      "model.taper.multiple=32", "model.position=alibi"]),
}


def run(cmd: list[str], threads: int) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout


def prepare_data(corpus: Path, cache: Path, vocab_size: int, threads: int) -> Path:
    """MDS folder (train/, val/) of `corpus`, tokenized by the project's tools; made once per key."""
    stat = corpus.stat()
    key = json.dumps([str(corpus.resolve()), stat.st_size, int(stat.st_mtime), vocab_size, VAL_FRACTION, "paragraph"])
    folder = cache / f"{corpus.name.split('.')[0]}-v{vocab_size}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    data = folder / "mds"
    if is_complete(str(data)):
        return data
    folder.mkdir(parents=True, exist_ok=True)
    print(f"[data] tokenizing {corpus} into {folder}", file=sys.stderr, flush=True)
    prefix = folder / "spm"
    run([sys.executable, "tools/train_tokenizer.py", "--input", str(corpus), "--text-mode", "paragraph",
         "--vocab-size", str(vocab_size), "--output", str(prefix), "--threads", str(threads)], threads)
    run([sys.executable, "tools/preprocess_data.py", "--input", str(corpus), "--text-mode", "paragraph",
         "--tokenizer", f"{prefix}.model", "--output", str(data), "--val-fraction", str(VAL_FRACTION),
         "--overwrite", "--no-progress"], threads)
    return data


def model_overrides(name: str, args: argparse.Namespace, data: Path, extra: list[str]) -> list[str]:
    return [*COMMON, f"model.seq_len={args.seq_len}", f"model.vocab_size={args.vocab_size}",
            f"train.steps={args.steps}", f"data.path={data}", f"run.dir={Path(args.out) / name}",
            f"train.seed={args.seed}", *MODELS[name][1], *extra]


def training_speed(configs: dict, steps: int) -> dict[str, float]:
    """Training tokens/s of each config's model, their steps alternating in this process (median)."""
    device = torch.device("cpu")
    runs = {}
    for name, cfg in configs.items():
        model = build_model(cfg.model)
        model.init_weights(cfg.train.seed)
        tokens = torch.randint(0, cfg.model.vocab_size, (MICRO_BATCH, cfg.model.seq_len + 1),
                               generator=torch.Generator().manual_seed(0))
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4), tokens)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(steps + 1):  # the first step of each is a warm-up
        for name, (model, opt, tokens) in runs.items():
            elapsed = timed_step(model, opt, tokens, device)
            if step:
                times[name].append(elapsed)
    return {name: MICRO_BATCH * configs[name].model.seq_len / statistics.median(t) for name, t in times.items()}


def train_and_evaluate(name: str, cfg, overrides: list[str], args: argparse.Namespace) -> dict:
    run_dir = Path(cfg.run.dir)
    n = args.seq_len
    print(f"[{name}] training {args.steps} steps at N={n} into {run_dir}", file=sys.stderr, flush=True)
    run([sys.executable, "-m", "megatron_taper.train", "--config", MODELS[name][0], *overrides], args.threads)
    steps = [record for record in read_metrics(run_dir / "metrics.jsonl") if "loss" in record]
    lengths = [n * k for k in (1, 2, 4, 8)]
    results = {}
    for length in lengths:  # one call per length: the batch count keeps the evaluated tokens equal
        batches = max(1, args.eval_tokens // (length * MICRO_BATCH))
        out = run([sys.executable, "tools/evaluate.py", "--checkpoint", str(run_dir), "--seq-lens", str(length),
                   "--batches", str(batches), "--batch-size", str(MICRO_BATCH)], args.threads)
        results[length] = json.loads(out)["results"][str(length)]
    costs = model_costs(cfg.model)
    entry = {
        "params": costs.total_params,
        "params_without_embedding_and_head": sum(c.params for c in costs.layers),
        "flops_per_token_at_N": costs.total_flops,
        "final_train_loss": statistics.mean(r["loss"] for r in steps[-3:]),
        "held_out_loss": {str(k): v["loss"] for k, v in results.items()},
        "held_out_tokens": {str(k): v["tokens"] for k, v in results.items()},
    }
    if cfg.model.arch == "tree":
        entry["sequential_cell_levels"] = {str(k): vars(tree_depth(k)) | {"total": tree_depth(k).levels}
                                           for k in lengths}
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default=str(DEFAULT_CORPUS), help="raw text (.txt or .txt.gz)")
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/megatron_taper/length_extrapolation"))
    parser.add_argument("--out", default="runs/length_extrapolation", help="run folders of the two models")
    parser.add_argument("--seq-len", type=int, default=64, help="training length N")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--eval-tokens", type=int, default=32768, help="held-out tokens per evaluated length")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--speed-steps", type=int, default=20, help="timed training steps per model")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    parser.add_argument("overrides", nargs="*", help="key=value applied to both models")
    args = parser.parse_args(argv)
    corpus = Path(args.corpus)
    if not corpus.is_file():
        parser.error(f"--corpus {corpus}: no such file")
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        parser.error(f"--models: {', '.join(unknown)} not in {', '.join(MODELS)}")
    data = prepare_data(corpus, Path(args.cache), args.vocab_size, args.threads)
    overrides = {name: model_overrides(name, args, data, args.overrides) for name in names}
    configs = {name: load_config(str(REPO / MODELS[name][0]), overrides[name]) for name in names}
    models = {name: train_and_evaluate(name, configs[name], overrides[name], args) for name in names}
    torch.set_num_threads(args.threads)
    for name, speed in training_speed(configs, args.speed_steps).items():
        models[name]["train_tokens_per_s"] = speed
    out = {"corpus": str(corpus), "data": str(data), "N": args.seq_len, "steps": args.steps,
           "tokens_trained": args.steps * 16 * args.seq_len, "threads": args.threads, "models": models}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
