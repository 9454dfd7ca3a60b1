"""Data pipeline throughput: preprocessing MB/s and tokens/s with 1 and 2 workers, loader tokens/s,
and the Trainer's tokens/s on the tiny recipe for comparison. Prints one JSON object.

    python benchmarks/data_throughput.py [--input ../shared/data/kjv.txt.gz] [--trainer-steps 20]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from megatron_taper.config import load_config
from megatron_taper.data.corpus import SkipLog, read_documents
from megatron_taper.data.preprocess import preprocess
from megatron_taper.data.streaming import StreamingSource
from megatron_taper.data.tokenizer import train_tokenizer
from megatron_taper.data.torchvision_compat import import_streaming

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure_loader(path: str, seq_len: int, micro_batch: int, seconds: float) -> dict:
    source = StreamingSource(path, "train", seq_len, micro_batch, 0, 1, 1234)
    source.next_batch()
    tokens, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        tokens += source.next_batch().numel()
    elapsed = time.perf_counter() - started
    return {"tokens_per_s": round(tokens / elapsed), "batches": tokens // (micro_batch * (seq_len + 1))}


def measure_trainer(data: str, steps: int, vocab_size: int, run_dir: str) -> float:
    cmd = [sys.executable, "-m", "megatron_taper.train", "--config", "configs/tiny_taper.yaml",
           f"data.path={data}", f"run.dir={run_dir}", f"train.steps={steps}", "train.log_interval=1",
           "train.eval_interval=0", "train.eval_batches=1", "run.tensorboard=false", f"model.vocab_size={vocab_size}"]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rates = [r["tokens_per_s"] for r in map(json.loads, f) if "tokens_per_s" in r]
    return statistics.median(rates[len(rates) // 2:])  # steady state: the second half


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", default=os.path.join(REPO, "..", "shared", "data", "kjv.txt.gz"))
    parser.add_argument("--text-mode", default="line")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--loader-seconds", type=float, default=5.0)
    parser.add_argument("--trainer-steps", type=int, default=20, help="0 skips the Trainer measurement")
    args = parser.parse_args()
    cfg = load_config(os.path.join(REPO, "configs", "tiny_taper.yaml"))
    seq_len, micro_batch = cfg.model.seq_len, cfg.train.micro_batch
    import_streaming()
    docs = list(read_documents([args.input], SkipLog(), text_mode=args.text_mode))
    in_mb = sum(len(d.text.encode("utf-8")) for d in docs) / 1e6
    result: dict = {"input": os.path.abspath(args.input), "input_mb": round(in_mb, 3), "documents": len(docs),
                    "cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        train_tokenizer((d.text for d in docs), os.path.join(tmp, "tok"), args.vocab_size, num_threads=2)
        result["tokenizer_train_s"] = round(time.perf_counter() - started, 2)
        for workers in (1, 2):
            out = os.path.join(tmp, f"data_w{workers}")
            stats = preprocess(docs, os.path.join(tmp, "tok.model"), out, skips=SkipLog(), workers=workers,
                               val_fraction=0.01, progress=False)
            result[f"preprocess_workers_{workers}"] = {k: stats[k] for k in ("seconds", "mb_per_s", "tokens_per_s")}
        result["tokens"] = stats["tokens"]
        result["loader"] = {"seq_len": seq_len, "micro_batch": micro_batch,
                            **measure_loader(out, seq_len, micro_batch, args.loader_seconds)}
        if args.trainer_steps:
            trainer = measure_trainer(out, args.trainer_steps, args.vocab_size, os.path.join(tmp, "run"))
            result["trainer_tokens_per_s"] = round(trainer)
            result["loader_over_trainer"] = round(result["loader"]["tokens_per_s"] / trainer, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
