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
import time

import torch
import torch.distributed as dist

from megatron_taper.checkpoint.checkpointer import (
    Checkpointer,
    broadcast_from_main,
    checkpoint_root,
    list_checkpoints,
    load_weights_only,
    resume_candidates,
)
from megatron_taper.config import Config, ConfigError, load_config, save_config
from megatron_taper.console import format_duration, peak_memory, report_error, restart_line, summary_lines
from megatron_taper.cost.flops import mfu, model_costs, peak_flops
from megatron_taper.cost.preflight import Layout, preflight
from megatron_taper.data.checks import check_data
from megatron_taper.data.prefetch import Prefetcher
from megatron_taper.data.sources import build_sources
from megatron_taper.fault.guard import FaultGuard
from megatron_taper.fault.rollback import BadSteps, DataSkips
from megatron_taper.fault.straggler import StragglerWatch
from megatron_taper.launch_check import check_run_dir
from megatron_taper.models import family
from megatron_taper.parallel.context import ParallelContext, init_parallel, shutdown, world_size
from megatron_taper.training.build import build_run
from megatron_taper.training.carried import CarriedRows
from megatron_taper.training.health import NonFiniteLossError, StepHealth
from megatron_taper.training.held_out import combined_loss, evaluate_held_out
from megatron_taper.training.metrics import MetricsLogger, perplexity, timestamp
from megatron_taper.training.optim import lr_at
from megatron_taper.training.run_folder import NotARunFolder, check_run_folder, resume_changes
from megatron_taper.training.run_lock import RunLock
from megatron_taper.training.stop import EXIT_REQUEUE, Stop, StopSignal, StopVote

EXIT_BAD_INPUT = 2


