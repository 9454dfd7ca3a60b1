"""The Trainer: one training run on this process's share of the mesh (megatron_taper.train is its
command line).

One step = global_batch sequences: each data-parallel rank runs global_batch / (dp x micro_batch)
micro-batches through `ParallelModel.forward_backward`, gradients are reduced and clipped, and
AdamW steps. `run` builds and fits a run from a recipe and overrides and maps errors to exit codes:
0 done (or stopped by train.exit_after), 1 failed, 2 bad input, 3 stopped by SIGUSR1, SIGTERM or
SIGINT after a checkpoint (training/stop.py; the slurm script requeues the job on 3), 4 a hang
detected by the watchdog (megatron_taper/fault/watchdog.py; launch/torchrun.sh restarts the workers
from the last checkpoint). A second Ctrl-C ends the process at once (killed by SIGINT, without a
checkpoint).
"""
from __future__ import annotations

import contextlib
import os
import shutil
from typing import TYPE_CHECKING

import torch

from megatron_taper.config import Config, ConfigError, load_config, save_config
from megatron_taper.console import report_error
from megatron_taper.cost.preflight import Layout, preflight
from megatron_taper.data.checks import check_data
from megatron_taper.data.prefetch import Prefetcher
from megatron_taper.data.sources import build_sources
from megatron_taper.fault.guard import FaultGuard
from megatron_taper.fault.health import NonFiniteLossError
from megatron_taper.fault.recovery import Recovery
from megatron_taper.fault.straggler import StragglerWatch
from megatron_taper.launch_check import check_run_dir
from megatron_taper.models import family
from megatron_taper.parallel.context import ParallelContext, init_parallel, shutdown, world_size
from megatron_taper.training.build import attention_kernel_line, build_run
from megatron_taper.training.carried import CarriedRows
from megatron_taper.training.checkpointing import Checkpointing
from megatron_taper.training.experts import ExpertRouting
from megatron_taper.training.held_out import dp_mean, held_out_losses
from megatron_taper.training.metrics import MetricsLogger
from megatron_taper.training.optim import lr_at
from megatron_taper.training.run_folder import NotARunFolder, check_run_folder, lock_run_folder
from megatron_taper.training.run_lock import RunLock
from megatron_taper.training.state import TrainState
from megatron_taper.training.step_log import StepLog
from megatron_taper.training.stop import EXIT_REQUEUE, Stop, StopSignal, StopVote

if TYPE_CHECKING:
    from megatron_taper.checkpoint.checkpointer import Checkpointer
    from megatron_taper.data import BatchSource
    from megatron_taper.data.sources import HeldOut
    from megatron_taper.parallel.model import ParallelModel

EXIT_BAD_INPUT = 2


