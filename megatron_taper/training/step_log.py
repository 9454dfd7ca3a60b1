"""StepLog: what a run reports as it trains, through its MetricsLogger (training/metrics.py) and
the main rank's console: the start-up summary, the step records (loss, lr, grad norm, tokens/s,
step time, MFU, peak memory of the fullest rank, straggler statistics, ETA) and the evaluation
records. Step records are read from the device here, at log intervals only.
"""
from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from megatron_taper.console import format_duration, peak_memory, summary_lines
from megatron_taper.cost.flops import mfu, model_costs, peak_flops
from megatron_taper.training.metrics import MetricsLogger, perplexity, timestamp

if TYPE_CHECKING:
    from megatron_taper.config import Config
    from megatron_taper.fault.straggler import StragglerWatch
    from megatron_taper.parallel.context import ParallelContext
    from megatron_taper.parallel.model import ParallelModel


class StepLog:
    def __init__(self, cfg: Config, ctx: ParallelContext, metrics: MetricsLogger, stragglers: StragglerWatch,
                 bf16: bool):
        self.cfg, self.ctx, self.metrics, self.stragglers = cfg, ctx, metrics, stragglers
        self.flops_at_length: dict[int, float] = {}  # window length -> model FLOPs per token (flops_per_token)
        self.peak = peak_flops(ctx.device, bf16, cfg.train.peak_tflops)
        self.tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
        self.started = self.last_time = time.perf_counter()
        self.last_step = 0

    def say(self, text: str) -> None:
        """One console line, on the main rank."""
        if self.ctx.is_main:
            print(f"{timestamp()} {text}", flush=True)

    def summary(self, pm: ParallelModel, train_source: Any, has_eval: bool, bf16: bool,
                attention_line: Callable[[], str | None] = lambda: None) -> None:
        """The start-up summary (main rank), with `attention_line()`'s line (SDPA's kernel) when it has one."""
        if self.ctx.is_main:
            summary = summary_lines(self.cfg, self.ctx, pm, train_source, has_eval, bf16, self.peak)
            summary += [line for line in (attention_line(),) if line]
            if self.metrics.wandb_dir:
                summary.append(f"wandb ({self.cfg.run.wandb.mode}): {self.metrics.wandb_dir}")
            print(f"{timestamp()} megatron_taper run\n" + "\n".join("  " + line for line in summary), flush=True)

    def start(self, step: int) -> None:
        """The clock of step times and ETA starts (fit's start, at `step`)."""
        self.started = self.last_time = time.perf_counter()
        self.last_step = step

    def step(self, record: dict, step: int, tokens_seen: int, skipped: int, steps_here: int) -> None:
        """The record of `step` (tensors read here), with the mean step time since the last record
        and the ETA from this process's mean step time so far (evaluations and saves included)."""
        now = time.perf_counter()
        steps = max(step - self.last_step, 1)
        step_time = (now - self.last_time) / steps
        self.last_time, self.last_step = now, step
        eta = (self.cfg.train.steps - step) * (now - self.started) / steps_here
        record = {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in record.items()}  # the host read
        tokens_per_s = self.tokens_per_step / max(step_time, 1e-9)
        memory_gb, memory_kind = peak_memory(self.ctx.device)
        memory_gb = self._max_over_ranks(memory_gb)
        full = {"step": step, **record, "tokens_per_s": tokens_per_s,
                "tokens_seen": tokens_seen, "skipped_steps": skipped,
                "step_time_s": step_time, "peak_memory_gb": memory_gb}
        straggler, warning = self.stragglers.report(step_time)
        full.update(straggler)
        util = mfu(tokens_per_s / self.ctx.world_size, self.flops_per_token(step - steps, step), self.peak)
        if util is not None:
            full["mfu"] = util
        line = (f"step {step:>6}/{self.cfg.train.steps} | loss {record['loss']:.4f} | lr {record['lr']:.3e} | "
                f"grad_norm {record['grad_norm']:.3f} | {step_time:.3f} s/step | {tokens_per_s:,.0f} tok/s"
                + (f" | mfu {util:.1%}" if util is not None else "")
                + f" | mem {memory_gb:.2f} GiB {memory_kind} | eta {format_duration(eta)}")
        self.metrics.log(full, line)
        if warning:
            self.say(warning)

    def flops_per_token(self, first: int, end: int) -> float:
        """Model forward FLOPs per token over the steps after `first` .. `end` completed ones, at each
        step's window length (train.seq_len_warmup_steps: shorter windows, less attention work)."""
        m, t = self.cfg.model, self.cfg.train
        total = 0.0
        for step in range(first, end):
            length = t.seq_len_at(step, m.seq_len)
            if length not in self.flops_at_length:
                self.flops_at_length[length] = model_costs(dataclasses.replace(m, seq_len=length)).total_flops
            total += self.flops_at_length[length]
        return total / max(end - first, 1)

    def eval(self, step: int, losses: dict[str, float] | None) -> None:
        """The held-out record: "" the loss, the other keys the sources' losses (data.mix)."""
        if losses is None:
            return
        eval_loss = losses.pop("")
        ppl = perplexity(eval_loss)
        self.metrics.log({"step": step, "eval_loss": eval_loss, "eval_ppl": ppl,
                          **{f"eval_loss/{name}": loss for name, loss in losses.items()}},
                         f"eval  {step:>6} | loss {eval_loss:.4f} | ppl {ppl:.2f}"
                         + "".join(f" | {name} {loss:.4f}" for name, loss in losses.items()))

    def _max_over_ranks(self, value: float) -> float:
        """The largest `value` of all ranks (the peak memory of the fullest rank)."""
        if self.ctx.mesh is None:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self.ctx.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return float(tensor.item())