class Trainer:
    def __init__(self, cfg: Config, ctx: ParallelContext | None = None, stop: StopSignal | None = None,
                 guard: FaultGuard | None = None, layout: Layout | None = None):
        """`layout`: preflight's result when the caller ran it (run() does, before joining)."""
        self.cfg = cfg
        self.guard = guard or FaultGuard()
        run = build_run(cfg, ctx, layout)
        self.ctx, self.pm, self.optimizer, self.bf16 = run.ctx, run.model, run.optimizer, run.bf16
        self.accum = run.layout.accumulation
        m, t = cfg.model, cfg.train
        carried = family(m.arch).carried_state
        self.carry = (CarriedRows(carried, self.pm.module, self.accum, self.ctx.dp, self.ctx.dp_rank, self.ctx.device)
                      if carried is not None and carried.enabled(m) else None)
        self.row_streams = cfg.data.row_streams or self.carry is not None  # batches: (tokens, continues)
        self.train_source, self.held_out = build_sources(
            cfg.data, seq_len=m.seq_len, micro_batch=t.micro_batch, seed=t.seed, vocab_size=m.vocab_size,
            dp_rank=self.ctx.dp_rank, dp_size=self.ctx.dp, rows=t.global_batch if self.row_streams else 0)
        self.flops_per_token = model_costs(m).total_flops
        self.peak = peak_flops(self.ctx.device, self.bf16, t.peak_tflops)
        self.step = 0
        self.tokens_seen = 0
        self.last_saved = -1
        self.health = StepHealth(self.ctx.device)
        self.bad = self._bad_steps()
        self.skips = DataSkips(cfg.run.dir, cfg.train.global_batch)  # data windows never trained on (rollbacks)
        self.batches = 0  # steps' worth of batches drawn, skipped windows included
        self.stragglers = StragglerWatch(cfg.fault.straggler_factor, self.ctx)
        self.prefetch: Prefetcher | None = None
        self.data_state: dict | None = None  # the source's state after the last consumed step
        self.stop = stop or StopSignal()
        self.stop_vote = StopVote(self.ctx, self.stop)
        self.run_lock: RunLock | None = None  # the main rank's, while this Trainer lives
        self._prepare_run_dir()
        self.metrics = MetricsLogger(cfg.run.dir, self.ctx.is_main, cfg.run.tensorboard, cfg.run.wandb,
                                     cfg.to_dict())
        self.checkpointer = Checkpointer(checkpoint_root(cfg.run.dir), cfg.checkpoint, self.pm)
        self.checkpointer.before_write = self.guard.before_write
        self._saving: dict[str, float] = {}  # checkpoint folder -> when its save began
        if self.ctx.is_main:
            summary = summary_lines(cfg, self.ctx, self.pm, self.train_source, bool(self.held_out), self.bf16,
                                    self.peak)
            if self.metrics.wandb_dir:
                summary.append(f"wandb ({cfg.run.wandb.mode}): {self.metrics.wandb_dir}")
            print(f"{timestamp()} megatron_taper run\n" + "\n".join("  " + line for line in summary), flush=True)
        self._resume()
        if self.ctx.is_main:  # only now: a refused resume leaves the run's config.yaml as it was
            save_config(self.cfg, os.path.join(self.cfg.run.dir, "config.yaml"))
        self.ctx.barrier()

    # -- setup ---------------------------------------------------------------------------------

    def _prepare_run_dir(self) -> None:
        """Refuse a run.dir that is not a run folder, then lock it (main rank; every rank stops
        when another job holds it)."""
        refused, not_a_run = "", False
        if self.ctx.is_main:
            try:
                check_run_folder(self.cfg.run.dir)
                self.run_lock = RunLock(self.cfg.run.dir)
            except ConfigError as e:
                refused, not_a_run = str(e), isinstance(e, NotARunFolder)
        refused, not_a_run = broadcast_from_main(self.ctx, (refused, not_a_run))
        if refused:
            raise (NotARunFolder if not_a_run else ConfigError)(refused)

    def _resume(self) -> None:
        mode = self.cfg.run.resume
        candidates = resume_candidates(mode, checkpoint_root(self.cfg.run.dir))
        loaded = self.checkpointer.load(candidates, self.cfg.model, self.optimizer, explicit=mode != "auto")
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if loaded is None:
            self.metrics.truncate_after(0)
            if self.cfg.run.init_from:
                source = load_weights_only(self.cfg.run.init_from, self.cfg.model, self.pm)
                self._print(f"initialised from: {source} (weights only; optimizer, step and data start fresh)")
            if restart:
                self._print(restart_line(restart, self.cfg.run.dir, "no checkpoint yet: training from step 0"))
            return
        path, state = loaded
        changes = resume_changes(state["config"], self.cfg, state["step"], self.row_streams)
        self._restore(state)
        resumed = f"resumed from: {path} at step {self.step}"
        written = os.path.getmtime(os.path.join(path, "meta.json"))
        self._print(restart_line(restart, self.cfg.run.dir, resumed, written) if restart else resumed)
        for line in changes:
            self._print(line)

    def _restore(self, state: dict) -> None:
        """Continue from a loaded checkpoint's trainer state."""
        self.step = state["step"]
        saved = state["config"]["train"]  # checkpoints before tokens_seen was saved: all steps at their batch
        self.tokens_seen = state.get("tokens_seen", self.step * saved["global_batch"] * self.cfg.model.seq_len)
        self.health = StepHealth(self.ctx.device, skipped=state["skipped"])
        self.batches = self.step + state.get("data_skipped", 0)
        self.last_saved = self.step
        if self.prefetch is not None:  # it has drawn ahead of the restored position
            self.prefetch.close()
            self.prefetch = None
        data = dict(state["data"])
        carried = data.pop("carried", None)
        if self.carry is not None:
            self.carry.load_state_dict(carried)
        self.train_source.load_state_dict(data)
        self.metrics.truncate_after(self.step)

    def _bad_steps(self) -> BadSteps:
        f = self.cfg.fault
        return BadSteps(self.ctx.device, f.rollback_after, f.spike_factor, f.spike_rollback)

    def autocast(self):
        if self.bf16:
            return torch.autocast(self.ctx.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- the loop ------------------------------------------------------------------------------

    def train_step(self) -> dict:
        """One step. Loss and grad norm stay on the device (no host sync): `record` holds tensors,
        read at log intervals (`_log_step`), as are the non-finite counters (`check_health`)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, self.cfg.train)
        if self.prefetch is None:
            self.prefetch = Prefetcher(self.train_source, self.accum, pin=self.ctx.device.type == "cuda")
        while True:  # the batches of a skipped window are drawn and dropped
            micro_batches, self.data_state, data_metrics = self.prefetch.next()
            self.batches += 1
            if not self.skips.covers(self.batches):
                break
        self.stragglers.ready()
        if self.carry is not None:
            micro_batches = self.carry.split(micro_batches)
        elif self.row_streams:
            micro_batches = [tokens for tokens, _ in micro_batches]
        losses = self.pm.forward_backward(micro_batches, self.autocast, self.carry)
        loss = self._dp_mean(self.guard.loss(losses, self.step + 1))
        # reduce, clip and step (or skip a non-finite step, on the device); the engine owns how
        grad_norm, stepped = self.pm.optimizer_step(self.optimizer, self.cfg.train.grad_clip, torch.isfinite(loss))
        self.step += 1
        self.tokens_seen += self.cfg.train.global_batch * self.cfg.model.seq_len
        self.health.update(stepped, self.step, self.cfg.train.max_nonfinite)
        self.bad.update(loss, stepped, self.step, self.batches)
        return {"loss": loss, "grad_norm": grad_norm, "lr": self.optimizer.param_groups[0]["lr"], **data_metrics}

    @property
    def skipped(self) -> int:
        return self.health.skipped_steps()

    def check_health(self) -> None:
        """Name the steps skipped since the last check; raise NonFiniteLossError if
        train.max_nonfinite steps in a row were non-finite (host reads of the device counters: at
        log intervals, before every save and at the end)."""
        self._report_skipped()
        breach = self.health.breach_step()
        if breach:
            n = self.cfg.train.max_nonfinite
            raise NonFiniteLossError(
                f"loss or gradient norm was non-finite for {n} steps in a row (up to step {breach}, "
                f"train.max_nonfinite={n}); lower train.lr, enable train.grad_clip or check the data"
            )

    def _report_skipped(self) -> None:
        line = self.health.new_skips(self.cfg.train.max_nonfinite)
        if line:
            self._print(line)

    def evaluate(self) -> dict[str, float] | None:
        """Held-out loss: "" the loss (data.mix: the sources' losses weighted by the mixture), and
        under data.mix each source's own loss by its name; None without held-out data."""
        if not self.held_out:
            return None
        results = evaluate_held_out(self.pm, self.held_out, self.cfg.train.eval_batches, self.autocast)
        per_source = {h.name: results[h.name].loss for h in self.held_out if h.name}
        return {"": combined_loss(results, self.held_out), **per_source}

    def fit(self) -> int:
        t, ckpt = self.cfg.train, self.cfg.checkpoint
        tokens_per_step = t.global_batch * self.cfg.model.seq_len
        installed_here = self.stop.install()  # run() installs them earlier, for start-up
        steps_here, last_time, last_step = 0, time.perf_counter(), self.step
        started = last_time
        try:
            while self.step < t.steps:
                self.stragglers.begin()
                self.guard.step_begins(self.step + 1)
                record = self.train_step()
                self.guard.step_done(self.step)
                steps_here += 1
                self.checkpointer.poll()  # completes a background save once every rank has written
                self._report_saved()
                # a signal: agreed at every step boundary (training/stop.py), acted on here
                stop = self.stop_vote.at_step_end(self.step) if self.step < t.steps else None
                at_log = self.step % t.log_interval == 0 or self.step == t.steps
                at_save = bool(ckpt.interval) and self.step % ckpt.interval == 0
                at_exit = bool(t.exit_after) and steps_here >= t.exit_after
                rolled_back = False
                if at_log or at_save or at_exit or stop:
                    self._report_skipped()  # before a rollback resets the counters
                    rolled_back = self._bad_step_policy()
                    if rolled_back and not stop:
                        continue  # rolled back to an earlier checkpoint
                if at_log and not rolled_back:
                    self.check_health()
                    now = time.perf_counter()
                    step_time = (now - last_time) / max(self.step - last_step, 1)
                    last_time, last_step = now, self.step
                    # ETA from this process's mean step time so far (evaluations and saves included)
                    eta = (t.steps - self.step) * (now - started) / steps_here
                    self._log_step(record, step_time, tokens_per_step, eta)
                if stop:
                    return self._stop_with_checkpoint(stop)
                if t.eval_interval and self.step % t.eval_interval == 0 and self.step < t.steps:
                    self._log_eval()
                if self.step == t.steps:
                    break
                if at_save:
                    self.save()
                if at_exit:
                    self.save(final=True)
                    self._print(f"train.exit_after={t.exit_after}: stopped at step {self.step} with a checkpoint")
                    return 0
            self._log_eval()
            self.save(final=True)
            return 0
        finally:
            if self.prefetch is not None:
                self.prefetch.close()
            self.metrics.close()
            if self.run_lock is not None:
                self.run_lock.release()
            if installed_here:
                self.stop.uninstall()

    def _stop_with_checkpoint(self, stop: Stop) -> int:
        self.save(final=True)
        self._print(f"stopped by {stop.name} at step {self.step} (the signal was first seen at the end of step "
                    f"{stop.seen_at}); checkpoint written; exit {EXIT_REQUEUE}: the same command resumes")
        return EXIT_REQUEUE

    def save(self, final: bool = False) -> None:
        """Checkpoint the current step; `final`: also wait until it (and any background save) is
        complete, before the process exits."""
        self.check_health()  # never a checkpoint after train.max_nonfinite non-finite steps in a row
        if not final and self.cfg.fault.rollback_after and int(self.bad.in_row):
            # bad steps in a row: the newest checkpoint stays one from before them (the rollback's)
            self._print(f"checkpoint of step {self.step} not written: the steps before it were bad "
                        f"(fault.rollback_after={self.cfg.fault.rollback_after})")
            return
        with self.guard.section("save", self.step):
            self._save(final)
        self._report_saved()

    def _save(self, final: bool) -> None:
        if self.step != self.last_saved:
            self.last_saved = self.step
            self._saving[os.path.join(checkpoint_root(self.cfg.run.dir), f"step-{self.step}")] = time.perf_counter()
            data = self.data_state if self.data_state is not None else self.train_source.state_dict()
            if self.carry is not None:  # this rank's rows' states, with the data position they belong to
                data = {**data, "carried": self.carry.state_dict()}
            self.checkpointer.save(self.optimizer, self.step, self.cfg.to_dict(),
                                   {"skipped": self.skipped, "data_skipped": self.batches - self.step,
                                    "tokens_seen": self.tokens_seen}, data)
        if final:
            self.checkpointer.wait()
            self.checkpointer.join_cleanup()  # rank 0's deletions of older checkpoints

    def _bad_step_policy(self) -> bool:
        """Log new loss spikes; roll back when fault.rollback_after bad steps in a row were reached
        (megatron_taper/fault/rollback.py). A host read of the device counters and one all-reduce,
        at log intervals and checkpoint steps; True after a rollback."""
        f = self.cfg.fault
        if f.spike_factor > 0:
            new, (step, loss, mean) = self.bad.new_spikes()
            if new:
                self._print(f"loss spike at step {step:.0f}: {loss:.4f} > fault.spike_factor={f.spike_factor:g} x "
                            f"the running mean {mean:.4f}" + (f" ({new} spikes since the last check)" if new > 1
                                                              else ""))
        if not f.rollback_after:
            return False
        trigger = self.bad.trigger.clone()
        if self.ctx.mesh is not None:
            dist.all_reduce(trigger, op=dist.ReduceOp.MAX)  # every rank takes the same decision
        reached, first_step, first_batch, last_batch = (int(x) for x in trigger)
        if not reached:
            return False
        self.checkpointer.wait()
        before = [path for step, path in reversed(list_checkpoints(checkpoint_root(self.cfg.run.dir)))
                  if step < first_step]
        if not before:
            raise NonFiniteLossError(f"{reached - first_step + 1} bad step(s) from step {first_step} (fault.rollback_"
                                     f"after={f.rollback_after}), and no checkpoint from before step {first_step} "
                                     f"to roll back to; set checkpoint.interval")
        self.skips.add(first_batch, last_batch, write=self.ctx.is_main)
        path, state = self.checkpointer.load(before, self.cfg.model, self.optimizer, explicit=False)
        self._restore(state)
        self.bad = self._bad_steps()
        self._print(f"rollback: {reached - first_step + 1} bad step(s) from step {first_step} (non-finite"
                    + (" or spike" if f.spike_rollback else "") + f"; fault.rollback_after={f.rollback_after}): "
                    f"reloaded {path} at step {self.step}; data batches {first_batch}-{last_batch} are skipped "
                    f"(recorded in {self.skips.path})")
        return True

    def _report_saved(self) -> None:
        """'checkpoint saved' for every save begun here that is now complete (async: finalised)."""
        pending = self.checkpointer.pending
        for path, began in list(self._saving.items()):
            if pending is None or pending.final != path:
                del self._saving[path]
                self._print(f"checkpoint saved: {path} ({time.perf_counter() - began:.1f} s)")

    # -- helpers -------------------------------------------------------------------------------

    def _log_step(self, record: dict, step_time: float, tokens_per_step: int, eta: float) -> None:
        record = {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in record.items()}  # the host read
        tokens_per_s = tokens_per_step / max(step_time, 1e-9)
        memory_gb, memory_kind = peak_memory(self.ctx.device)
        memory_gb = self._max_over_ranks(memory_gb)
        full = {"step": self.step, **record, "tokens_per_s": tokens_per_s,
                "tokens_seen": self.tokens_seen, "skipped_steps": self.skipped,
                "step_time_s": step_time, "peak_memory_gb": memory_gb}
        straggler, warning = self.stragglers.report(step_time)
        full.update(straggler)
        util = mfu(tokens_per_s / self.ctx.world_size, self.flops_per_token, self.peak)
        if util is not None:
            full["mfu"] = util
        line = (f"step {self.step:>6}/{self.cfg.train.steps} | loss {record['loss']:.4f} | lr {record['lr']:.3e} | "
                f"grad_norm {record['grad_norm']:.3f} | {step_time:.3f} s/step | {tokens_per_s:,.0f} tok/s"
                + (f" | mfu {util:.1%}" if util is not None else "")
                + f" | mem {memory_gb:.2f} GiB {memory_kind} | eta {format_duration(eta)}")
        self.metrics.log(full, line)
        if warning:
            self._print(warning)

    def _log_eval(self) -> None:
        with self.guard.section("eval", self.step):
            losses = self.evaluate()
        if losses is not None:
            eval_loss = losses.pop("")
            ppl = perplexity(eval_loss)
            self.metrics.log({"step": self.step, "eval_loss": eval_loss, "eval_ppl": ppl,
                              **{f"eval_loss/{name}": loss for name, loss in losses.items()}},
                             f"eval  {self.step:>6} | loss {eval_loss:.4f} | ppl {ppl:.2f}"
                             + "".join(f" | {name} {loss:.4f}" for name, loss in losses.items()))

    def _dp_mean(self, value: torch.Tensor) -> torch.Tensor:
        if self.ctx.dp > 1:
            value = value.clone()
            dist.all_reduce(value, op=dist.ReduceOp.AVG, group=self.ctx.dp_group)
        return value

    def _max_over_ranks(self, value: float) -> float:
        """The largest `value` of all ranks (the peak memory of the fullest rank)."""
        if self.ctx.mesh is None:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self.ctx.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return float(tensor.item())

    def _print(self, text: str) -> None:
        if self.ctx.is_main:
            print(f"{timestamp()} {text}", flush=True)



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
        if guard is not None:  # before a fresh run folder is removed below
            guard.stop()
        expected = isinstance(e, (ConfigError, ValueError, NonFiniteLossError))
        rank = ctx.rank if ctx is not None else int(os.environ.get("RANK", "0"))
        log_dir = cfg.run.dir if cfg is not None and not isinstance(e, NotARunFolder) else None
        if expected and created_run_dir:  # a fresh run folder that never started training goes again
            log_dir = None
            if os.path.isdir(created_run_dir) and (ctx is None or ctx.is_main):
                shutil.rmtree(created_run_dir, ignore_errors=True)
        report_error(e, rank, log_dir, expected)
        return EXIT_BAD_INPUT if expected and not isinstance(e, NonFiniteLossError) else 1
    finally:
        if ctx is not None:
            with contextlib.suppress(Exception):
                shutdown(ctx, barrier=clean)
        if guard is not None:
            guard.stop()
        stop.uninstall()
