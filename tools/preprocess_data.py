"""Tokenize raw text, jsonl, parquet, .gz/.zst files or Hugging Face datasets into MDS shards for training.

    python tools/preprocess_data.py --input PATH... --tokenizer PREFIX.model --output DIR
        [--workers N] [--val-fraction F]

Writes DIR/train/ and, when F > 0 (default 0.01), DIR/val/ (mosaicml-streaming MDS, one sample per document:
its tokens followed by EOS), DIR/stats.json (documents, tokens, skipped lines by reason with
file:line examples) and DIR/tokenizer.model. Malformed lines are skipped and counted (--strict:
fail with file:line). A non-empty DIR is refused without --overwrite. The output appears at DIR
only once complete. Inputs are recognised by content and name (megatron_taper.data.readers): text,
jsonl, parquet, .gz/.zst of text or jsonl, saved `datasets` folders, hf:NAME (`datasets` library);
--text-key names the field holding the text (a comma-separated list is tried in order); an input
that yields no document is an error naming it (a text file: a warning); other binary files are refused, naming
the file. A text input that is not UTF-8 (e.g. Latin-1) is skipped with one warning line naming its first bad
byte and the iconv command that converts it. Warnings are one `[preprocess] warning:` line each.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import warnings

from megatron_taper.data.corpus import SkipLog, add_input_arguments, documents_from_arguments
from megatron_taper.data.preprocess import preprocess

VAL_FRACTION = 0.01


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through preprocess(), which removes its partial output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_input_arguments(parser)
    parser.add_argument("--tokenizer", required=True, metavar="PREFIX.model")
    parser.add_argument("--output", required=True, metavar="DIR")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer threads (default 1)")
    parser.add_argument("--val-fraction", type=float, default=VAL_FRACTION,
                        help="fraction of documents (by a keyed hash of their text) written to DIR/val "
                             "(default %(default)s; 0: no held-out split, and runs on DIR evaluate nothing)")
    parser.add_argument("--split-seed", type=int, default=0, help="key of the train/val hash")
    parser.add_argument("--compression", default=None, help="MDS shard compression, e.g. zstd (default none)")
    parser.add_argument("--shard-size", default="64mb", help="MDS shard size limit (default 64mb)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty DIR")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    args = parser.parse_args(argv)
    skips = SkipLog(strict=args.strict)
    previous = signal.signal(signal.SIGTERM, _terminate)
    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warning
        return _run(args, skips, previous)


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"[preprocess] warning: {message}", file=sys.stderr, flush=True)


def _run(args: argparse.Namespace, skips: SkipLog, previous) -> int:
    try:
        stats = preprocess(
            documents_from_arguments(args, skips), args.tokenizer, args.output, skips=skips, workers=args.workers,
            val_fraction=args.val_fraction, split_seed=args.split_seed, overwrite=args.overwrite,
            compression=None if args.compression in (None, "", "none") else args.compression,
            shard_size=args.shard_size, progress=args.progress, inputs=args.input or ["<embedded corpus>"])
    except ValueError as e:
        print(f"preprocess_data: error: {e}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    summary = {k: stats[k] for k in ("documents", "tokens", "splits", "mb_per_s", "tokens_per_s")}
    summary["skipped"] = stats["skipped"]["by_reason"]
    print(json.dumps({"output": args.output, **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
