"""The Trainer reading its MDS shards from a slow object store: how long each step waits for data.

A small MDS dataset (the standard library's sources, a 512-token sentencepiece model, small
shards so that there are many) is served by benchmarks/object_store.py (a local HTTP server in a
thread, the Hugging Face Hub's URL layout, `delay-ms` before every answer; mosaicml-streaming's
own `hf://` downloader fetches from it, one HEAD and one GET per file). The real Trainer
(configs/tiny_taper.yaml, one process) trains on it with data.path=hf://... and a fresh
data.cache_dir, in a child process per variant:

    local       data.path is the dataset folder itself (no download)
    before      the slow store, shards downloaded when a sample first needs them (the shard
                lookahead off: streaming.SAMPLES_AHEAD = 0), behind the 2-step batch prefetch
    after       the slow store, as the code is (shards of the next SAMPLES_AHEAD samples
                downloaded by SHARDS_IN_FLIGHT background threads)

Per variant: the first step's time (it waits for the index and its first shards in every
variant), then over the later steps the median and max step time, and the seconds the training
thread spent waiting for its batches (Prefetcher.next). Prints one JSON object.

    python benchmarks/remote_data.py [--steps 20] [--delay-ms 50] [--shard-size 16kb] [key=value ...]
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

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def build_dataset(root: str, n_bytes: int, shard_size: str) -> str:
    from megatron_taper.data.corpus import SkipLog, embedded_files, read_documents
    from megatron_taper.data.preprocess import preprocess
    from megatron_taper.data.tokenizer import train_tokenizer

    docs = [open(f, encoding="utf-8", errors="replace").read() for f in embedded_files(n_bytes)]
    train_tokenizer(docs, os.path.join(root, "tok"), 512, seed=0)
    with open(os.path.join(root, "docs.jsonl"), "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    out, skips = os.path.join(root, "mds"), SkipLog(strict=False)
    preprocess(read_documents([os.path.join(root, "docs.jsonl")], skips), os.path.join(root, "tok.model"), out,
               skips=skips, val_fraction=0.05, shard_size=shard_size, progress=False)
    return out


def child(data_path: str, cache: str, run_dir: str, steps: int, lookahead: bool, overrides: list[str]) -> dict:
    """Runs in the child process: `steps` Trainer steps; per step its seconds and the seconds it
    waited for its batches."""
    import torch

    from megatron_taper.config import load_config
    from megatron_taper.data import prefetch, streaming
    from megatron_taper.training.trainer import Trainer

    if not lookahead:
        streaming.SAMPLES_AHEAD = 0
    torch.set_num_threads(1)
    cfg = load_config(os.path.join(REPO, "configs/tiny_taper.yaml"),
                      ["model.vocab_size=512", f"data.path={data_path}", f"data.cache_dir={cache}",
                       f"run.dir={run_dir}", "run.tensorboard=false", "train.device=cpu", "train.precision=fp32",
                       "train.eval_interval=0", "checkpoint.interval=0", *overrides])
    trainer = Trainer(cfg)
    trainer.prefetch = prefetch.Prefetcher(trainer.train_source, trainer.accum)
    waits: list[float] = []
    draw = trainer.prefetch.next

    def timed_next():
        t0 = time.perf_counter()
        out = draw()
        waits.append(time.perf_counter() - t0)
        return out

    trainer.prefetch.next = timed_next
    seconds = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.train_step()
        seconds.append(time.perf_counter() - t0)
    trainer.prefetch.close()
    trainer.metrics.close()
    return {"step_s": seconds, "wait_s": waits, "shards_opened": len(trainer.train_source.reader._maps),
            "shards": len(trainer.train_source.reader._shards)}


def summary(run: dict) -> dict:
    later, waits = run["step_s"][1:], run["wait_s"][1:]
    return {"first_step_s": round(run["step_s"][0], 3), "first_step_wait_s": round(run["wait_s"][0], 3),
            "later_median_step_s": round(statistics.median(later), 4), "later_max_step_s": round(max(later), 4),
            "later_total_wait_s": round(sum(waits), 3), "later_max_wait_s": round(max(waits), 4),
            "later_steps_waiting_over_10ms": sum(w > 0.01 for w in waits),
            "shards_opened": run["shards_opened"], "shards": run["shards"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--delay-ms", type=float, default=50.0)
    parser.add_argument("--shard-size", default="16kb")
    parser.add_argument("--corpus-bytes", type=int, default=1_500_000)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(**json.loads(args.child))))
        return
    sys.path.insert(0, HERE)
    from object_store import DelayedHub

    result: dict = {"benchmark": "remote_data", "config": "configs/tiny_taper.yaml", "steps": args.steps,
                    "delay_ms_per_request": args.delay_ms, "shard_size": args.shard_size, "overrides": args.overrides}
    with tempfile.TemporaryDirectory() as tmp:
        data = build_dataset(tmp, args.corpus_bytes, args.shard_size)
        with DelayedHub(data, args.delay_ms / 1000) as hub:
            for name, path, lookahead in (("local", data, True), ("before", hub.data_path, False),
                                          ("after", hub.data_path, True)):
                spec = {"data_path": path, "cache": os.path.join(tmp, f"cache-{name}"),
                        "run_dir": os.path.join(tmp, f"run-{name}"), "steps": args.steps, "lookahead": lookahead,
                        "overrides": args.overrides}
                served = len(hub.requests)
                out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], cwd=REPO,
                                     env={**os.environ, **hub.env()}, capture_output=True, text=True, check=False)
                if out.returncode:
                    raise SystemExit(f"{name}: the training process failed:\n{out.stderr[-3000:]}")
                result[name] = {**summary(json.loads(out.stdout.strip().splitlines()[-1])),
                                "requests_served": len(hub.requests) - served}
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
