"""Memory bridge ablations x seeds on real text: held-out loss, generalisation gap, position probe.

    python benchmarks/bridge_ablation.py [--corpus ../shared/data/kjv.txt.gz] [--out DIR]
        [--seeds 0 1 2 3 4] [--steps 120] [--ablations carry reset aux_carry aux_reset none random_aux]

Data. A document is one chapter of the King James text (tools/probe_bridge.py kjv_chapters:
heading and verse numbers removed). A keyed hash selects `--select-fraction` of the chapters
(a small corpus, so that the runs see their training text more than once), and a second keyed
hash (megatron_taper.data.preprocess.in_val_split) sends `--val-fraction` of those to the
held-out side: train and held-out text never share a document. A sentencepiece tokenizer
(tools/train_tokenizer.py) is trained on the training chapters, which tools/preprocess_data.py
writes as MDS shards; the held-out chapters stay jsonl.

Runs. Each ablation is a recipe (configs/tiny_bridge*.yaml) with overrides (ABLATIONS): `carry`
= the bridge recipe (state carried along documents), `reset` = the same with the state reset at
every window, `aux_carry` / `aux_reset` = the same with the auxiliary loss, `none` = no bridge,
`random_aux` = random auxiliary targets (carried). Every ablation reads the same data order
(data.row_streams: each batch row reads consecutive windows). Each is trained by
`python -m megatron_taper.train` for `--steps` steps with train.seed = each seed, resumable (a
finished run is not rerun). Then, with the run's final weights (tools' load_model): the mean
next-token loss over windows of seq_len + 1 tokens of the held-out chapters, read as in training:
the chapters (tokens + EOS) concatenated and cut into EVAL_ROWS rows, each read window after window
(the first `--eval-windows` / EVAL_ROWS of each row), the state carried within a chapter where the
model carries one (`eval_loss`; also `eval_loss_reset`: the same model with the state reset at
every window); the same over as many windows of the training chapters (text the run has trained
on), their difference (the generalisation gap), and tools/probe_bridge.py's probe on the held-out
chapters. Prints one JSON object: per run and per ablation (mean, sample standard deviation over
the seeds; each ablation's difference from its partner of the same seed (PARTNER: carried minus
reset), and from the no-bridge run when there is one; a same-seed pair shares the data order and
every initial weight but the bridge's); writes it to OUT/results.json and a table to OUT/results.md.
`--untrained-probe`: also the probe of the untrained carried-state recipe (its initial weights for
each seed): a carried state can tell position in a document from how many windows it has read,
learned or not, so this is the probe's floor for the carried state.
"""
from __future__ import annotations

import argparse
import itertools
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

from megatron_taper.config import load_config  # noqa: E402
from megatron_taper.data.preprocess import in_val_split  # noqa: E402
from megatron_taper.data.tokenizer import Tokenizer  # noqa: E402
from megatron_taper.inference.load import load_model, open_checkpoint  # noqa: E402
from megatron_taper.models import build_model  # noqa: E402
from megatron_taper.models.layers import cross_entropy  # noqa: E402

RESET = ["model.bridge.carry_state=false", "data.row_streams=true"]
ABLATIONS = {"carry": ("tiny_bridge.yaml", []), "reset": ("tiny_bridge.yaml", RESET),
             "aux_carry": ("tiny_bridge_aux.yaml", []), "aux_reset": ("tiny_bridge_aux.yaml", RESET),
             "none": ("tiny_bridge_none.yaml", []), "random_aux": ("tiny_bridge_random_aux.yaml", [])}
PARTNER = {"carry": "reset", "aux_carry": "aux_reset"}
EVAL_ROWS = 8
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


