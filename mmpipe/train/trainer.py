"""One training loop for every model family and layout: P = 1 (plain DeepSpeed engine, one process
or data parallel) and P >= 2 (DeepSpeed pipeline engine, optionally x data parallel).

The trainer is wiring plus a loop. ``resolve_run`` (``setup.py``) decides everything before the
first step and returns one frozen ``ResolvedRun``; ``build_engine`` (``engine.py``) makes the
DeepSpeed engine and grouped clipping; the ``Checkpointer`` owns saving and restoring, the
``FaultGuard`` signals and bad steps, ``TrainData`` this rank's stream, ``StepStats`` the one
gather per step, the ``Evaluator`` evaluation.

Launch (see launch/train.py for copy-paste commands):
    deepspeed --num_gpus 2 launch/train.py --config configs/demo.yaml
    accelerate launch --config_file launch/accelerate/cpu_2proc.yaml launch/train.py --config configs/demo.yaml
    python launch/train.py --config configs/demo.yaml --set parallel.pipeline_stages=1
"""
from __future__ import annotations

import contextlib
import time
from typing import Optional, Union

import torch.distributed as dist

from mmpipe.config.schema import RunConfig
from mmpipe.errors import DataError
from mmpipe.parallel.ds_compat import dynamic_loss_scale
from mmpipe.parallel.stage_clock import stage_record
from mmpipe.planning.flops import peak_tflops, step_counter, utilization
from mmpipe.train.batches import TrainData
from mmpipe.train.checkpointer import Checkpointer
from mmpipe.train.engine import build_engine
from mmpipe.train.evaluate import Evaluator
from mmpipe.train.faults import FaultGuard, _everywhere, _warn
from mmpipe.train.memory_meter import MemoryMeter, write_memory
from mmpipe.train.profiling import StepProfiler
from mmpipe.train.replan import Replanner, continue_on_new_cut
from mmpipe.train.run_dir import write_run_files
from mmpipe.train.setup import resolve_run
from mmpipe.train.step_stats import (
    eval_due,
    gather_step,
    log_memory,
    lr_fields,
    lr_record,
    to_monitor,
    write_trace,
)


def run(cfg: RunConfig, resume: Union[bool, str, None] = None, stop_at: Optional[int] = None,
        overwrite: bool = False) -> dict:
    """Train; ``resume``: true, false or ``"auto"`` (None: ``train.resume``); ``stop_at`` ends this
    invocation after that step with a checkpoint (time-limited jobs); ``overwrite`` replaces a run
    already in ``train.output_dir`` (without it, or ``resume``, that is refused). Returns the last
    step, eval, bad samples and ``stopped_by`` (the signal that stopped it early, else None)."""
    return Trainer(cfg, resume, stop_at, overwrite).train()


