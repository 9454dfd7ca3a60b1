"""Held-out loss and perplexity of a checkpoint, per sequence length, as one JSON object.

    python tools/evaluate.py --checkpoint DIR [--data PATH] [--seq-lens 128,256,512] [--batches N]
        [--batch-size B] [key=value ...]
    torchrun --nproc-per-node 4 tools/evaluate.py --checkpoint DIR parallel.tp=2 parallel.pp=2

DIR: a checkpoint folder (run.dir/checkpoints/step-N, any pp/dp/tp layout and ZeRO engine it was
written with), a run folder (its newest checkpoint) or a folder exported by
tools/convert_checkpoint.py. The model is built at the layout given by the `parallel.*`
overrides (default: one process, no ZeRO) and only its weights are read. Data: the run's
`data.path` held-out split (MDS val/, or the tail of a .npy token file), or --data. Defaults:
the training `model.seq_len`, `train.eval_batches` micro-batches of `train.micro_batch`
sequences per data-parallel rank (fewer when the held-out split is smaller).
Prints {"checkpoint", "step", "layout", "data", "results": {seq_len: {"loss", "ppl", "tokens",
"batches"}}} on rank 0; exit code 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_taper.cli import OVERRIDES_HELP, parse_with_overrides


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        lengths = []
    if not lengths or any(n < 1 for n in lengths):
        raise ValueError(f"--seq-lens {text!r}: expected positive integers separated by commas, e.g. 128,256")
    return lengths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     epilog=f"{OVERRIDES_HELP} (e.g. parallel.tp=2 --train.device cpu)")
    parser.add_argument("--checkpoint", required=True, help="checkpoint, run or exported folder")
    parser.add_argument("--data", default="", help="held-out data instead of the run's data.path")
    parser.add_argument("--seq-lens", default="", help="comma-separated sequence lengths (default: model.seq_len)")
    parser.add_argument("--batches", type=int, default=0, help="micro-batches per dp rank and length")
    parser.add_argument("--batch-size", type=int, default=0, help="sequences per micro-batch")
    args, overrides = parse_with_overrides(parser, argv)
    from megatron_taper.checkpoint.checkpointer import CheckpointError
    from megatron_taper.inference.evaluate import evaluate_checkpoint

    try:
        if args.batches < 0 or args.batch_size < 0:
            raise ValueError("--batches and --batch-size must be positive")
        lengths = parse_lengths(args.seq_lens) if args.seq_lens else None
        result = evaluate_checkpoint(args.checkpoint, overrides, lengths, args.batches or None,
                                     args.batch_size or None, args.data)
    except (CheckpointError, ValueError) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
