"""Sample a continuation of a prompt from a checkpoint.

    python tools/generate.py --checkpoint DIR --prompt TEXT [--max-new-tokens N] [--temperature T]
        [--top-k K] [--top-p P] [--seed S] [--tokenizer PATH.model] [--device cpu|cuda] [--no-cache]

DIR: a checkpoint folder, a run folder (its newest checkpoint) or an exported folder (see
tools/evaluate.py). The model runs in one process (fp32). Tokenizer: --tokenizer, else the run's
(data.tokenizer, the sentencepiece model beside the data) or UTF-8 bytes for a vocab-256 run on a
.npy file. transformer, gated_attention and hope_attention (with its online CMS state) decode with
a KV cache; titans recomputes the whole prefix for every token (its memory's state is not kept yet).
Prints the prompt followed by the continuation on stdout and one line on stderr with the token
counts and tokens/s; exit code 2 on bad input. --temperature 0 is greedy decoding.
"""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint, run or exported folder")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default="", help="sentencepiece .model instead of the run's")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-cache", action="store_true", help="recompute the whole prefix for every token")
    args = parser.parse_args(argv)
    import torch

    from megatron_taper.checkpoint.checkpointer import CheckpointError
    from megatron_taper.inference.generation import SamplingOptions, generate
    from megatron_taper.inference.load import load_model, load_tokenizer, open_checkpoint

    try:
        ref = open_checkpoint(args.checkpoint)
        tokenizer = load_tokenizer(ref.config, ref.path, args.tokenizer)
        prompt = tokenizer.encode(args.prompt)
        if not prompt:
            raise ValueError("--prompt encodes to no tokens")
        stop = () if tokenizer.eos_id is None or tokenizer.eos_id < 0 else (tokenizer.eos_id,)
        opts = SamplingOptions(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, stop)
        opts.validate()
        model = load_model(ref, torch.device(args.device))
        result = generate(model, prompt, opts, use_cache=False if args.no_cache else None)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(args.prompt + tokenizer.decode(result.tokens))
    how = "kv cache" if result.cached else "full recompute per token"
    print(f"[generate] {len(prompt)} prompt + {len(result.tokens)} new tokens ({ref.config.model.arch}, {how}): "
          f"prefill {result.prefill_s * 1e3:.1f} ms, {result.tokens_per_s:.1f} tokens/s"
          + (" (stopped at EOS)" if result.stopped_at_eos else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
