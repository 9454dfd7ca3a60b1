"""Measured peak memory of forward+backward next to the memory model's prediction (cost/memory.py).

    python benchmarks/activation_memory.py [--modes none,selective,full] [--loss-chunks 0,1024]
                                           [--steps N] [--nproc N]
                                           [--stage first|last --stage-layers K --in-flight N] [key=value ...]

Default shape: a ~1B tapered Transformer (16 layers, d_model 2048, 16 heads, uniform MLP width
5632 tapered by the default cosine schedule, vocabulary 32000), seq_len 1024, micro_batch 1, fp32
on the CPU. For each train.activation_checkpointing mode a fresh process (`--nproc` of them for
a tp / dp layout, joined over gloo) builds the run through build_run, runs one small
forward+backward so that the gradients exist (they stay resident and accumulate, as between the
micro-batches of a step), then measures `--steps` forward+backward passes of one micro-batch
without the optimizer step: the AdamW state is not allocated, and the model is evaluated without
it (`MemorySetup(optimizer=False)`).

Measured (per rank):
  CPU   host RSS with MALLOC_MMAP_THRESHOLD_=65536 (every tensor of 64 KiB or more is its own
        mapping, returned to the OS when freed): the peak is VmHWM after the steps, reset by
        writing 5 to /proc/self/clear_refs just before them.
        measured_activation_bytes = VmHWM - VmRSS before the steps;
        measured_peak_bytes = VmHWM - VmRSS before the model was built (after importing torch).
  CUDA  torch.cuda.max_memory_allocated (reset before the steps) minus memory_allocated before
        them; the peak is max_memory_allocated itself.
  `--meter tensors` (any device): the peak of the live bytes of the tensors the steps make
        (TensorMeter), measured_activation_bytes = measured_peak_bytes = that peak. The recurrent
        families (Titans, Memory Caching, Hope) make thousands of tensors under 64 KiB, which
        host RSS sees only as the heap's growth: after a full-size warm-up not at all.
Predicted: memory.model_memory(...).stage(all layers): activations and static (params + grads)
bytes, and their ratios measured / predicted. Under bf16 autocast the weights' bf16 copies are
made during the measured forward, so they count with the activations on both sides here (the
model books them as static).

`--stage first|last` runs one pipeline stage in one process instead: the model cut by
pipeline.strip_model to its first (embedding + layers 0..K-1) or last (layers L-K..L-1 + head)
`--stage-layers` K blocks, `--in-flight` N micro-batches forwarded before the first backward (as
1F1B holds them on that stage); each stage keeps each output to the end of its backward (as
torch.distributed.pipelining's fwd_cache: on the last stage the logits) and a non-last stage is
sent a gradient [b, S, d] per backward. Predicted: the stage's activations plus those outputs and one gradient
(the p2p receive buffers of torch.distributed.pipelining are not part of this one-process run).

`--full-step` measures whole training steps instead (forward_backward over the step's
micro-batches, then optimizer_step), at any layout (`--nproc` processes: pp x dp x tp, fsdp2 or
DeepSpeed): `--steps` warm-up steps (the AdamW state allocated), then the peak of one more step
(VmHWM as above; measured_peak_bytes counts from the RSS after importing torch and the modules a
step imports on first use: torch._dynamo, FSDP2, pipelining, DeepSpeed when it is the engine)
against this rank's predicted peak with the optimizer state (its chunks of the plan under
pipelining: PipelinePlan.rank_peak_bytes, null where not modelled: interleaved_zero_bubble,
dualpipev; without pipelining the whole model with the trainer's gradient accumulation,
preflight.step_split). benchmarks/layout_memory.py runs it over the layouts of
docs/memory_model.md.

`--loss-chunks` repeats every mode for each train.loss_chunk (0 = the unchunked loss; the
chunked one, parallel/loss.py, never holds fp32 logits of the whole micro-batch), e.g. the loss
at vocabulary 32K and 128K: `--modes none --loss-chunks 0,1024 model.vocab_size=128000
model.n_layers=2 model.d_model=256 ...` (docs/memory_model.md has the table).

Prints one JSON object: {"config": ..., "results": [one per mode and rank]}.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

DEFAULT = ["model.arch=transformer", "model.n_layers=16", "model.d_model=2048", "model.n_heads=16",
           "model.mlp_width=5632", "model.vocab_size=32000", "model.seq_len=1024", "model.taper.multiple=64",
           "train.micro_batch=1", "train.global_batch=1", "train.device=cpu", "train.precision=fp32"]
MMAP_THRESHOLD = "65536"


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


class PeakMeter:
    """Peak memory of a region: host RSS high-water mark on CPU, max_memory_allocated on CUDA."""

    def __init__(self, device) -> None:
        import torch

        self.torch, self.cuda = torch, device.type == "cuda"
        self.start = self.current()

    def current(self) -> int:
        return self.torch.cuda.memory_allocated() if self.cuda else _status_bytes("VmRSS")

    def reset(self) -> int:
        """Start a region: returns the bytes in use now."""
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        return self.current()

    def peak(self) -> int:
        if self.cuda:
            self.torch.cuda.synchronize()
            return self.torch.cuda.max_memory_allocated()
        return _status_bytes("VmHWM")


class TensorMeter:
    """`--meter tensors`: the peak of the bytes of the tensors made in a region and still alive
    (every aten op's output storage counted once from the op that made it until it is freed,
    through a TorchDispatchMode and a weakref finalizer on the storage; sampled after every op).
    Unlike host RSS it does not depend on where malloc puts a tensor: the recurrent families make
    thousands of tensors under 64 KiB, which come from the heap (MALLOC_MMAP_THRESHOLD_) and reuse
    memory a full-size warm-up step left there (RSS then misses them) or fragment it (RSS then
    over-reads them). Not seen: the buffers a kernel allocates and frees inside one op."""

    def __init__(self, device) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        meter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                meter.track(out)
                return out

        self.mode, self.live, self.bytes, self.high, self.start = Mode(), {}, 0, 0, 0

    def track(self, out) -> None:
        import weakref

        import torch
        from torch.utils._pytree import tree_leaves

        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.bytes += storage.nbytes()
                    weakref.finalize(storage, self.free, key)
        self.high = max(self.high, self.bytes)

    def free(self, key: int) -> None:
        self.bytes -= self.live.pop(key)

    def reset(self) -> int:
        self.mode.__enter__()
        return 0

    def peak(self) -> int:
        self.mode.__exit__(None, None, None)
        return self.high


def make_meter(kind: str, device):
    return TensorMeter(device) if kind == "tensors" else PeakMeter(device)


def _tokens(cfg, rows: int, seq: int, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.model.vocab_size, (rows, seq + 1), generator=gen)


def whole_model(cfg, steps: int, meter_kind: str = "rss") -> dict:
    """build_run, one small warm-up step, then `steps` measured forward+backward passes."""
    import torch

    from megatron_taper.cost.memory import MemorySetup, model_memory
    from megatron_taper.training.build import build_run

    device_type = "cuda" if cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available()) \
        else "cpu"
    meter = make_meter(meter_kind, torch.device(device_type))
    run = build_run(cfg)
    pm, ctx = run.model, run.ctx
    autocast = (lambda: torch.autocast(ctx.device.type, dtype=torch.bfloat16)) if run.bf16 else contextlib.nullcontext
    warm = 2 * cfg.parallel.tp  # a short sequence that sequence parallelism can split
    pm.forward_backward([_tokens(cfg, 1, warm, 99)], autocast)
    batches = [_tokens(cfg, cfg.train.micro_batch, cfg.model.seq_len, ctx.dp_rank * 1000 + i) for i in range(steps)]
    before = meter.reset()
    for batch in batches:
        pm.forward_backward([batch], autocast)
    peak = meter.peak()
    setup = dataclasses.replace(MemorySetup.from_config(cfg.parallel, cfg.train, ctx.dp, run.bf16), optimizer=False)
    mm = model_memory(cfg.model, setup)
    stage = mm.stage(range(cfg.model.n_layers))
    casts = sum(p.params for p in [*mm.layers, mm.embedding, mm.head]) * setup.cast_bytes_per_param()
    state = sum(_nbytes(p) + _nbytes(p.grad) for p in pm.module.parameters())
    return _row(cfg, ctx.rank, peak - before, peak - meter.start, stage.activations + casts, stage.static - casts,
                state)


def pipeline_stage(cfg, which: str, n_layers: int, in_flight: int, meter_kind: str = "rss") -> dict:
    """One pipeline stage in one process (module doc): `in_flight` forwards, then the backwards."""
    import torch

    from megatron_taper.cost.memory import MemorySetup, model_memory
    from megatron_taper.models import build_model
    from megatron_taper.parallel.block_options import apply_block_options
    from megatron_taper.parallel.loss import loss_function
    from megatron_taper.parallel.pp.schedule import strip_model

    meter = make_meter(meter_kind, torch.device("cpu"))
    m, last = cfg.model, which == "last"
    layers = list(range(m.n_layers - n_layers, m.n_layers)) if last else list(range(n_layers))
    model = build_model(m)
    model.init_weights(cfg.train.seed)
    strip_model(model, layers, embedding=not last, head=last)
    apply_block_options(model, cfg.train.activation_checkpointing, cfg.train.ac_every, False)
    b, s, d = cfg.train.micro_batch, m.seq_len, m.d_model
    gen = torch.Generator().manual_seed(0)

    def inputs(rows: int, seq: int):
        if last:
            return torch.randn(rows, seq, d, generator=gen, requires_grad=True), _tokens(cfg, rows, seq, 1)[:, 1:]
        return _tokens(cfg, rows, seq, 1)[:, :-1], None

    loss_fn = loss_function(cfg.train.loss_chunk)

    def forward(x, target):
        out = model(x)
        return (out, loss_fn(out, target)) if last else (out, out)

    x, target = inputs(1, 2)  # warm-up: gradients allocated
    forward(x, target)[1].sum().backward()
    batches = [inputs(b, s) for _ in range(in_flight)]
    before = meter.reset()
    # each output (the last stage's logits too) kept to the end of its backward, as pipelining's fwd_cache
    outputs = [forward(x, target) for x, target in batches]
    while outputs:
        _, out = outputs[0]
        out.backward(None if last else torch.randn(out.shape, generator=gen))
        del outputs[0], out
    peak = meter.peak()
    mm = model_memory(m, MemorySetup(micro_batch=b, pipelined=True, optimizer=False,
                                     activation_checkpointing=cfg.train.activation_checkpointing,
                                     ac_every=cfg.train.ac_every, loss_chunk=cfg.train.loss_chunk))
    stage = mm.stage(layers, index=int(last), n_stages=2, in_flight=in_flight)
    sent = 0.0 if last else (in_flight + 1) * mm.io  # the outputs in flight and one received gradient
    state = sum(_nbytes(p) + _nbytes(p.grad) for p in model.parameters())
    row = _row(cfg, 0, peak - before, peak - meter.start, stage.activations + sent, stage.static, state)
    row.update(stage=which, layers=layers, in_flight=in_flight)
    return row


def full_step(cfg, steps: int) -> dict:
    """`--full-step`: build_run, `steps` training steps as the Trainer takes them (the step's
    micro-batches through forward_backward, then optimizer_step: reduce, clip, AdamW, gradients
    cleared), then one more measured; the whole step's peak against the predicted peak of this
    rank's stage with the optimizer state (plan_stages under pipelining, else the whole model)."""
    import torch
    import torch._dynamo  # noqa: F401 - the optimizer's first use imports it: modules, not the step's memory
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401

    if cfg.parallel.zero == "deepspeed":
        import deepspeed  # noqa: F401

    from megatron_taper.cost.memory import MemorySetup, model_memory
    from megatron_taper.cost.preflight import step_split
    from megatron_taper.training.build import build_run

    meter = PeakMeter(torch.device("cpu"))
    run = build_run(cfg)
    pm, ctx, optimizer = run.model, run.ctx, run.optimizer
    autocast = (lambda: torch.autocast(ctx.device.type, dtype=torch.bfloat16)) if run.bf16 else contextlib.nullcontext
    accum = cfg.train.global_batch // (cfg.train.micro_batch * ctx.dp)

    def step(seed: int) -> None:
        batches = [_tokens(cfg, cfg.train.micro_batch, cfg.model.seq_len, seed * 100 + ctx.dp_rank * 10 + i)
                   for i in range(accum)]
        pm.forward_backward(batches, autocast)
        pm.optimizer_step(optimizer, cfg.train.grad_clip)

    times, cpu_times = [], []
    for i in range(steps + 1):
        if i == steps:
            before = meter.reset()
        start, cpu_start = time.perf_counter(), time.process_time()
        step(i)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    peak = meter.peak()
    plan = getattr(pm, "plan", None)
    if plan is not None:  # every chunk of this rank (interleaved schedules: several)
        predicted_static, predicted_peak = plan.rank_static_bytes(ctx.pp_rank), plan.rank_peak_bytes(ctx.pp_rank)
    else:
        micro_batch, accumulated = step_split(cfg.parallel, cfg.train, ctx.dp)  # as the planner
        setup = MemorySetup.from_config(cfg.parallel, cfg.train, ctx.dp, run.bf16, micro_batch=micro_batch,
                                        microbatches=accumulated)
        whole = model_memory(cfg.model, setup).stage(range(cfg.model.n_layers))
        predicted_static, predicted_peak = whole.static, whole.total
    return {"layout": {"zero": cfg.parallel.zero, "pp": ctx.pp, "dp": ctx.dp, "cp": ctx.cp, "tp": ctx.tp},
            "precision": "bf16" if run.bf16 else "fp32", "rank": ctx.rank,
            "measured_peak_bytes": peak - meter.start, "predicted_peak_bytes": predicted_peak,
            "peak_ratio": (peak - meter.start) / predicted_peak if predicted_peak else None,
            "resident_before_step_bytes": before - meter.start, "predicted_static_bytes": predicted_static,
            "step_s": min(times[1:] or times),  # the fastest step after the first
            "step_cpu_s": min(cpu_times[1:] or cpu_times)}  # its CPU time: every thread of this process


