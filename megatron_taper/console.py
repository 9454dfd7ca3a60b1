"""What the main rank prints: the start-up summary, the measured parts of a step line (step time,
ETA, peak memory), and how a failed run reports its error.

Errors: the main rank prints one line (`error: ...`); every rank writes its error with the full
traceback to RUN/logs/rank-N.log when the run folder exists, after a header line naming the time
and torchrun's restart count; MEGATRON_TAPER_DEBUG=1 prints the full traceback on the main rank's
console as well. After an in-job restart the main rank says so in one line (`restart_line`), with
the first error the previous attempt recorded (those headers, or RUN/logs/ended.json of a hang).
"""
from __future__ import annotations

import glob
import json
import os
import resource
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any

from megatron_taper.cost.flops import device_name, model_costs
from megatron_taper.cost.preflight import step_split
from megatron_taper.fault.watchdog import ENDED_FILE, EXIT_HANG
from megatron_taper.taper import expert_width, layer_widths

if TYPE_CHECKING:
    import torch

    from megatron_taper.config import Config
    from megatron_taper.parallel.context import ParallelContext
    from megatron_taper.parallel.model import ParallelModel

DEBUG_ENV = "MEGATRON_TAPER_DEBUG"
MAX_ERROR_CHARS = 160  # of an error message in the restart line
LOST_PEER = ("connection reset", "connection closed", "broken pipe")  # a collective's error when a peer died
ERROR_HEADER = "== error at "  # then: unix time, local time, run R, restart N, rank R: the error's first line


def summary_lines(cfg: Config, ctx: ParallelContext, pm: ParallelModel, train_source: Any, has_eval: bool,
                  bf16: bool, peak_flops: float | None) -> list[str]:
    """The start-up summary: model, tapered widths, layout, pipeline plan, data, run folder, device."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    costs = model_costs(m)
    taper = m.taper
    lines = [
        f"model: {m.arch}, {m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads"
        + (f" ({m.kv_heads} kv)" if m.kv_heads != m.n_heads else "")
        + f", vocab {m.vocab_size}, seq_len {m.seq_len}: {_count(costs.total_params)} parameters, "
        f"{_count(costs.total_flops)} forward FLOPs per token",
        f"mlp widths ({taper.schedule}, start {taper.start:g}, uniform {m.mlp_width}): "
        + " ".join(str(w) for w in layer_widths(m))
        + (f" (from layer {m.moe.first_dense} on: {m.moe.experts} experts of that width each, top-{m.moe.top_k}, "
           f"uniform {expert_width(m)}"
           + (f", shared expert {m.moe.shared_width}" if m.moe.shared_width else "") + ")" if m.moe.enabled else ""),
        f"layout: {ctx.world_size} process(es) = pp {ctx.pp} x dp {ctx.dp} x "
        + (f"cp {ctx.cp} x " if ctx.cp > 1 else "") + f"tp {ctx.tp}, zero {p.zero}"
        + (f" (HSDP: dp_replicate {ctx.dp_replicate} x dp_shard {ctx.dp_shard})" if ctx.dp_replicate > 1 else "")
        + "; "
        f"global_batch {t.global_batch} = dp {ctx.dp} x micro_batch {t.micro_batch} x "
        f"{t.global_batch // (ctx.dp * t.micro_batch)} accumulation"
        + ("; pipeline: {1} micro-batches of {0} sequences".format(*step_split(p, t, ctx.dp)) if ctx.pp > 1 else ""),
    ]
    plan = getattr(pm, "plan", None)  # PipelineParallelModel (pp > 1)
    if plan is not None:
        stages = " | ".join(f"stage {c} (pp rank {stage.rank}): layers {_span(stage.layers)}"
                            for c, stage in enumerate(plan.stages))
        lines.append(f"pipeline ({p.pp_schedule}, balance {p.pp_balance}): {stages}")
    held_out = f"held-out: {'yes' if has_eval else 'none'}"
    if getattr(pm, "document_end", None) is not None:  # data.document_mask
        held_out += f"; attention inside documents (ended by token {pm.document_end})"
    parts = getattr(train_source, "sources", None)  # data.mix: MixtureSource
    if parts is None:
        lines.append(f"data: {describe_source(train_source)}; {held_out}")
    else:
        lines.append(f"data: a mixture of {len(parts)} sources; {held_out}")
        lines += [f"  {name} (weight {weight:g}): {describe_source(part)}"
                  for name, weight, part in zip(train_source.names, train_source.configured_weights, parts)]
    if not has_eval and t.eval_interval > 0:
        lines.append(f"warning: train.eval_interval={t.eval_interval} asks for evaluation, but the data has no "
                     f"held-out split, so none will run (MDS: write val/ with tools/preprocess_data.py "
                     f"--val-fraction F; a .npy file: data.eval_fraction > 0)")
    lines.append(f"run dir: {os.path.abspath(cfg.run.dir)}")
    dtype = "bf16 autocast" if bf16 else "fp32"
    name = f" ({device_name(ctx.device)})" if ctx.device.type == "cuda" else ""
    lines.append(f"device: {ctx.device}{name}, {dtype}; steps {t.steps}")
    if t.seq_len_warmup_steps:
        lengths = t.seq_len_lengths(m.seq_len)
        lines.append(f"seq_len warmup: windows of {', '.join(map(str, lengths))} tokens over the first "
                     f"{t.seq_len_warmup_steps} steps (train.seq_len_warmup_steps), the same tokens per step")
    if peak_flops is None:
        lines.append(f"mfu: not reported: no peak FLOP/s known for {device_name(ctx.device)} "
                     f"(set train.peak_tflops=N, the device's dense peak in TFLOP/s)")
    else:
        lines.append(f"mfu: against a peak of {peak_flops / 1e12:,.1f} TFLOP/s per device"
                     + (" (train.peak_tflops)" if t.peak_tflops > 0 else ""))
    return lines


def describe_source(source: Any) -> str:
    """Where one training source reads and how large it is (documents, tokens, samples)."""
    if hasattr(source, "num_tokens"):  # StreamingSource
        return (f"{source.reader.where}: {source.num_documents:,} documents, {source.num_tokens:,} tokens, "
                f"{source.samples_per_epoch:,} samples per epoch")
    if hasattr(source, "count"):  # TokenFileSource
        return f"token file: {source.count:,} samples of {source.sample_len} tokens"
    return type(source).__name__


def peak_memory(device: torch.device) -> tuple[float, str]:
    """(GiB, what was measured): CUDA's peak allocated memory on this process's device, or the
    process's peak resident set size on the host (CPU runs)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device) / 2**30, "gpu"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20), "host rss"


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours < 24 else f"{hours // 24}d{hours % 24:02d}:{minutes:02d}"