class Trainer:
    """One training run on this rank: ``setup`` wires the resolved run's parts, ``train`` loops
    ``step`` / ``evaluate`` / ``save``."""

    def __init__(self, cfg: RunConfig, resume: Union[bool, str, None] = None, stop_at: Optional[int] = None,
                 overwrite: bool = False):
        # ``cfg`` is never changed: the run resolves a config of its own and saves it as-is
        self.cfg, self.resume, self.stop_at, self.overwrite = cfg, resume, stop_at, overwrite
        self.last_eval = None
        self.skipped_total = 0

    def setup(self) -> None:
        self.guard = FaultGuard(self.cfg.train.max_bad_steps)
        self.run = run = resolve_run(self.cfg, self.resume, self.stop_at, self.overwrite)
        self.eng = eng = build_engine(run)
        self.guard.last_loss_scale = dynamic_loss_scale(eng.engine.optimizer)
        self.ckpt = Checkpointer(run, eng)
        self.ledger = self.ckpt.open_ledger()
        restored = self.ckpt.restore(self.ledger)
        self.start_step, self.skipped_total = restored["step"], restored["skipped_steps"]
        self.writer = write_run_files(run, eng, self.start_step)
        self.data = TrainData(run, self.start_step, restored["data_position"], eng.runner.clock, eng.runner.keyed)
        self.evaluate = Evaluator(run, eng, self.data.collate, self.writer)
        self.trace_offset = time.time() - time.perf_counter()
        self.profiler = StepProfiler(self.cfg.log.profile, run.out_dir, run.rank, run.device_name)
        self.replanner = Replanner(run, self.start_step)
        self.meter = MemoryMeter(eng.engine.module, eng.engine.optimizer, eng.inner) if self.cfg.log.memory else None
        # analytic FLOPs per step (a family that describes its arithmetic) over one device's peak
        # (None: no analytic FLOPs; else (the device's peak TFLOP/s, None where unknown),)
        self.peak = ((peak_tflops(run.cfg.train.precision, run.cfg.log.peak_tflops),)
                     if step_counter(run) is not None else None)

    # ---- the loop ------------------------------------------------------------------------------
    def train(self) -> dict:
        self.setup()
        cfg, step, guard = self.run.cfg, self.start_step, self.guard
        end = min(cfg.train.steps, self.stop_at) if self.stop_at else cfg.train.steps
        saved_at, stopped_by = step, None
        while step < end:
            step += 1
            self.profiler.before(step)
            record = self.step(step, tracing=bool(cfg.log.trace) and cfg.log.trace[0] <= step <= cfg.log.trace[1])
            if self.profiler.after(step) and self.run.is_reporter:
                self.writer.info(f"wrote {self.run.out_dir}/profile/ (rank*.json: ui.perfetto.dev; rank*.txt: ops by time)")
            self.writer.log_step(record)
            if self.eng.monitor is not None:
                to_monitor(self.run, self.eng.monitor, step, record)
            guard.check_bad_steps(step, record)
            if cfg.log.trace is not None and step == min(cfg.log.trace[1], end):
                write_trace(self.run, self.eng, self.writer, self.trace_offset)
            msg = self.ledger.error()
            if msg:
                raise _everywhere(DataError, msg)  # every rank knows it: printed once
            if step == self.start_step + 1:
                log_memory(self.run, self.eng, self.writer)
            if eval_due(step, cfg.train.eval_every, cfg.train.steps):  # before the save: a resume continues after it
                self.last_eval = self.evaluate(step) or self.last_eval
            if self.ckpt.due(step, end):
                self.save(step)
                saved_at = step
            moving = self.replanner.after_step(self.run, step, record) if step < end else None
            if moving is not None:  # the re-planner's decision: checkpoint, let the data go, continue on the new cut
                if saved_at != step:
                    self.save(step)
                self.data.close()
                continue_on_new_cut(self.run, self.writer, step, moving)  # (does not return)
            gain = self.replanner.measured(step, record)
            if gain is not None:
                self.writer.log_event("replan_measured", gain)
                self.writer.info(f"replan: {1e3 * gain['measured_before']:.0f} ms/step before the move, "
                                 f"{1e3 * gain['measured_after']:.0f} ms after ({gain['measured_gain']:.2f}x)")
            if guard.signal and step < end:  # preempted: every rank stops here, after a checkpoint
                if saved_at != step:
                    self.save(step)
                self.writer.info(f"stopped at step {step} by {guard.signal} ({guard.signal_rank}): checkpoint "
                                 f"saved; continue with --resume")
                stopped_by = guard.signal
                break
        if self.meter is not None:
            write_memory(self.run.out_dir, self.run.rank, self.run.where.stage, self.meter.peak())
        self.writer.close()
        dist.barrier()
        return {"step": step, "eval": self.last_eval, "bad_samples": self.ledger.count, "stopped_by": stopped_by}

    def step(self, step: int, tracing: bool = False) -> dict:
        """One optimizer step, then one small gather: data counters (summed over the reading ranks),
        every group's lr (wherever it lives) and stage timings. Returns the metrics record."""
        run, eng, topo = self.run, self.eng, self.run.topo
        lrs = lr_fields(eng.inner, eng.trainable)  # the lr this step uses (the scheduler moves it in the step)
        eng.clipper.step_no = self.data.stats.step = step
        run.family.begin_step()
        t0 = time.perf_counter()
        with self.meter or contextlib.nullcontext():
            loss = eng.runner.train_step(self.data.step_batches(run, eng.engine.device), step, tracing)
        dt = time.perf_counter() - t0
        self.data.stats.balance = self.data.balance_fields(step)
        stats, reports = gather_step(run, eng, self.ledger, self.data.stats, loss, lrs, bool(self.guard.requested),
                                     self.ckpt.clock_due(), self.data.refit.columns(step))
        refit = self.data.refit.after_step(step, stats.refit)
        if refit is not None:
            self.writer.log_event("refit", refit)
        loss = float(stats.loss[run.rank])
        for path, why in self.ledger.add(reports, int(stats.drawn.sum())):
            if run.is_reporter:
                _warn(f"skipped bad sample {path}: {why}")
        wait = float(stats.loader_wait.sum()) / topo.data_parallel  # mean over the first-stage ranks
        self.ckpt.timed_due = bool(stats.timed_save.max() > 0)
        if stats.stop_rank is not None:
            self.guard.agree_stop(stats.stop_rank, run.world)
        stage_fields = {}
        if eng.runner.clock is not None:
            stage_fields = stage_record(stats.stage_means(eng.stage_ranks), topo.pipeline_stages)
        lr = lr_record(stats.lr_now(), eng.trainable, run.cfg.optim.lr, ds_scheduler="scheduler" in run.where.ds_cfg)
        clip = eng.clipper.record()
        self.skipped_total += int(clip.get("skipped", False))
        packed = getattr(run.cfg.data, "packing", False)  # a step holds packs: count the samples in them
        samples = float(stats.samples.sum()) if packed else topo.batch_size
        tokens = float(stats.tokens.sum())
        pad = {"pad_fraction": 1.0 - float(stats.real_tokens.sum()) / tokens} if tokens and run.family.token_mean else {}
        flops = (utilization(float(stats.flops.sum()), float(stats.hw_flops.sum()), dt, run.world, self.peak[0])
                 if self.peak is not None else {})
        own = run.family.step_record(stats.family) if stats.family is not None else {}
        return {"step": step, "loss": loss, **own, **lr, "skipped_steps": self.skipped_total,
                "samples_per_sec": samples / dt, **pad, **clip, "step_time": dt, **flops,
                "loader_wait": wait, "loader_wait_frac": wait / dt, "bad_samples": self.ledger.count,
                "samples_seen": self.ledger.drawn, **stage_fields, **stats.balance_record()}

    def save(self, step: int) -> None:
        self.ckpt.save(step, self.ledger, self.skipped_total, self.data.position(step))
