"""Helpers shared by the suite (imported as `runner`): real text as tokens and a Trainer runner."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from megatron_taper.data.corpus import embedded_files

REPO = Path(__file__).resolve().parents[2]

# A tiny model that trains in a few seconds on one CPU core; byte-level tokens (vocab 256).
TINY = [
    "model.n_layers=3", "model.d_model=64", "model.n_heads=4", "model.mlp_width=160",
    "model.vocab_size=256", "model.seq_len=32", "model.taper.multiple=16",
    "train.global_batch=8", "train.micro_batch=4", "train.lr=3e-3", "train.warmup_steps=5",
    "train.log_interval=1", "train.eval_batches=2", "run.tensorboard=false",
]


def stdlib_bytes(limit: int = 1_500_000) -> bytes:
    """Real English-and-code text every machine has: the embedded corpus's files, as bytes."""
    return b"".join(Path(path).read_bytes() for path in embedded_files(limit))


def run_train(args: list[str], nproc: int = 1, check: bool = True, timeout: float = 300,
              env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the Trainer in a fresh process (torchrun when nproc > 1)."""
    if nproc > 1:
        cmd = [sys.executable, "-m", "megatron_taper.torchrun", "--nproc-per-node", str(nproc),
               "--standalone", "-m", "megatron_taper.train", *args]
    else:
        cmd = [sys.executable, "-m", "megatron_taper.train", *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"trainer exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
                             f"stderr:\n{proc.stderr[-5000:]}")
    return proc


def train_in_process(args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run the Trainer's command line in this process (no interpreter start-up: seconds saved per
    run), with its console output and warnings captured as a subprocess's would be; for runs that
    need no signal and no torchrun."""
    import contextlib
    import io
    import warnings

    from megatron_taper.train import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        code = main(list(args))
    shown = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in seen)
    proc = subprocess.CompletedProcess(["megatron-taper-train", *args], code, out.getvalue(), shown + err.getvalue())
    if check and code != 0:
        raise AssertionError(f"trainer exited {code}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}")
    return proc


def read_metrics(run_dir: str | Path) -> list[dict]:
    from megatron_taper.training.metrics import read_metrics as read

    return read(Path(run_dir) / "metrics.jsonl")


def losses(run_dir: str | Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def assert_resumes_exactly(args: list[str], tmp_path: Path, stop_at: int = 3) -> list[float]:
    """Trains `args` (train.steps included) in this process straight through, and again stopped
    at `stop_at` (train.exit_after) then resumed: the loss sequences are bitwise equal and fall."""
    from megatron_taper.train import main

    assert main([*args, f"run.dir={tmp_path / 'straight'}"]) == 0
    assert main([*args, f"run.dir={tmp_path / 'split'}", f"train.exit_after={stop_at}"]) == 0
    assert len(losses(tmp_path / "split")) == stop_at
    assert main([*args, f"run.dir={tmp_path / 'split'}"]) == 0
    straight = losses(tmp_path / "straight")
    assert losses(tmp_path / "split") == straight and straight[-1] < straight[0]
    return straight


def saved_elements(model, forward, floating_only: bool = False) -> int:
    """Elements of the storages autograd saves for backward while `forward()` runs: each storage
    counted once, the model's parameters left out (what activation memory adds)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and (t.is_floating_point() or not floating_only):
            saved[storage.data_ptr()] = storage.nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(saved.values())


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (from /proc: parents, not process groups, since torchrun
    starts each worker in a session of its own), parents first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop(0))
        todo += children.get(tree[-1], [])
    return tree


def kill_tree(pid: int) -> list[int]:
    """SIGKILL `pid` and every process below it (listed first, killed together); their pids."""
    import signal

    tree = process_tree(pid)
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return tree
