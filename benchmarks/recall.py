"""In-context recall (multi-query associative recall, MQAR) on the CPU: the Transformer (with and
without a short convolution), Titans, Hope-attention, the linear and deep recurrent memories and
each Memory Caching variant, at equal parameters; prints JSON.

    python benchmarks/recall.py [--lengths 32,64,128] [--steps 250] [--batch 32] [--eval 128]
        [--models transformer,transformer_conv,titans,hope,linear_none,linear_residual,...]
        [--eval-every 25 --patience 3 --min-delta 0.01] [--eval-chunks 1] [--markdown] [key=value ...]
    python benchmarks/recall.py --summarise RUN.json ... [--markdown]   (mean and spread over seeds)

Task (Zoology's MQAR, Arora et al. 2023): a sequence of length L holds n = L / 8 key-value pairs
(keys from `keys` tokens, values from `values` other tokens, keys distinct), then L / 2 filler
tokens, then the n keys again in a random order, each followed by its value. Only the values of
the queries are scored: accuracy = the fraction of them predicted exactly (argmax) on `--eval`
fresh sequences per length (chance: 1 / values). The number of pairs grows with L, so a memory of
fixed size fills up while a cache of one state per segment grows with the sequence.

Every model trains once, on batches whose length is drawn from --lengths each step (AdamW, cosine
schedule after a warmup), and is evaluated at each length. Models: one shape (2 layers,
d_model 64, 2 heads of 32, the uniform MLP), with the MLP width of every model but the Transformer's
chosen (a multiple of 8) so that its parameter count is the Transformer's within a few percent
(reported per model); Memory Caching with segments of --segment tokens, top-k 2 for SSC; `transformer_conv`: the
Transformer with a depthwise causal convolution of 4 taps after its q, k and v projections (the
memories' short convolution, titans' causal_conv, initialised like theirs to the identity plus
noise), its MLP narrowed to keep the parameters equal; `titans`: MAG with the family's defaults
(sliding window 64, 4 persistent tokens, a depth-2 memory), so that past 64 tokens only the
memory recalls; `hope`: Hope-attention (full attention, then 2 online CMS levels); the neural
memories (titans, deep_*) chunked by 8 (before issue 27's normalised inner step, at max_lr 0.005, chunk 16 made
its base diverge to NaN on this task at lr 5e-3 while deep_grm trained). --eval-chunks evaluates
the trained deep memories again with other chunk sizes (1 = the exact token-by-token recurrence).
Each --models entry can run in its own process; the figures in docs/memory_caching.md were
measured that way, 1 thread each.

Early stop (--eval-every N): every N steps the mean accuracy over the lengths on a held-out set
(--eval fresh sequences per length, other than the final ones) is logged as the learning curve;
training stops when it has not risen by --min-delta over its best for --patience evaluations
(`stopped: plateau`), else at --steps (`stopped: budget`). The schedule is the budget's cosine
either way. --summarise groups runs (one JSON report each) by model and length: mean, sample
standard deviation and each seed's accuracy, steps run and why each stopped.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from small_training import train_small  # benchmarks/small_training.py, beside this script
from torch import nn

from megatron_taper.config import load_config
from megatron_taper.cost.flops import model_costs
from megatron_taper.models import build_model
from megatron_taper.models.init import init_tensor
from megatron_taper.models.layers import IGNORE_INDEX, Attention, cross_entropy
from megatron_taper.models.titans.neural_memory import NeuralMemory, causal_conv

MODELS = {
    "transformer": ["model.arch=transformer"],
    "transformer_conv": ["model.arch=transformer"],  # + add_short_convolutions
    "titans": ["model.arch=titans"],
    "hope": ["model.arch=hope_attention"],
    **{f"linear_{v}": ["model.arch=linear_memory", f"model.memory_caching.variant={v}"]
       for v in ("none", "residual", "grm", "soup", "ssc")},
    **{f"deep_{v}": ["model.arch=deep_memory", f"model.memory_caching.variant={v}"]
       for v in ("none", "residual", "grm", "soup", "ssc")},
}
SHAPE = ["model.n_layers=2", "model.d_model=64", "model.n_heads=2", "model.taper.schedule=uniform",
         "model.taper.start=1.0", "model.taper.multiple=8", "model.memory_caching.top_k=2",
         "model.memory_caching.linear_chunk=16", "model.titans.chunk_size=8"]


SHORT_CONV_TAPS = 4  # as the memories' (model.titans.conv_kernel, model.memory_caching.linear_conv_kernel)


class ShortConvProjection(nn.Module):
    """`proj`, then a depthwise causal convolution over time (titans' causal_conv) of its outputs;
    taps [out, K] initialised like the neural memory's: the identity (1 on the newest tap) plus
    N(0, std)."""

    def __init__(self, proj: nn.Linear, name: str, seed: int, std: float, n_layers: int):
        super().__init__()
        self.proj = proj
        taps = init_tensor(name, (proj.out_features, SHORT_CONV_TAPS), seed, std, n_layers)
        taps[:, -1] += 1.0
        self.taps = nn.Parameter(taps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return causal_conv(self.proj(x), self.taps)[0]


def add_short_convolutions(model: nn.Module, cfg, seed: int) -> nn.Module:
    """The short convolution after every attention's q, k and v projections (in place)."""
    for name, attention in [(n, m) for n, m in model.named_modules() if isinstance(m, Attention)]:
        for proj in ("wq", "wk", "wv"):
            setattr(attention, proj, ShortConvProjection(getattr(attention, proj), f"{name}.{proj}.taps", seed,
                                                         cfg.init_std, cfg.n_layers))
    return model


def build(name: str, cfg, seed: int) -> nn.Module:
    """The benchmark's model `name` with initial weights of `seed`."""
    torch.manual_seed(seed)
    model = build_model(cfg)
    model.init_weights(seed)
    return add_short_convolutions(model, cfg, seed) if name == "transformer_conv" else model


def mqar_batch(batch: int, seq: int, keys: int, values: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """inputs [B, L] and targets [B, L] (IGNORE_INDEX except at the queries' values). Token ids:
    keys 0..keys-1, values keys..keys+values-1, filler keys+values."""
    pairs = seq // 8
    filler = keys + values
    k = torch.argsort(torch.rand(batch, keys, generator=gen), dim=1)[:, :pairs]  # distinct keys
    v = keys + torch.randint(0, values, (batch, pairs), generator=gen)
    order = torch.argsort(torch.rand(batch, pairs, generator=gen), dim=1)
    qk, qv = k.gather(1, order), v.gather(1, order)
    context = torch.stack((k, v), dim=2).flatten(1)  # k1 v1 k2 v2 ...
    queries = torch.stack((qk, qv), dim=2).flatten(1)
    gap = torch.full((batch, seq + 1 - context.shape[1] - queries.shape[1]), filler)
    tokens = torch.cat((context, gap, queries), dim=1)  # [B, L + 1]
    targets = torch.full((batch, seq + 1), IGNORE_INDEX)
    targets[:, -queries.shape[1] + 1::2] = tokens[:, -queries.shape[1] + 1::2]  # the queries' values
    return tokens[:, :-1], targets[:, 1:]


def model_config(name: str, width: int, seq: int, vocab: int, segment: int, overrides: list[str]):
    return load_config(None, SHAPE + MODELS[name] + [f"model.mlp_width={width}", f"model.seq_len={seq}",
                                                     f"model.vocab_size={vocab}",
                                                     f"model.memory_caching.segment={segment}", *overrides]).model


def matched_width(name: str, target: int, base_width: int, seq: int, vocab: int, segment: int,
                  overrides: list[str]) -> int:
    """The MLP width (a multiple of 8) whose model has the parameter count nearest `target`."""
    def params(width: int) -> int:
        return model_costs(model_config(name, width, seq, vocab, segment, overrides)).total_params + extra

    cfg = model_config(name, base_width, seq, vocab, segment, overrides)
    extra = sum(p.numel() for n, p in build(name, cfg, 0).named_parameters() if n.endswith(".taps"))

    return min(range(8, 4 * base_width + 1, 8), key=lambda w: abs(params(w) - target))


def train_and_evaluate(name: str, args, vocab: int, width: int, lengths: list[int]) -> dict:
    cfg = model_config(name, width, max(lengths), vocab, args.segment, args.overrides)
    model = build(name, cfg, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    held_out_gen = torch.Generator().manual_seed(20_000 + args.seed)  # neither the training nor the final sequences
    held_out = [mqar_batch(args.eval, seq, args.keys, args.values, held_out_gen) for seq in lengths]
    curve = []

    def next_loss(step: int) -> torch.Tensor:
        seq = lengths[int(torch.randint(0, len(lengths), (1,), generator=gen))]
        tokens, targets = mqar_batch(args.batch, seq, args.keys, args.values, gen)
        return cross_entropy(model(tokens), targets)

    def stalled(step: int, losses: list[float]) -> bool:
        if not args.eval_every or (step + 1) % args.eval_every:
            return False
        curve.append({"step": step + 1, "held_out_accuracy": round(statistics.fmean(
            query_accuracy(model, *batch) for batch in held_out), 4), "train_loss": round(
            statistics.fmean(losses[-args.eval_every:]), 4), "s": round(time.perf_counter() - start, 1)})
        print(json.dumps({"model": name, **curve[-1]}), file=sys.stderr, flush=True)
        best = 0  # the last evaluation that beat the best before it by min_delta
        for i in range(1, len(curve)):
            if curve[i]["held_out_accuracy"] >= curve[best]["held_out_accuracy"] + args.min_delta:
                best = i
        return len(curve) - 1 - best >= args.patience

    start = time.perf_counter()
    losses = train_small(model, args.lr, args.steps, args.warmup, next_loss, should_stop=stalled)
    train_s = time.perf_counter() - start
    accuracy, by_chunk = {}, {}
    memories = [m for m in model.modules() if isinstance(m, NeuralMemory)]
    for chunk in [None] + ([] if not memories else args.eval_chunks):
        for m in memories:  # the deep memory read with another chunk size (1: the exact recurrence)
            m.chunk_size = chunk or cfg.titans.chunk_size
        eval_gen = torch.Generator().manual_seed(10_000 + args.seed)  # the same sequences for every chunk size
        result = by_chunk.setdefault(chunk, {}) if chunk else accuracy
        for seq in lengths:
            result[seq] = round(query_accuracy(model, *mqar_batch(args.eval, seq, args.keys, args.values, eval_gen)), 4)
    extra = {"accuracy_by_eval_chunk": by_chunk} if by_chunk else {}
    return {"model": name, "params": sum(p.numel() for p in model.parameters()), "mlp_width": width,
            "accuracy": accuracy, **extra, "final_train_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
            "steps_run": len(losses), "stopped": "plateau" if len(losses) < args.steps else "budget",
            "learning_curve": curve, "train_s": round(train_s, 1)}


@torch.no_grad()
def query_accuracy(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> float:
    """The fraction of the queries' values (the scored targets) predicted exactly (argmax)."""
    scored = targets != IGNORE_INDEX
    return (model(tokens).argmax(-1)[scored] == targets[scored]).float().mean().item()


def markdown(report: dict) -> str:
    lengths = report["lengths"]
    lines = ["| model | params | " + " | ".join(f"L={n} ({n // 8} pairs)" for n in lengths) + " |",
             "|---|---|" + "---|" * len(lengths)]
    for r in report["results"]:
        lines.append(f"| {r['model']} | {r['params']:,} | "
                     + " | ".join(f"{r['accuracy'][n]:.3f}" for n in lengths) + " |")
    return "\n".join(lines)


def summarise(reports: list[dict]) -> dict:
    """Runs grouped by model and length: accuracy mean, sample std and per seed, steps run, stops."""
    rows = {}
    for report in reports:
        for r in report["results"]:
            for seq, acc in r["accuracy"].items():
                row = rows.setdefault((r["model"], int(seq)), {"model": r["model"], "length": int(seq),
                                                                "params": r["params"], "runs": []})
                row["runs"].append({"seed": report["seed"], "accuracy": acc, "steps_run": r["steps_run"],
                                    "stopped": r["stopped"], "train_s": r["train_s"]})
    for row in rows.values():
        accs = [run["accuracy"] for run in row["runs"]]
        row["mean"] = round(statistics.fmean(accs), 4)
        row["std"] = round(statistics.stdev(accs), 4) if len(accs) > 1 else None
    return {"rows": list(rows.values()), "chance": 1 / reports[0]["values"]}


def summary_markdown(summary: dict) -> str:
    lines = ["| model | params | L | accuracy (mean ± std) | per seed | steps run (why stopped) |", "|---" * 6 + "|"]
    for row in summary["rows"]:
        spread = f" ± {row['std']:.3f}" if row["std"] is not None else ""
        lines.append(f"| {row['model']} | {row['params']:,} | {row['length']} | {row['mean']:.3f}{spread} | "
                     + ", ".join(f"{run['accuracy']:.3f}" for run in row["runs"]) + " | "
                     + ", ".join(f"{run['steps_run']} ({run['stopped']})" for run in row["runs"]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="32,64,128")
    parser.add_argument("--models", default="transformer,linear_none,linear_residual,linear_grm,linear_soup,"
                                            "linear_ssc,deep_none,deep_grm")
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--eval", type=int, default=128, help="sequences per length for the accuracy")
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--keys", type=int, default=32)
    parser.add_argument("--values", type=int, default=32)
    parser.add_argument("--segment", type=int, default=16, help="model.memory_caching.segment")
    parser.add_argument("--mlp-width", type=int, default=128, help="the Transformer's MLP width")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--markdown", action="store_true", help="also print the table (stderr)")
    parser.add_argument("--eval-chunks", default="", help="deep memories: also evaluate with these chunk sizes "
                                                          "(e.g. 1, the token-by-token recurrence)")
    parser.add_argument("--eval-every", type=int, default=0, help="steps between held-out evaluations "
                                                                   "(0: none, train the whole budget)")
    parser.add_argument("--patience", type=int, default=3, help="evaluations without a gain of --min-delta")
    parser.add_argument("--min-delta", type=float, default=0.01, help="held-out accuracy gain that counts")
    parser.add_argument("--summarise", nargs="+", metavar="REPORT", help="group these JSON reports by model and length")
    parser.add_argument("overrides", nargs="*", help="key=value applied to every model")
    args = parser.parse_args()
    if args.summarise:
        reports = []
        for path in args.summarise:
            with open(path) as f:
                reports.append(json.load(f))
        summary = summarise(reports)
        print(json.dumps(summary, indent=1))
        if args.markdown:
            print(summary_markdown(summary), file=sys.stderr)
        return
    torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")]
    args.eval_chunks = [int(n) for n in args.eval_chunks.split(",") if n]
    vocab = args.keys + args.values + 1
    names = args.models.split(",")
    target = model_costs(model_config("transformer", args.mlp_width, max(lengths), vocab, args.segment,
                                      args.overrides)).total_params
    results = []
    for name in names:
        width = args.mlp_width if name == "transformer" else matched_width(
            name, target, args.mlp_width, max(lengths), vocab, args.segment, args.overrides)
        results.append(train_and_evaluate(name, args, vocab, width, lengths))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)  # progress
    report = {"task": "mqar", "lengths": lengths, "pairs": [n // 8 for n in lengths], "keys": args.keys,
              "values": args.values, "segment": args.segment, "steps": args.steps, "batch": args.batch,
              "lr": args.lr, "seed": args.seed, "eval_every": args.eval_every,
              "patience": args.patience, "min_delta": args.min_delta, "threads": args.threads,
              "overrides": args.overrides,
              "results": results}
    print(json.dumps(report, indent=1))
    if args.markdown:
        print(markdown(report), file=sys.stderr)


if __name__ == "__main__":
    main()