class Trainer:
    """One run on this process's share of the mesh: `fit` is the loop, over these parts."""

    cfg: Config
    ctx: ParallelContext
    pm: ParallelModel  # the model, parallelised: forward_backward, optimizer_step, evaluate
    optimizer: torch.optim.Optimizer
    state: TrainState  # step, tokens seen, batches drawn: the loop's own part of a checkpoint
    train_source: BatchSource  # this data-parallel rank's batches, drawn ahead by `prefetch`
    prefetch: Prefetcher | None
    carry: CarriedRows | None  # a family's state carried along each row's windows
    experts: ExpertRouting | None  # a mixture of experts' routing biases and load records
    held_out: list[HeldOut]
    recovery: Recovery  # non-finite steps, spikes, rollback, skipped data windows (fault/recovery.py)
    checkpointing: Checkpointing  # when to save, async completion, resume / init_from
    log: StepLog  # step and eval records (metrics.jsonl, tensorboard, wandb) and console lines
    stragglers: StragglerWatch
    guard: FaultGuard  # watchdog sections and injected faults
    stop_vote: StopVote  # a stop signal (and a background save's completion), agreed every step
    run_lock: RunLock | None  # the main rank's, while this Trainer lives

    def __init__(self, cfg: Config, ctx: ParallelContext | None = None, stop: StopSignal | None = None,
                 guard: FaultGuard | None = None, layout: Layout | None = None):
        """`layout`: preflight's result when the caller ran it (run() does, before joining)."""
        self.cfg, m, t = cfg, cfg.model, cfg.train
        self.guard = guard or FaultGuard()
        run = build_run(cfg, ctx, layout)
        self.ctx, self.pm, self.optimizer, self.bf16 = run.ctx, run.model, run.optimizer, run.bf16
        self.accum = run.layout.accumulation
        self.experts = ExpertRouting(m.moe, self.ctx, self.pm.module) if m.moe.enabled else None
        carried = family(m.arch).carried_state
        self.carry = (CarriedRows(carried, self.pm.module, self.accum, self.ctx.dp, self.ctx.dp_rank, self.ctx.device)
                      if carried is not None and carried.enabled(m) else None)
        self.row_streams = cfg.data.row_streams or self.carry is not None  # batches: (tokens, continues)
        self.train_source, self.held_out = build_sources(
            cfg.data, seq_len=m.seq_len, micro_batch=t.micro_batch, seed=t.seed, vocab_size=m.vocab_size,
            dp_rank=self.ctx.dp_rank, dp_size=self.ctx.dp, rows=t.global_batch if self.row_streams else 0)
        self.prefetch = None
        self.data_state: dict | None = None  # the source's state after the last consumed step
        self.state = TrainState()
        self.stop = stop or StopSignal()
        self.run_lock = lock_run_folder(self.ctx, cfg.run.dir)  # before anything is written there
        self.metrics = MetricsLogger(cfg.run.dir, self.ctx.is_main, cfg.run.tensorboard, cfg.run.wandb,
                                     cfg.to_dict())
        self.stragglers = StragglerWatch(cfg.fault.straggler_factor, self.ctx)
        self.log = StepLog(cfg, self.ctx, self.metrics, self.stragglers, self.bf16)
        self.recovery = Recovery(cfg, self.ctx, self.log.say)
        self.checkpointing = Checkpointing(cfg, self.pm, self.guard.before_write, self.log.say)
        self.stop_vote = StopVote(self.ctx, self.stop, self.checkpointer)
        self.log.summary(self.pm, self.train_source, bool(self.held_out), self.bf16,
                         lambda: attention_kernel_line(run))
        self.checkpointing.resume(self.optimizer, self.metrics, self.row_streams, self._restore)
        if self.ctx.is_main:  # only now: a refused resume leaves the run's config.yaml as it was
            save_config(cfg, os.path.join(cfg.run.dir, "config.yaml"))
        self.ctx.barrier()

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def checkpointer(self) -> Checkpointer:
        return self.checkpointing.checkpointer

    @property
    def skipped(self) -> int:
        return self.recovery.skipped

    def fit(self) -> int:
        """Train to train.steps; stop early, with a checkpoint, on a signal (EXIT_REQUEUE) or after
        train.exit_after steps (0). The exit code."""
        t = self.cfg.train
        installed_here = self.stop.install()  # run() installs them earlier, for start-up
        steps_here = 0
        self.log.start(self.step)
        try:
            while self.step < t.steps:
                self.stragglers.begin()
                self.guard.step_begins(self.step + 1)
                record = self.train_step()
                self.guard.step_done(self.step)
                steps_here += 1
                # a signal, and a background save every rank has written: agreed at every step boundary
                stop = self.stop_vote.at_step_end(self.step) if self.step < t.steps else None
                self.checkpointing.report_saved()
                at_log = self.step % t.log_interval == 0 or self.step == t.steps
                at_save = self.checkpointing.due(self.step)
                at_exit = bool(t.exit_after) and steps_here >= t.exit_after
                rolled_back = bool(at_log or at_save or at_exit or stop) and self.recovery.roll_back_if_due(
                    self.checkpointer, self._roll_back_to)
                if rolled_back and not stop:
                    continue  # rolled back to an earlier checkpoint
                if at_log and not rolled_back:
                    self.recovery.check_health()  # a host read: names skipped steps, stops a non-finite streak
                    record.update(self.experts.record() if self.experts is not None else {})
                    self.log.step(record, self.step, self.state.tokens_seen, self.skipped, steps_here)
                if stop:
                    return self._stop_with_checkpoint(stop)
                if t.eval_interval and self.step % t.eval_interval == 0 and self.step < t.steps:
                    self._evaluate_and_log()
                if self.step == t.steps:
                    break
                if at_save:
                    self.save()
                if at_exit:
                    self.save(final=True)
                    self.log.say(f"train.exit_after={t.exit_after}: stopped at step {self.step} with a checkpoint")
                    return 0
            self._evaluate_and_log()
            self.save(final=True)
            return 0
        finally:
            self.close()
            if installed_here:
                self.stop.uninstall()

    def train_step(self) -> dict:
        """One step. Loss and grad norm stay on the device (no host sync): the record holds tensors,
        read at log intervals (StepLog), as are the recovery policy's counters."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, self.cfg.train)
        micro_batches, data_metrics = self._next_batches()
        t = self.cfg.train
        seq_len = t.seq_len_at(self.step, self.cfg.model.seq_len)  # windows cut to it (train.seq_len_warmup_steps)
        losses = self.pm.forward_backward(micro_batches, self.autocast, self.carry, seq_len)
        loss = dp_mean(self.ctx, self.guard.loss(losses, self.step + 1))
        # reduce, clip and step (or skip a non-finite step, on the device); the engine owns how
        grad_norm, stepped = self.pm.optimizer_step(self.optimizer, t.grad_clip, torch.isfinite(loss))
        if self.experts is not None:
            self.experts.after_step(stepped)
        self.state.advance(t.global_batch * self.cfg.model.seq_len)
        self.recovery.update(loss, stepped, self.step, self.state.batches)
        warmup = {"seq_len": seq_len} if t.seq_len_warmup_steps else {}
        return {"loss": loss, "grad_norm": grad_norm, "lr": self.optimizer.param_groups[0]["lr"], **warmup,
                **data_metrics}

    def _next_batches(self) -> tuple[list, dict]:
        """The step's micro-batches (tokens) and the source's metrics; the batches of a window a
        rollback skipped are drawn and dropped."""
        if self.prefetch is None:
            self.prefetch = Prefetcher(self.train_source, self.accum, pin=self.ctx.device.type == "cuda")
        while True:
            micro_batches, self.data_state, data_metrics = self.prefetch.next()
            self.state.batches += 1
            if not self.recovery.skips_batch(self.state.batches):
                break
        self.stragglers.ready()
        if self.carry is not None:
            micro_batches = self.carry.split(micro_batches)
        elif self.row_streams:
            micro_batches = [tokens for tokens, _ in micro_batches]
        return micro_batches, data_metrics

    def autocast(self):
        if self.bf16:
            return torch.autocast(self.ctx.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def evaluate(self) -> dict[str, float] | None:
        """Held-out losses (training/held_out.py held_out_losses); None without held-out data."""
        return held_out_losses(self.pm, self.held_out, self.cfg.train.eval_batches, self.autocast)

    def _evaluate_and_log(self) -> None:
        with self.guard.section("eval", self.step):
            losses = self.evaluate()
        self.log.eval(self.step, losses)

    def save(self, final: bool = False) -> None:
        """Checkpoint the current step; `final`: also wait until it (and any background save) is
        complete, before the process exits."""
        self.recovery.check_health()  # never a checkpoint after train.max_nonfinite non-finite steps in a row
        if not final and self.recovery.holds_save(self.step):
            return
        with self.guard.section("save", self.step):
            self.checkpointing.save(self.step, self.optimizer, self._checkpoint_states, final)
        self.checkpointing.report_saved()

    def _checkpoint_states(self) -> tuple[dict, dict]:
        """(trainer state, this rank's data state) as a checkpoint holds them."""
        data = self.data_state if self.data_state is not None else self.train_source.state_dict()
        if self.carry is not None:  # this rank's rows' states, with the data position they belong to
            data = {**data, "carried": self.carry.state_dict()}
        return {**self.state.state_dict(), **self.recovery.state_dict()}, data

    def _restore(self, state: dict) -> None:
        """Continue from a loaded checkpoint's trainer state (a resume's or a rollback's)."""
        self.state.load_state_dict(state, self.cfg.model.seq_len)
        self.recovery.load_state_dict(state)
        self.checkpointing.last_saved = self.step
        if self.prefetch is not None:  # it has drawn ahead of the restored position
            self.prefetch.close()
            self.prefetch = None
        data = dict(state["data"])
        carried = data.pop("carried", None)
        if self.carry is not None:
            self.carry.load_state_dict(carried)
        self.train_source.load_state_dict(data)
        self.metrics.truncate_after(self.step)

    def _roll_back_to(self, candidates: list[str]) -> tuple[str, int]:
        path, state = self.checkpointing.load(candidates, self.optimizer)
        self._restore(state)
        return path, self.step

    def _stop_with_checkpoint(self, stop: Stop) -> int:
        self.save(final=True)
        self.log.say(f"stopped by {stop.name} at step {self.step} (the signal was first seen at the end of step "
                     f"{stop.seen_at}); checkpoint written; exit {EXIT_REQUEUE}: the same command resumes")
        return EXIT_REQUEUE

    def close(self) -> None:
        """Stop the prefetch thread, close the metrics writers, release the run folder's lock."""
        if self.prefetch is not None:
            self.prefetch.close()
        self.metrics.close()
        if self.run_lock is not None:
            self.run_lock.release()


def run(recipe: str | None, overrides: list[str]) -> int:
    """Train the run of `recipe` + `overrides` on this process (torchrun: on every rank); the exit code."""
    ctx = None
    cfg = None
    created_run_dir = None
    clean = False
    # installed before any setup and kept until exit, so a signal during start-up or the final
    # barrier is recorded instead of killing the process (the default action of SIGUSR1)
    stop = StopSignal()
    stop.install()
    guard = None
    try:
        cfg = load_config(recipe, overrides)
        if not os.path.exists(cfg.run.dir):
            created_run_dir = cfg.run.dir
        # layout=auto: every rank chooses from its own device memory, deterministically, so ranks of
        # alike nodes choose alike; init_parallel stops every rank if some chose otherwise
        chosen = ""
        if cfg.parallel.layout == "auto":
            from megatron_taper.cost.auto_layout import choose_layout
            from megatron_taper.cost.plan import layout_of

            cfg, why = choose_layout(cfg, world_size())
            chosen = layout_of(cfg)
            if int(os.environ.get("RANK", "0")) == 0:
                print(why, flush=True)
        layout = preflight(cfg, world_size())  # before joining: a bad layout fails alike on every rank, at once
        check_data(cfg, warn=int(os.environ.get("RANK", "0")) == 0)
        check_run_folder(cfg.run.dir)  # before the watchdog writes RUN/logs
        check_run_dir(cfg.run.dir)  # writable (also in the launch check, for runs started without it)
        guard = FaultGuard.start(cfg.fault, cfg.run.dir, int(os.environ.get("RANK", "0")), world_size())
        ctx = init_parallel(cfg.parallel, cfg.train.device, chosen_layout=chosen)
        trainer = Trainer(cfg, ctx, stop, guard, layout)
        created_run_dir = None
        code = trainer.fit()
        guard.enter("finish", trainer.step)
        clean = True
        return code
    except Exception as e:  # noqa: BLE001 - reported once (main rank) and logged per rank below
        expected = isinstance(e, (ConfigError, ValueError, NonFiniteLossError))
        code = EXIT_BAD_INPUT if expected and not isinstance(e, NonFiniteLossError) else 1
        alone = guard is not None and world_size() > 1  # the error may be this rank's only: the others are told
        if guard is not None:  # before a fresh run folder is removed below
            if code == EXIT_BAD_INPUT:
                guard.report_end(code, str(e).splitlines()[0] if str(e) else type(e).__name__)
            guard.stop()
        rank = ctx.rank if ctx is not None else int(os.environ.get("RANK", "0"))
        log_dir = cfg.run.dir if cfg is not None and not isinstance(e, NotARunFolder) else None
        if expected and created_run_dir and not alone:  # a fresh run folder that never started training goes again
            log_dir = None
            if os.path.isdir(created_run_dir) and (ctx is None or ctx.is_main):
                shutil.rmtree(created_run_dir, ignore_errors=True)
        report_error(e, rank, log_dir, expected)
        return code
    finally:
        if ctx is not None:
            with contextlib.suppress(Exception):
                shutdown(ctx, barrier=clean)
        if guard is not None:
            guard.stop()
        stop.uninstall()