def report_error(error: BaseException, rank: int, run_dir: str | None, expected: bool) -> None:
    """Rank 0: one line on stderr (the full traceback with MEGATRON_TAPER_DEBUG=1); every rank:
    the error with its traceback in RUN/logs/rank-N.log, when `run_dir` is given and exists.
    `expected`: a user error (bad config, bad data), whose message says all."""
    trace = "".join(traceback.format_exception(error))
    log = None
    if run_dir and os.path.isdir(run_dir):
        log = os.path.join(run_dir, "logs", f"rank-{rank}.log")
        os.makedirs(os.path.dirname(log), exist_ok=True)
        first = f"{type(error).__name__}: {error}".splitlines()[0] if str(error) else type(error).__name__
        attempt = _attempt()
        with open(log, "a") as f:
            f.write(f"{ERROR_HEADER}{time.time():.3f} ({time.strftime('%Y-%m-%d %H:%M:%S')}), {attempt}, "
                    f"rank {rank}: {first}\n{trace}")
    if rank != 0:
        return
    if os.environ.get(DEBUG_ENV):
        sys.stderr.write(trace)
    message = str(error) if expected else f"{type(error).__name__}: {error}"
    hint = ""
    if not expected and not os.environ.get(DEBUG_ENV):
        hint = f" (traceback in {log}; other ranks' next to it)" if log else f" (traceback: {DEBUG_ENV}=1)"
    print(f"error: {message}{hint}", file=sys.stderr, flush=True)


def restart_line(restart: int, run_dir: str, resumed: str, since: float = 0.0) -> str:
    """The console line of torchrun's in-job restart `restart` (> 0): what ended the previous
    attempt, as far as RUN/logs recorded it after time `since` (when the checkpoint resumed from
    was written), and `resumed` (where training goes on)."""
    return (f"restart {restart} of this job (torchrun --max-restarts; the previous attempt ended "
            f"{previous_attempt_end(os.path.join(run_dir, 'logs'), _attempt(restart - 1), since)}): {resumed}")


def _attempt(restart: int | None = None) -> str:
    """torchrun's run id and restart count (this process's, or `restart`), as the logs name them."""
    if restart is None:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return f"run {os.environ.get('TORCHELASTIC_RUN_ID', '-')}, restart {restart}"


def previous_attempt_end(log_dir: str, attempt: str, since: float = 0.0) -> str:
    """How `attempt` (`_attempt`'s words) ended, from records written after `since`: a hang a
    watchdog reported (RUN/logs/ended.json), else the first error a rank logged, else unknown."""
    try:
        with open(os.path.join(log_dir, ENDED_FILE)) as f:
            hang = json.load(f)
        if _attempt_of(hang) == attempt and hang.get("time", 0) >= since and hang.get("code", EXIT_HANG) == EXIT_HANG:
            return f"on a hang reported by rank {hang.get('rank')} (stacks in {log_dir}/stacks-rank*.txt)"
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    errors = []
    for path in glob.glob(os.path.join(log_dir, "rank-*.log")):
        try:
            with open(path, errors="replace") as f:
                for line in f:
                    if line.startswith(ERROR_HEADER):
                        when, _, rest = line[len(ERROR_HEADER):].partition(" ")
                        where, _, what = rest.partition("), ")[2].partition(": ")
                        if where.startswith(f"{attempt}, ") and float(when) >= since:
                            errors.append((float(when), where.removeprefix(f"{attempt}, "), what.strip(), path))
        except (OSError, ValueError):
            continue
    if not errors:
        return ("without a recorded error: a worker was killed or died outside Python (SIGKILL, out of memory, "
                "a lost node); see the launcher's output")
    _, rank, what, path = min(errors)
    lost = any(words in what.lower() for words in LOST_PEER)
    what = what if len(what) <= MAX_ERROR_CHARS else what[:MAX_ERROR_CHARS] + "..."
    return (f"after an error on {rank}: {what} ("
            + ("a lost connection: another rank may have died first, without an error; " if lost else "")
            + f"traceback in {path})")


def _attempt_of(hang: dict) -> str:
    return f"run {hang.get('run_id') or '-'}, restart {int(hang.get('restart', 0))}"


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:g}"


def _span(layers: list[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0]) if layers else "none"