def _nbytes(t) -> int:
    if t is None:
        return 0
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _row(cfg, rank: int, measured_act: int, measured_peak: int, predicted_act: float, predicted_static: float,
         state_bytes: int) -> dict:
    predicted_peak = predicted_act + predicted_static
    return {"activation_checkpointing": cfg.train.activation_checkpointing, "loss_chunk": cfg.train.loss_chunk,
            "vocab_size": cfg.model.vocab_size, "precision": cfg.train.precision, "rank": rank,
            "measured_activation_bytes": measured_act, "predicted_activation_bytes": predicted_act,
            "activation_ratio": measured_act / predicted_act,
            "measured_peak_bytes": measured_peak, "predicted_peak_bytes": predicted_peak,
            "peak_ratio": measured_peak / predicted_peak,
            "params_grads_bytes": state_bytes, "predicted_params_grads_bytes": predicted_static}


def worker(args: argparse.Namespace) -> None:
    from megatron_taper.config import load_config

    cfg = load_config(None, DEFAULT + args.overrides + [f"train.activation_checkpointing={args.mode}",
                                                        f"train.loss_chunk={args.loss_chunk}"])
    if args.full_step:
        row = full_step(cfg, args.steps)
    elif args.stage:
        row = pipeline_stage(cfg, args.stage, args.stage_layers, args.in_flight, args.meter)
    else:
        row = whole_model(cfg, args.steps, args.meter)
    row["meter"] = args.meter
    with open(os.path.join(args.out, f"rank{int(os.environ.get('RANK', 0))}.json"), "w") as f:
        json.dump(row, f)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _worker_argv(out: str, overrides: list[str], mode: str, steps: int = 1, stage: str = "", stage_layers: int = 1,
                 in_flight: int = 1, full: bool = False, loss_chunk: int = 0, meter: str = "rss") -> list[str]:
    return ["--worker", "--out", out, "--mode", mode, "--steps", str(steps), "--stage", stage, "--stage-layers",
            str(stage_layers), "--in-flight", str(in_flight), "--loss-chunk", str(loss_chunk), "--meter", meter,
            *(["--full-step"] if full else []), *overrides]