def row_windows(docs: list[list[int]], eos: int, seq_len: int, rows: int, per_row: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """data.order.RowStreams' rule on the documents (each followed by EOS) in their order: windows
    [K, rows, seq_len + 1] (K <= per_row) and continues [K, rows] (the window's first token is not
    its document's first, k > 0)."""
    stream = [t for doc in docs for t in (*doc, eos)]
    starts = set(itertools.accumulate([len(doc) + 1 for doc in docs[:-1]], initial=0))
    share = (len(stream) - 1) // rows
    count = min(per_row, (share - 1) // seq_len)
    firsts = [[r * share + k * seq_len for r in range(rows)] for k in range(count)]
    windows = torch.tensor([[stream[p:p + seq_len + 1] for p in ps] for ps in firsts])
    continues = torch.tensor([[k > 0 and p not in starts for p in ps] for k, ps in enumerate(firsts)])
    return windows, continues


@torch.no_grad()
def stream_loss(model, windows: torch.Tensor, continues: torch.Tensor, carry: bool) -> float:
    """Mean next-token loss over row_windows' windows, read window after window; `carry`: each
    row's state carried from its previous window where it continues (the model's carried state)."""
    model.eval()
    bridge, state, total = model.bridge, None, 0.0
    for window, flags in zip(windows, continues):
        if carry:
            bridge.carry_in = (state, flags)
        total += float(cross_entropy(model(window[:, :-1]), window[:, 1:]))
        if carry:
            state, bridge.carry_in = bridge.carry_out, None
    return total / len(windows)


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
    recipe, extra = ABLATIONS[ablation]
    overrides = [*extra, f"data.path={os.path.join(data_dir, 'mds')}", f"model.vocab_size={args.vocab_size}",
                 f"train.seed={seed}", f"train.steps={args.steps}", f"run.dir={run_dir}", "run.tensorboard=false",
                 f"checkpoint.interval={args.steps}", "train.log_interval=25"]
    subprocess.run([sys.executable, "-m", "megatron_taper.train", "--config",
                    os.path.join(REPO, "configs", recipe), *overrides], check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL)
    ref = open_checkpoint(run_dir)
    model = load_model(ref)
    tokenizer = Tokenizer(os.path.join(data_dir, "tokenizer.model"))
    seq_len = ref.config.model.seq_len
    val_docs, train_docs = tokenized(tokenizer, data_dir, "val"), tokenized(tokenizer, data_dir, "train")
    carry = model.bridge is not None and model.bridge.carry_state
    per_row = args.eval_windows // EVAL_ROWS
    val = row_windows(val_docs, tokenizer.eos_id, seq_len, EVAL_ROWS, per_row)
    train = row_windows(train_docs, tokenizer.eos_id, seq_len, EVAL_ROWS, len(val[0]))
    eval_loss, train_loss = stream_loss(model, *val, carry), stream_loss(model, *train, carry)
    result = {"ablation": ablation, "seed": seed, "step": ref.step, "eval_loss": eval_loss, "train_loss": train_loss,
              "gap": eval_loss - train_loss, "params": sum(p.numel() for p in model.parameters()),
              "eval_windows": val[0].shape[0] * val[0].shape[1],
              "eval_loss_reset": stream_loss(model, *val, False) if carry else eval_loss,
              "probe": probe(model, val_docs, seq_len)}
    with open(result_path, "w") as f:
        json.dump(result, f)
    print(json.dumps(result), file=sys.stderr, flush=True)
    return result


def untrained_probe(seed: int, args, data_dir: str) -> dict:
    """The probe of configs/tiny_bridge.yaml (carried state) at its initial weights for `seed`."""
    cfg = load_config(os.path.join(REPO, "configs", "tiny_bridge.yaml"), [f"model.vocab_size={args.vocab_size}"])
    model = build_model(cfg.model)
    model.init_weights(seed)
    docs = tokenized(Tokenizer(os.path.join(data_dir, "tokenizer.model")), data_dir, "val")
    return probe(model, docs, cfg.model.seq_len)


def summarise(runs: list[dict]) -> dict:
    def stats(values: list[float]) -> dict:
        return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                "n": len(values)}

    table = {}
    for ablation in dict.fromkeys(r["ablation"] for r in runs):
        rs = [r for r in runs if r["ablation"] == ablation]
        row = {key: stats([r[key] for r in rs]) for key in ("eval_loss", "train_loss", "gap", "eval_loss_reset")}
        for key in ("state_accuracy", "hidden_accuracy", "chance"):
            if key in rs[0]["probe"]:
                row[f"probe_{key}"] = stats([r["probe"][key] for r in rs])
        row["params"] = rs[0]["params"]
        for other in {"none", PARTNER.get(ablation)} - {None, ablation}:
            base = {r["seed"]: r for r in runs if r["ablation"] == other}
            paired = [r for r in rs if r["seed"] in base]
            if paired:  # same seed: same data order and the same initial shared weights
                for key in ("eval_loss", "gap"):
                    row[f"{key}_minus_{other}"] = stats([r[key] - base[r["seed"]][key] for r in paired])
                row[f"{other}_lower_in"] = sum(r["eval_loss"] < base[r["seed"]]["eval_loss"] for r in paired)
        table[ablation] = row
    return table


def markdown(table: dict) -> str:
    def cell(row: dict, key: str, pct: bool = False) -> str:
        if key not in row:
            return "-"
        s = row[key]
        return f"{100 * s['mean']:.1f}% ± {100 * s['std']:.1f}" if pct else f"{s['mean']:.3f} ± {s['std']:.3f}"

    lines = ["| ablation | params | held-out loss | minus reset (same seed) | minus no bridge (same seed) | "
             "held-out, state reset per window | train loss | gap (held-out - train) "
             "| probe: bridge state | probe: layer-L/2 hidden | chance |", "|---" * 11 + "|"]
    for name, row in table.items():
        partner = PARTNER.get(name, "")
        lines.append(f"| {name} | {row['params']:,} | {cell(row, 'eval_loss')} | "
                     f"{cell(row, f'eval_loss_minus_{partner}')} | {cell(row, 'eval_loss_minus_none')} | "
                     f"{cell(row, 'eval_loss_reset')} | "
                     f"{cell(row, 'train_loss')} | {cell(row, 'gap')} | {cell(row, 'probe_state_accuracy', True)} | "
                     f"{cell(row, 'probe_hidden_accuracy', True)} | {cell(row, 'probe_chance', True)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default=os.path.join(REPO, "..", "shared", "data", "kjv.txt.gz"))
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "bridge_ablation"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--ablations", nargs="+", default=["carry", "reset", "aux_carry", "aux_reset"],
                        choices=list(ABLATIONS))
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--eval-windows", type=int, default=200, help="windows of held-out (and of training) text")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--reprobe", action="store_true", help="recompute the probe of finished runs")
    parser.add_argument("--untrained-probe", action="store_true",
                        help="also probe the carried state of the untrained recipe (each seed's initial weights)")
    parser.add_argument("--select-fraction", type=float, default=0.12, help="share of chapters used at all")
    parser.add_argument("--val-fraction", type=float, default=0.35, help="share of those held out")
    args = parser.parse_args(argv)
    info = prepare_data(args.corpus, args.out, args.select_fraction, args.val_fraction, args.vocab_size)
    data_dir = os.path.join(args.out, "data")
    runs = [run_one(a, s, args, data_dir) for s in args.seeds for a in args.ablations]
    table = summarise(runs)
    data = {k: v for k, v in info.items() if k != "val_names"}
    out = {"data": data, "steps": args.steps, "seeds": args.seeds, "ablations": table, "runs": runs}
    if args.untrained_probe:
        probes = [untrained_probe(seed, args, data_dir) for seed in args.seeds]
        out["untrained_probe"] = {"runs": probes, "state_accuracy": {
            "mean": statistics.fmean(p["state_accuracy"] for p in probes),
            "std": statistics.stdev(p["state_accuracy"] for p in probes) if len(probes) > 1 else 0.0}}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(markdown(table) + "\n")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
