"""In-context recall (multi-query associative recall, MQAR) on the CPU: Transformer vs the linear
and deep recurrent memories vs each Memory Caching variant, at equal parameters; prints JSON.

    python benchmarks/recall.py [--lengths 32,64,128] [--steps 250] [--batch 32] [--eval 128]
        [--models transformer,linear_none,linear_residual,...] [--eval-chunks 1] [--markdown] [key=value ...]

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
(reported per model); Memory Caching with segments of --segment tokens, top-k 2 for SSC; the
deep memory chunked by 8 (before issue 27's normalised inner step, at max_lr 0.005, chunk 16 made
its base diverge to NaN on this task at lr 5e-3 while deep_grm trained). --eval-chunks evaluates
the trained deep memories again with other chunk sizes (1 = the exact token-by-token recurrence).
Each --models entry can run in its own process; the figures in docs/memory_caching.md were
measured that way, 1 thread each.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from small_training import train_small  # benchmarks/small_training.py, beside this script

from megatron_taper.config import load_config
from megatron_taper.cost.flops import model_costs
from megatron_taper.models import build_model
from megatron_taper.models.layers import IGNORE_INDEX, cross_entropy
from megatron_taper.models.titans.neural_memory import NeuralMemory

MODELS = {
    "transformer": ["model.arch=transformer"],
    **{f"linear_{v}": ["model.arch=linear_memory", f"model.memory_caching.variant={v}"]
       for v in ("none", "residual", "grm", "soup", "ssc")},
    **{f"deep_{v}": ["model.arch=deep_memory", f"model.memory_caching.variant={v}"]
       for v in ("none", "residual", "grm", "soup", "ssc")},
}
SHAPE = ["model.n_layers=2", "model.d_model=64", "model.n_heads=2", "model.taper.schedule=uniform",
         "model.taper.start=1.0", "model.taper.multiple=8", "model.memory_caching.top_k=2",
         "model.memory_caching.linear_chunk=16", "model.titans.chunk_size=8"]


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
        return model_costs(model_config(name, width, seq, vocab, segment, overrides)).total_params

    return min(range(8, 4 * base_width + 1, 8), key=lambda w: abs(params(w) - target))


def train_and_evaluate(name: str, args, vocab: int, width: int, lengths: list[int]) -> dict:
    cfg = model_config(name, width, max(lengths), vocab, args.segment, args.overrides)
    torch.manual_seed(args.seed)
    model = build_model(cfg)
    model.init_weights(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    def next_loss(step: int) -> torch.Tensor:
        seq = lengths[int(torch.randint(0, len(lengths), (1,), generator=gen))]
        tokens, targets = mqar_batch(args.batch, seq, args.keys, args.values, gen)
        return cross_entropy(model(tokens), targets)

    start = time.perf_counter()
    losses = train_small(model, args.lr, args.steps, args.warmup, next_loss)
    train_s = time.perf_counter() - start
    accuracy, by_chunk = {}, {}
    memories = [m for m in model.modules() if isinstance(m, NeuralMemory)]
    for chunk in [None] + ([] if not memories else args.eval_chunks):
        for m in memories:  # the deep memory read with another chunk size (1: the exact recurrence)
            m.chunk_size = chunk or cfg.titans.chunk_size
        eval_gen = torch.Generator().manual_seed(10_000 + args.seed)  # the same sequences for every chunk size
        result = by_chunk.setdefault(chunk, {}) if chunk else accuracy
        with torch.no_grad():
            for seq in lengths:
                tokens, targets = mqar_batch(args.eval, seq, args.keys, args.values, eval_gen)
                scored = targets != IGNORE_INDEX
                result[seq] = round((model(tokens).argmax(-1)[scored] == targets[scored]).float().mean().item(), 4)
    extra = {"accuracy_by_eval_chunk": by_chunk} if by_chunk else {}
    return {"model": name, "params": sum(p.numel() for p in model.parameters()), "mlp_width": width,
            "accuracy": accuracy, **extra, "final_train_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
            "train_s": round(train_s, 1)}


def markdown(report: dict) -> str:
    lengths = report["lengths"]
    lines = ["| model | params | " + " | ".join(f"L={n} ({n // 8} pairs)" for n in lengths) + " |",
             "|---|---|" + "---|" * len(lengths)]
    for r in report["results"]:
        lines.append(f"| {r['model']} | {r['params']:,} | "
                     + " | ".join(f"{r['accuracy'][n]:.3f}" for n in lengths) + " |")
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
    parser.add_argument("overrides", nargs="*", help="key=value applied to every model")
    args = parser.parse_args()
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
              "lr": args.lr, "seed": args.seed, "threads": args.threads, "overrides": args.overrides,
              "results": results}
    print(json.dumps(report, indent=1))
    if args.markdown:
        print(markdown(report), file=sys.stderr)


if __name__ == "__main__":
    main()