def _env(nproc: int, threads: int, timing: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": REPO, **({} if timing else {"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD})}
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(REPO, ".cache", "torch_extensions"))
    if nproc > 1:
        env["OMP_NUM_THREADS"] = "1"
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _read_rows(folder: str, nproc: int) -> list[dict]:
    rows = []
    for rank in range(nproc):
        with open(os.path.join(folder, f"rank{rank}.json")) as f:
            rows.append(json.load(f))
    return rows


def measure(overrides: list[str], mode: str, nproc: int = 1, steps: int = 1, stage: str = "",
            stage_layers: int = 1, in_flight: int = 1, timeout: float = 3600.0, full: bool = False,
            loss_chunk: int = 0, threads: int = 0, timing: bool = False, meter: str = "rss") -> list[dict]:
    """Run one measurement in `nproc` fresh processes; one result per rank. `threads` > 0: torch's
    threads per process (OMP_NUM_THREADS); else 1 per process when several run, torch's default alone.
    `timing`: glibc's default allocator instead of MALLOC_MMAP_THRESHOLD_ (the peaks are then not
    exact, the step times are those of a training run: the low threshold makes every large
    allocation a fresh mapping whose pages fault on first touch). `meter`: --meter (rss | tensors).

    Fresh interpreters on purpose (not megatron_taper/parallel/spawn.py's forked children): glibc
    reads MALLOC_MMAP_THRESHOLD_ when a process starts, and a child forked from a server that
    imported torch without it would start from that server's heap (measure_forked starts its own
    server with it). Several processes are started by torchrun (--standalone: its own store on a
    free port), as benchmarks/context_parallel.py's are."""
    with tempfile.TemporaryDirectory() as tmp:
        worker = [os.path.abspath(__file__), *_worker_argv(tmp, overrides, mode, steps, stage, stage_layers, in_flight,
                                                           full, loss_chunk, meter)]
        launcher = []
        if nproc > 1:
            launcher = ["-m", "megatron_taper.torchrun", "--standalone", "--nproc-per-node", str(nproc)]
        proc = subprocess.run([sys.executable, *launcher, *worker], cwd=REPO, env=_env(nproc, threads, timing),
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"measurement ({mode}, {nproc} processes) failed:\n{proc.stderr[-4000:]}")
        return _read_rows(tmp, nproc)


