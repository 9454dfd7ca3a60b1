"""Data pipeline throughput: preprocessing MB/s and tokens/s with 1 and 2 workers, loader tokens/s,
the Trainer's tokens/s on the tiny recipe for comparison, and the sample order at 10^7..10^9
documents. Prints one JSON object.

    python benchmarks/data_throughput.py [--input ../shared/data/kjv.txt.gz] [--trainer-steps 20]
        [--order-docs 1e7,1e8,1e9] [--order-dir /tmp] [--parts pipeline,order]

Order part: a synthetic table of document lengths (lognormal, mean 500 tokens, median ~300, as
uint32 like doc_lengths.npy) is written once per size to --order-dir (4 GB at 10^9, reused by
later runs); no MDS data is written. Each configuration runs in a fresh subprocess (one rank of
dp=8) and reports the time to its first micro-batch at the stream's start and after a mid-epoch
resume, the time per sample at random positions, and peak resident memory (VmHWM), with the
table in the page cache (read through once before each configuration), before (the
previous full per-epoch permutation, `_old_plan` below, kept here only for this comparison) and
after (megatron_taper.data.order). "before" is skipped where its estimated memory exceeds this
machine's available memory, and extrapolated linearly from the largest size measured.
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

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORDER_SEQ_LEN, ORDER_MICRO_BATCH, ORDER_DP, ORDER_RANK, ORDER_SEED = 2048, 8, 8, 3, 1234
MEAN_DOC_TOKENS = 500


def measure_loader(path: str, seq_len: int, micro_batch: int, seconds: float) -> dict:
    from megatron_taper.data.streaming import StreamingSource

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
    from megatron_taper.training.metrics import read_metrics

    rates = [r["tokens_per_s"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "tokens_per_s" in r]
    return statistics.median(rates[len(rates) // 2:])  # steady state: the second half


# -- sample order at scale -------------------------------------------------------------------------

def _old_plan(lengths: np.ndarray, seq_len: int, seed: int, epoch: int) -> tuple:
    """The previous streaming._EpochPlan (a full permutation of documents and samples per epoch),
    kept only as the baseline of this benchmark."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    doc_order = rng.permutation(len(lengths))
    ordered = lengths[doc_order]
    doc_ends = np.cumsum(ordered)
    doc_starts = doc_ends - ordered
    num_samples = int((int(doc_ends[-1]) - 1) // seq_len)
    return doc_order, doc_ends, doc_starts, num_samples, rng.permutation(num_samples)


class _OldOrder:
    """The previous StreamingSource's start-up (lengths loaded whole as int64, epoch 0 planned)
    and sample lookup, without reading tokens."""

    def __init__(self, path: str, seq_len: int, seed: int) -> None:
        self.lengths = np.load(path).astype(np.int64)
        self.seq_len, self.seed, self.plans = seq_len, seed, {}
        self.samples_per_epoch = self.plan(0)[3]

    def plan(self, epoch: int) -> tuple:
        if epoch not in self.plans:
            if len(self.plans) >= 2:
                del self.plans[min(self.plans)]
            self.plans[epoch] = _old_plan(self.lengths, self.seq_len, self.seed, epoch)
        return self.plans[epoch]

    def pieces(self, g: int) -> list[tuple[int, int, int]]:
        doc_order, doc_ends, doc_starts, s, sample_order = self.plan(g // self.samples_per_epoch)
        start = int(sample_order[g % s]) * self.seq_len
        pos, out, filled = int(np.searchsorted(doc_ends, start, side="right")), [], 0
        while filled < self.seq_len + 1:
            offset = start + filled - int(doc_starts[pos])
            take = min(self.seq_len + 1 - filled, int(doc_ends[pos] - doc_starts[pos]) - offset)
            out.append((int(doc_order[pos]), offset, offset + take))
            filled, pos = filled + take, pos + 1
        return out


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"no {field} in /proc/self/status")


def order_child(kind: str, path: str) -> dict:
    """One rank's start-up on a length table, in this (fresh) process."""
    from megatron_taper.data.order import LengthTable, SampleOrder

    rss_imports = _status_mb("VmRSS")
    mb, group = ORDER_MICRO_BATCH, ORDER_DP * ORDER_MICRO_BATCH

    def first_batch(order, consumed: int) -> None:
        first = consumed + ORDER_RANK * mb
        for g in range(first, first + mb):
            assert sum(b - a for _, a, b in order.pieces(g)) == ORDER_SEQ_LEN + 1

    started = time.perf_counter()
    order = (_OldOrder(path, ORDER_SEQ_LEN, ORDER_SEED) if kind == "before"
             else SampleOrder(LengthTable.from_npy(path), ORDER_SEQ_LEN, ORDER_SEED))
    first_batch(order, 0)
    to_first = time.perf_counter() - started
    s = order.samples_per_epoch
    started = time.perf_counter()
    resume_at = (3 * s // 2) // group * group  # mid epoch 1: that epoch's order is built on the way
    first_batch(order, resume_at)
    to_resumed = time.perf_counter() - started
    picks = np.random.default_rng(0).integers(s, 2 * s, 1000).tolist()
    started = time.perf_counter()
    for g in picks:
        order.pieces(g)
    per_sample = (time.perf_counter() - started) / len(picks)
    return {"time_to_first_batch_s": round(to_first, 3), "time_to_first_batch_after_resume_s": round(to_resumed, 3),
            "us_per_sample_random": round(per_sample * 1e6, 1), "samples_per_epoch": s,
            "vmhwm_mb": _status_mb("VmHWM"), "rss_after_imports_mb": rss_imports,
            "vmhwm_over_imports_mb": round(_status_mb("VmHWM") - rss_imports, 1)}


def lengths_file(folder: str, n: int) -> str:
    """A synthetic doc_lengths.npy of n documents, written once (in chunks) and reused."""
    path = os.path.join(folder, f"megatron_taper_doc_lengths_{n}_lognormal{MEAN_DOC_TOKENS}.npy")
    if os.path.isfile(path) and os.path.getsize(path) >= 4 * n:
        try:
            if np.load(path, mmap_mode="r").shape == (n,):
                return path
        except ValueError:
            pass
    table = np.lib.format.open_memmap(path + ".tmp", mode="w+", dtype=np.uint32, shape=(n,))
    chunk = 1 << 24
    for i, start in enumerate(range(0, n, chunk)):
        rng = np.random.default_rng([7, i])
        draws = rng.lognormal(np.log(MEAN_DOC_TOKENS) - 0.5, 1.0, min(chunk, n - start))
        table[start:start + len(draws)] = np.clip(draws, 1, 1 << 20)
    table.flush()
    del table
    os.replace(path + ".tmp", path)
    return path


def _read_through(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 26):
            pass


def _available_mb() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("MemAvailable:"))


def measure_order(sizes: list[int], folder: str) -> dict:
    out: dict = {"seq_len": ORDER_SEQ_LEN, "micro_batch": ORDER_MICRO_BATCH, "dp": ORDER_DP, "rank": ORDER_RANK,
                 "lengths": f"lognormal, mean {MEAN_DOC_TOKENS} tokens, uint32 .npy in {folder}", "sizes": {}}
    for n in sizes:
        started = time.perf_counter()
        path = lengths_file(folder, n)
        row: dict = {"lengths_file_gb": round(os.path.getsize(path) / 1e9, 2),
                     "lengths_ready_s": round(time.perf_counter() - started, 1)}
        # before: lengths int64 + order + ordered + ends + starts (5 x 8 B per document) + sample order
        need_mb = (5 * 8 * n + 8 * n * MEAN_DOC_TOKENS // ORDER_SEQ_LEN) / 2**20
        for kind in ("before", "after"):
            _read_through(path)  # both start with the table in the page cache, as on a warm node
            if kind == "before" and need_mb > 0.8 * _available_mb():
                row[kind] = {"skipped": f"needs ~{need_mb / 1024:.0f} GiB, {_available_mb() / 1024:.0f} GiB available"}
                continue
            cmd = [sys.executable, os.path.abspath(__file__), "--order-child", kind, "--order-lengths", path]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            row[kind] = json.loads(done.stdout.strip().splitlines()[-1])
        out["sizes"][f"{n:.0e}"] = row
    befores = [(n, out["sizes"][f"{n:.0e}"]["before"]) for n in sizes]
    measured = [(n, before) for n, before in befores if "skipped" not in before]
    if measured:
        n0, base = max(measured, key=lambda item: item[0])
        for n in sizes:
            before = out["sizes"][f"{n:.0e}"]["before"]
            if "skipped" in before:
                before["extrapolated_from"] = f"{n0:.0e}"
                before["time_to_first_batch_s"] = round(base["time_to_first_batch_s"] * n / n0, 1)
                before["vmhwm_over_imports_mb"] = round(base["vmhwm_over_imports_mb"] * n / n0)
    return out


# -- main ------------------------------------------------------------------------------------------

def measure_pipeline(args: argparse.Namespace) -> dict:
    from megatron_taper.config import load_config
    from megatron_taper.data.corpus import SkipLog, read_documents
    from megatron_taper.data.preprocess import preprocess
    from megatron_taper.data.tokenizer import train_tokenizer
    from megatron_taper.data.torchvision_compat import import_streaming

    cfg = load_config(os.path.join(REPO, "configs", "tiny_taper.yaml"))
    seq_len, micro_batch = cfg.model.seq_len, cfg.train.micro_batch
    import_streaming()
    docs = list(read_documents([args.input], SkipLog(), text_mode=args.text_mode))
    in_mb = sum(len(d.text.encode("utf-8")) for d in docs) / 1e6
    result: dict = {"input": os.path.abspath(args.input), "input_mb": round(in_mb, 3), "documents": len(docs)}
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
            # the most a background prefetch thread could save: the share of a step spent making batches
            result["data_share_of_step"] = round(trainer / result["loader"]["tokens_per_s"], 4)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", default=os.path.join(REPO, "..", "shared", "data", "kjv.txt.gz"))
    parser.add_argument("--text-mode", default="line")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--loader-seconds", type=float, default=5.0)
    parser.add_argument("--trainer-steps", type=int, default=20, help="0 skips the Trainer measurement")
    parser.add_argument("--parts", default="pipeline,order", help="comma-separated: pipeline, order")
    parser.add_argument("--order-docs", default="1e7,1e8,1e9", help="document counts of the order part")
    parser.add_argument("--order-dir", default=tempfile.gettempdir(), help="where the length tables are kept")
    parser.add_argument("--order-child", choices=("before", "after"), help=argparse.SUPPRESS)
    parser.add_argument("--order-lengths", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.order_child:
        print(json.dumps(order_child(args.order_child, args.order_lengths)))
        return
    parts = set(args.parts.split(","))
    result: dict = {"cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)}
    if "pipeline" in parts:
        result.update(measure_pipeline(args))
    if "order" in parts:
        result["order"] = measure_order([int(float(x)) for x in args.order_docs.split(",")], args.order_dir)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
