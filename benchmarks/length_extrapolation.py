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
the first --eval-tokens held-out tokens cut into sequences of that length. tokens/s is the
median of the Trainer's logged training throughput (forward + backward + AdamW) after the first
10 steps; on a shared machine it moves with the load. The tree's sequential cell levels at every
length are printed with it (models/tree_lm.py: tree_depth).
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
sys.path.insert(0, str(REPO))

from megatron_taper.config import load_config  # noqa: E402
from megatron_taper.data.preprocess import is_complete  # noqa: E402
from megatron_taper.flops import model_costs  # noqa: E402
from megatron_taper.models.tree_lm import tree_depth  # noqa: E402

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


def train_and_evaluate(name: str, args: argparse.Namespace, data: Path, extra: list[str]) -> dict:
    run_dir = Path(args.out) / name
    n = args.seq_len
    recipe, model_overrides = MODELS[name]
    overrides = [*COMMON, f"model.seq_len={n}", f"model.vocab_size={args.vocab_size}", f"train.steps={args.steps}",
                 f"data.path={data}", f"run.dir={run_dir}", f"train.seed={args.seed}", *model_overrides, *extra]
    cfg = load_config(str(REPO / recipe), overrides)
    print(f"[{name}] training {args.steps} steps at N={n} into {run_dir}", file=sys.stderr, flush=True)
    run([sys.executable, "-m", "megatron_taper.train", "--config", recipe, *overrides], args.threads)
    with open(run_dir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    steps = [r for r in records if "loss" in r and r["step"] > 10]
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
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
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
    out = {"corpus": str(corpus), "data": str(data), "N": args.seq_len, "steps": args.steps,
           "tokens_trained": args.steps * 16 * args.seq_len, "threads": args.threads,
           "models": {name: train_and_evaluate(name, args, data, args.overrides) for name in names}}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