def measure_forked(cases: list[dict], timeout: float = 3600.0) -> list[list[dict]]:
    """Several measurements (each a dict of measure's keyword arguments, `overrides` and `mode`
    included; no --full-step), one after another, each in `nproc` children forked from one fresh
    interpreter (`--serve`) that was started with MALLOC_MMAP_THRESHOLD_ and has imported torch and
    the modules a worker uses, and nothing else: a child starts from the heap a fresh worker has
    after its imports, and spends no time importing them again. Several children of a case join
    over gloo as ranks 0..nproc-1 (RANK, WORLD_SIZE, MASTER_ADDR/PORT of a store the server holds;
    one thread each), as torchrun's workers do in measure. A child measures as a fresh worker does (its
    warm-up step, then the peak over the RSS before the steps), so measured_activation_bytes reads
    the same (tests/cost/test_memory_model.py's docstring has both methods' ratios);
    measured_peak_bytes counts from the child's RSS at its start, which is lower than a fresh
    worker's after import (a forked child maps the server's shared libraries' pages again as it
    touches them)."""
    with tempfile.TemporaryDirectory() as tmp:
        jobs, sizes = [], []
        for i, case in enumerate(cases):
            case = dict(case)
            sizes.append(case.pop("nproc", 1))
            if case.get("full"):
                raise ValueError(f"measure_forked runs measurements without --full-step, not {case}")
            os.makedirs(os.path.join(tmp, str(i)))
            jobs.append([sizes[-1], _worker_argv(os.path.join(tmp, str(i)), **case)])
        with open(os.path.join(tmp, "cases.json"), "w") as f:
            json.dump(jobs, f)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--serve", os.path.join(tmp, "cases.json")],
                              cwd=REPO, env=_env(1, 0, False), capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"forked measurements failed:\n{proc.stderr[-4000:]}")
        return [_read_rows(os.path.join(tmp, str(i)), n) for i, n in enumerate(sizes)]


