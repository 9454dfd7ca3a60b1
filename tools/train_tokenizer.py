"""Train a sentencepiece tokenizer (BPE by default) on text, jsonl, parquet, .gz/.zst, datasets folders.

    python tools/train_tokenizer.py --input PATH... --vocab-size N --output PREFIX

Writes PREFIX.model, PREFIX.vocab and PREFIX.json (settings). Byte-exact by default (identity
normalisation, whitespace kept, byte fallback): decode(encode(text)) == text. The same inputs,
settings and --seed give the same model bytes. Progress on stderr: a bar of the documents read,
then a line every 10 s while sentencepiece trains (--verbose: sentencepiece's own log).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from megatron_taper.data.corpus import SkipLog, add_input_arguments, documents_from_arguments
from megatron_taper.data.tokenizer import MODEL_TYPES, train_tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_input_arguments(parser)
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--output", required=True, metavar="PREFIX", help="writes PREFIX.model/.vocab/.json")
    parser.add_argument("--model-type", choices=MODEL_TYPES, default="bpe")
    parser.add_argument("--no-byte-exact", dest="byte_exact", action="store_false",
                        help="sentencepiece's default normalisation (NFKC, whitespace collapsed): not lossless")
    parser.add_argument("--seed", type=int, default=0, help="sampling of training lines and trainer randomness")
    parser.add_argument("--max-sentences", type=int, default=2_000_000,
                        help="train on a seeded uniform sample of at most this many lines")
    parser.add_argument("--character-coverage", type=float, default=0.9995)
    parser.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no reading bar and no 'training: N s' lines on stderr")
    parser.add_argument("--verbose", action="store_true", help="sentencepiece's own log (BPE: its merge count)")
    args = parser.parse_args(argv)
    skips = SkipLog(strict=args.strict)
    started = time.time()
    try:
        texts = (d.text for d in documents_from_arguments(args, skips))
        settings = train_tokenizer(
            texts, args.output, args.vocab_size, model_type=args.model_type, byte_exact=args.byte_exact,
            seed=args.seed, max_sentences=args.max_sentences, character_coverage=args.character_coverage,
            num_threads=args.threads, progress=args.progress, verbose=args.verbose,
            extra={"inputs": args.input or ["<embedded corpus>"]})
    except ValueError as e:
        print(f"train_tokenizer: error: {e}", file=sys.stderr)
        return 2
    settings["skipped"] = skips.to_dict()
    with open(args.output + ".json", "w") as f:
        json.dump(settings, f, indent=1, sort_keys=True)
    print(f"wrote {args.output}.model ({args.vocab_size} pieces, {settings['training_lines']} training lines, "
          f"{skips.total} input lines skipped) in {time.time() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
