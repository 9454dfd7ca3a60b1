"""Memory bridge ablations x seeds on real text: held-out loss, generalisation gap, position probe.

    python benchmarks/bridge_ablation.py [--corpus ../shared/data/kjv.txt.gz] [--out DIR]
        [--seeds 0 1 2 3 4] [--steps 150] [--ablations none bridge aux random_aux]

Data. A document is one chapter of the King James text (tools/probe_bridge.py kjv_chapters:
heading and verse numbers removed). A keyed hash selects `--select-fraction` of the chapters
(a small corpus, so that the runs see their training text more than once), and a second keyed
hash (megatron_taper.data.preprocess.in_val_split) sends `--val-fraction` of those to the
held-out side: train and held-out text never share a document. A sentencepiece tokenizer
(tools/train_tokenizer.py) is trained on the training chapters, which tools/preprocess_data.py
writes as MDS shards; the held-out chapters stay jsonl.

Runs. Each ablation is a recipe (configs/tiny_bridge*.yaml; `none` = no bridge) trained by
`python -m megatron_taper.train` for `--steps` steps with train.seed = each seed, resumable
(a finished run is not rerun). Then, with the run's final weights (tools' load_model): the mean
next-token loss over the first `--eval-windows` windows of seq_len + 1 tokens of the held-out
chapters (each chapter's tokens + EOS, concatenated), the same over as many windows of the
training chapters (text the run has trained on), their difference (the generalisation gap), and tools/probe_bridge.py's
probe on the held-out chapters. Prints one JSON object: per run and per ablation (mean, sample
standard deviation over the seeds; for each bridge ablation also its difference from the
no-bridge run of the same seed, which shares the data order and every initial weight but the
bridge's); writes it to OUT/results.json and a table to OUT/results.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))

from probe_bridge import kjv_chapters, probe, read_documents  # noqa: E402

from megatron_taper.data.preprocess import in_val_split  # noqa: E402
from megatron_taper.data.tokenizer import Tokenizer  # noqa: E402
from megatron_taper.inference.load import load_model, open_checkpoint  # noqa: E402
from megatron_taper.models.layers import cross_entropy  # noqa: E402

RECIPES = {"none": "tiny_bridge_none.yaml", "bridge": "tiny_bridge.yaml", "aux": "tiny_bridge_aux.yaml",
           "random_aux": "tiny_bridge_random_aux.yaml"}
SELECT_SEED, SPLIT_SEED = 17, 0


def prepare_data(corpus: str, out: str, select_fraction: float, val_fraction: float, vocab_size: int) -> dict:
    """OUT/data: train.jsonl, val.jsonl, tokenizer.model, mds/ (train split): made once."""
    folder = os.path.join(out, "data")
    info_path = os.path.join(folder, "data.json")
    if os.path.exists(info_path):
        with open(info_path) as f:
            return json.load(f)
    os.makedirs(folder, exist_ok=True)
    chapters = [(n, t) for n, t in kjv_chapters(corpus) if in_val_split(t, select_fraction, SELECT_SEED)]
    split = {"train": [c for c in chapters if not in_val_split(c[1], val_fraction, SPLIT_SEED)],
             "val": [c for c in chapters if in_val_split(c[1], val_fraction, SPLIT_SEED)]}
    for name, docs in split.items():
        with open(os.path.join(folder, f"{name}.jsonl"), "w") as f:
            for chapter, text in docs:
                f.write(json.dumps({"text": text, "chapter": chapter}) + "\n")
    train_jsonl = os.path.join(folder, "train.jsonl")
    prefix = os.path.join(folder, "tokenizer")
    subprocess.run([sys.executable, os.path.join(REPO, "tools/train_tokenizer.py"), "--input", train_jsonl,
                    "--vocab-size", str(vocab_size), "--output", prefix, "--threads", "1"], check=True, cwd=REPO)
    subprocess.run([sys.executable, os.path.join(REPO, "tools/preprocess_data.py"), "--input", train_jsonl,
                    "--tokenizer", prefix + ".model", "--output", os.path.join(folder, "mds"), "--overwrite",
                    "--no-progress"], check=True, cwd=REPO)
    info = {"corpus": os.path.abspath(corpus), "select_fraction": select_fraction, "val_fraction": val_fraction,
            "vocab_size": vocab_size, "chapters": len(chapters),
            "train_chapters": len(split["train"]), "val_chapters": len(split["val"]),
            "val_names": [c[0] for c in split["val"]]}
    with open(info_path, "w") as f:
        json.dump(info, f)
    return info


def windows(docs: list[list[int]], eos: int, length: int, limit: int | None = None) -> torch.Tensor:
    """Consecutive windows of `length` tokens of the documents (each followed by EOS), concatenated."""
    stream = [t for doc in docs for t in (*doc, eos)]
    count = len(stream) // length if limit is None else min(limit, len(stream) // length)
    return torch.tensor(stream[:count * length]).view(count, length)


@torch.no_grad()
def mean_loss(model, batch_windows: torch.Tensor, batch: int = 16) -> float:
    losses = [cross_entropy(model(w[:, :-1]), w[:, 1:]) * len(w) for w in batch_windows.split(batch)]
    return float(torch.stack(losses).sum() / len(batch_windows))


def tokenized(tokenizer: Tokenizer, data_dir: str, split: str) -> list[list[int]]:
    return [tokenizer.encode(t) for t in read_documents(os.path.join(data_dir, f"{split}.jsonl"))]


def run_one(ablation: str, seed: int, args, data_dir: str) -> dict:
    run_dir = os.path.join(args.out, "runs", f"{ablation}-seed{seed}")
    result_path = os.path.join(run_dir, "bridge_eval.json")
    if os.path.exists(result_path):
        with open(result_path) as f:
            result = json.load(f)
        if args.reprobe:  # the probe again on the run's final weights (e.g. after a change of the probe)
            docs = tokenized(Tokenizer(os.path.join(data_dir, "tokenizer.model")), data_dir, "val")
            ref = open_checkpoint(run_dir)
            result["probe"] = probe(load_model(ref), docs, ref.config.model.seq_len)
            with open(result_path, "w") as f:
                json.dump(result, f)
        return result
    overrides = [f"data.path={os.path.join(data_dir, 'mds')}", f"model.vocab_size={args.vocab_size}",
                 f"train.seed={seed}", f"train.steps={args.steps}", f"run.dir={run_dir}", "run.tensorboard=false",
                 f"checkpoint.interval={args.steps}", "train.log_interval=25"]
    subprocess.run([sys.executable, "-m", "megatron_taper.train", "--config",
                    os.path.join(REPO, "configs", RECIPES[ablation]), *overrides], check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL)
    ref = open_checkpoint(run_dir)
    model = load_model(ref)
    tokenizer = Tokenizer(os.path.join(data_dir, "tokenizer.model"))
    seq_len = ref.config.model.seq_len
    val_docs, train_docs = tokenized(tokenizer, data_dir, "val"), tokenized(tokenizer, data_dir, "train")
    val_windows = windows(val_docs, tokenizer.eos_id, seq_len + 1, args.eval_windows)
    eval_loss = mean_loss(model, val_windows)
    train_loss = mean_loss(model, windows(train_docs, tokenizer.eos_id, seq_len + 1, len(val_windows)))
    result = {"ablation": ablation, "seed": seed, "step": ref.step, "eval_loss": eval_loss, "train_loss": train_loss,
              "gap": eval_loss - train_loss, "params": sum(p.numel() for p in model.parameters()),
              "probe": probe(model, val_docs, seq_len)}
    with open(result_path, "w") as f:
        json.dump(result, f)
    print(json.dumps(result), file=sys.stderr, flush=True)
    return result


def summarise(runs: list[dict]) -> dict:
    def stats(values: list[float]) -> dict:
        return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                "n": len(values)}

    table = {}
    for ablation in dict.fromkeys(r["ablation"] for r in runs):
        rs = [r for r in runs if r["ablation"] == ablation]
        row = {key: stats([r[key] for r in rs]) for key in ("eval_loss", "train_loss", "gap")}
        for key in ("state_accuracy", "hidden_accuracy", "chance"):
            if key in rs[0]["probe"]:
                row[f"probe_{key}"] = stats([r["probe"][key] for r in rs])
        row["params"] = rs[0]["params"]
        base = {r["seed"]: r for r in runs if r["ablation"] == "none"}
        paired = [r for r in rs if r["seed"] in base]
        if ablation != "none" and paired:  # same seed: same data order and the same initial shared weights
            for key in ("eval_loss", "gap"):
                row[f"{key}_minus_none"] = stats([r[key] - base[r["seed"]][key] for r in paired])
        table[ablation] = row
    return table


def markdown(table: dict) -> str:
    def cell(row: dict, key: str, pct: bool = False) -> str:
        if key not in row:
            return "-"
        s = row[key]
        return f"{100 * s['mean']:.1f}% ± {100 * s['std']:.1f}" if pct else f"{s['mean']:.3f} ± {s['std']:.3f}"

    lines = ["| ablation | params | held-out loss | minus no bridge (same seed) | train loss | gap (held-out - train) "
             "| probe: bridge state | probe: layer-L/2 hidden | chance |", "|---|---|---|---|---|---|---|---|---|"]
    for name, row in table.items():
        lines.append(f"| {name} | {row['params']:,} | {cell(row, 'eval_loss')} | {cell(row, 'eval_loss_minus_none')} | "
                     f"{cell(row, 'train_loss')} | {cell(row, 'gap')} | {cell(row, 'probe_state_accuracy', True)} | "
                     f"{cell(row, 'probe_hidden_accuracy', True)} | {cell(row, 'probe_chance', True)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default=os.path.join(REPO, "..", "shared", "data", "kjv.txt.gz"))
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "bridge_ablation"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--ablations", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--eval-windows", type=int, default=200, help="windows of held-out (and of training) text")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--reprobe", action="store_true", help="recompute the probe of finished runs")
    parser.add_argument("--select-fraction", type=float, default=0.12, help="share of chapters used at all")
    parser.add_argument("--val-fraction", type=float, default=0.35, help="share of those held out")
    args = parser.parse_args(argv)
    info = prepare_data(args.corpus, args.out, args.select_fraction, args.val_fraction, args.vocab_size)
    data_dir = os.path.join(args.out, "data")
    runs = [run_one(a, s, args, data_dir) for s in args.seeds for a in args.ablations]
    table = summarise(runs)
    data = {k: v for k, v in info.items() if k != "val_names"}
    out = {"data": data, "steps": args.steps, "seeds": args.seeds, "ablations": table, "runs": runs}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(markdown(table) + "\n")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