def serve(cases_path: str, parser: argparse.ArgumentParser) -> None:
    """`--serve CASES.json`: import what a worker uses, then, for each [nproc, worker argv] of the
    list in the file, one case at a time, fork its nproc children (measure_forked)."""
    import torch
    import torch._dynamo  # noqa: F401 - imported by a worker's first tensor init under a device context

    import megatron_taper.parallel.pp.schedule  # noqa: F401
    import megatron_taper.training.build  # noqa: F401

    with open(cases_path) as f:
        jobs = json.load(f)
    for nproc, argv in jobs:
        # the children's rendezvous store, on a port it bound itself (no race for a free port); the
        # ranks join it as torchrun's workers join their agent's
        store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        ranks = {"WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                 "TORCHELASTIC_USE_AGENT_STORE": "True"}
        children = []
        for rank in range(nproc):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    if nproc > 1:
                        os.environ.update(ranks, RANK=str(rank), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
                        torch.set_num_threads(1)
                    worker(parser.parse_args(argv))
                    code = 0
                except BaseException:
                    import traceback

                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            children.append(pid)
        statuses = [os.waitpid(pid, 0)[1] for pid in children]
        if any(statuses):
            sys.exit(f"worker {argv} ({nproc} processes) exited with statuses {statuses}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="none,selective,full")
    parser.add_argument("--loss-chunks", default="0", help="train.loss_chunk values, each with every mode")
    parser.add_argument("--steps", type=int, default=1, help="measured forward+backward passes per mode")
    parser.add_argument("--nproc", type=int, default=1, help="processes (tp x dp, gloo on CPU)")
    parser.add_argument("--stage", default="", choices=("", "first", "last"), help="measure one pipeline stage")
    parser.add_argument("--stage-layers", type=int, default=1)
    parser.add_argument("--in-flight", type=int, default=1)
    parser.add_argument("--full-step", action="store_true",
                        help="whole training steps (optimizer included) against the predicted peak with AdamW state")
    parser.add_argument("--meter", default="rss", choices=("rss", "tensors"),
                        help="CPU: host RSS (default) or the live tensors' bytes (TensorMeter); not with --full-step")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--loss-chunk", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, parser)
        return
    if args.full_step and args.meter != "rss":
        parser.error(f"--meter {args.meter} measures tensors made in a region, not --full-step's whole step: use rss")
    if args.worker:
        worker(args)
        return
    results = []
    for chunk in (int(c) for c in args.loss_chunks.split(",")):
        for mode in args.modes.split(","):
            results += measure(args.overrides, mode, args.nproc, args.steps, args.stage, args.stage_layers,
                               args.in_flight, full=args.full_step, loss_chunk=chunk, meter=args.meter)
    print(json.dumps({"config": DEFAULT + args.overrides, "steps": args.steps, "results": results}, indent=1))


if __name__ == "__main__":
    main()
