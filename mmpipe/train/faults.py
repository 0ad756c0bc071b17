"""Faults every rank must agree on: errors raised alike on every rank (``agree``,
``_rank0_decides``), stop requests by signal (``FaultGuard``: SIGTERM / SIGINT / SIGUSR1 stop at the
next step boundary with a checkpoint, a second signal at once; ``exit_status`` after such a stop,
and Slurm's requeue) and runs of skipped steps (``train.max_bad_steps``)."""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Optional

import torch.distributed as dist

from mmpipe.errors import ConfigError, DataError, MmpipeError
from mmpipe.parallel.launchers import request_requeue, slurm_job

SAME_REQUEST_SECONDS = 3.0  # signals this close to the first one are one stop request (launchers relay)


def _warn(msg: str) -> None:
    print(f"[mmpipe] warning: {msg}", flush=True)


def _rank0_decides(rank: int, decide):
    """Run ``decide()`` on rank 0 and hand its result to every rank; an mmpipe error it raises is
    raised on every rank (and printed once)."""
    result = [None]
    if rank == 0:
        try:
            result = [decide()]
        except MmpipeError as e:
            result = [e]
    dist.broadcast_object_list(result, src=0)
    if isinstance(result[0], MmpipeError):
        raise _everywhere(type(result[0]), str(result[0]))
    return result[0]


def _everywhere(cls, msg: str) -> MmpipeError:
    err = cls(msg)
    err.everywhere = True  # every rank raises it: printed once (by rank 0)
    return err


def agree(rank: int, work):
    """Run ``work()`` on every rank; if it raised on any rank, raise on every rank, so no rank is
    left waiting in a collective for one that has already exited. An mmpipe error is raised alike
    everywhere (printed once, naming the rank it came from); any other exception is re-raised with
    its traceback on its own rank, and the others stop with one line naming that rank."""
    err, original = None, None
    try:
        result = work()
    except Exception as e:  # noqa: BLE001 - reported to every rank, then re-raised
        err, original, result = (type(e).__name__, str(e), isinstance(e, MmpipeError)), e, None
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, err)
    for r, e in enumerate(errors):
        if e is None:
            continue
        name, msg, ours = e
        if ours:
            cls = DataError if name == "DataError" else ConfigError
            raise _everywhere(cls, msg if r == 0 else f"[rank {r}] {msg}")
        if original is not None and not isinstance(original, MmpipeError):
            raise original
        raise MmpipeError(f"stopped: rank {r} failed with {name} (its traceback is printed above)")
    return result


# --------------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------------
def counts_as_bad(record: dict, previous_loss_scale: Optional[float]) -> bool:
    """Whether a step counts towards ``train.max_bad_steps``: a skipped step, unless fp16's dynamic
    loss scaler skipped it and lowered its scale (calibrating, as it does at the start of every fp16
    run: DeepSpeed's overflow check, not a broken run; still counted in ``skipped_steps``)."""
    if not record.get("skipped"):
        return False
    scale = record.get("loss_scale")
    return not (scale is not None and previous_loss_scale is not None and scale < previous_loss_scale)


# what stops a run at the next step boundary with a checkpoint: a scheduler's or the user's stop
# (SIGTERM: Slurm's scancel and preemption, Kubernetes' pod deletion; SIGINT: Ctrl-C) and Slurm's warning
# before the time limit (sbatch --signal=USR1@T)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def exit_status(stopped_by: Optional[str], rank: int, auto: bool) -> int:
    """The exit status of a run: 0 when it trained to its last step (or ``--stop-at``); after a stop
    by a signal (its checkpoint complete on every rank) 128 + the signal's number, as a shell reports a
    process that signal ended (143 SIGTERM, 130 SIGINT, 138 SIGUSR1): not finished, which Kubernetes'
    ``restartPolicy: ExitCode`` retries and Slurm's ``RequeueExit`` can list. A Slurm job stopped by
    SIGUSR1 (the time limit nears) asks to be requeued first (rank 0, ``scontrol requeue``), and rank 0
    logs which it did; ``auto``: the run continues by itself (``train.resume: auto``)."""
    if stopped_by is None:
        return 0
    number = int(signal.Signals[stopped_by])
    job = slurm_job()
    if rank == 0 and stopped_by == "SIGUSR1" and job:
        done, line = request_requeue(job)
        if done and not auto:
            line += "; its command continues only with --resume auto (or train.resume: auto)"
        print(f"[mmpipe] {line}" + ("" if done else f"; exit status {128 + number}"), flush=True)
    elif rank == 0:
        print(f"[mmpipe] stopped by {stopped_by}: exit status {128 + number} (continue with "
              f"{'the same command' if auto else '--resume'})", flush=True)
    return 128 + number


class FaultGuard:
    """This rank's stop requests and bad-step count. A stop request is local until the step's
    gather, where every rank learns it and the first requesting rank (``agree_stop``)."""

    def __init__(self, max_bad_steps: int):
        self.max_bad_steps = max_bad_steps
        self.requested = None  # this rank's signal name
        self.requested_at = 0.0
        self.signal = self.signal_rank = None  # agreed by every rank at a step boundary
        self.bad_run = 0
        self.last_loss_scale = None  # fp16's dynamic loss scale after the previous step
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                signal.signal(s, self.on_signal)

    def on_signal(self, signum, frame) -> None:
        """SIGTERM / SIGINT / SIGUSR1: stop at the next step boundary with a checkpoint (all ranks agree
        through the step's gather); a second signal stops at once. A signal within
        ``SAME_REQUEST_SECONDS`` of the first is the same request: a Ctrl-C under the ``deepspeed``
        launcher reaches every rank as SIGINT and, from DeepSpeed's ``launch.py`` at once, SIGTERM."""
        now = time.monotonic()
        if self.requested:
            if now - self.requested_at <= SAME_REQUEST_SECONDS:
                return
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.requested, self.requested_at = signal.Signals(signum).name, now

    def agree_stop(self, first_rank: int, world: int) -> None:
        """Every rank's signal name; the stop is ``first_rank``'s (gathered with the step's stats)."""
        if self.signal is None:
            names = [None] * world
            dist.all_gather_object(names, self.requested)
            self.signal, self.signal_rank = names[first_rank], f"rank {first_rank}"

    def check_bad_steps(self, step: int, record: dict) -> None:
        """A skipped step (non-finite gradients on some rank) is counted; ``train.max_bad_steps``
        consecutive ones stop the run with one line."""
        self.bad_run = self.bad_run + 1 if counts_as_bad(record, self.last_loss_scale) else 0
        self.last_loss_scale = record.get("loss_scale", self.last_loss_scale)
        limit = self.max_bad_steps
        if limit and self.bad_run >= limit:
            norms = ", ".join(f"{k}={v:.4g}" for k, v in record.items() if k.startswith("grad_norm.") and v is not None)
            raise _everywhere(MmpipeError, f"step {step}: {self.bad_run} consecutive steps skipped for non-finite "
                              f"gradients ({norms or 'grad_norm=' + str(record.get('grad_norm'))}); "
                              "train.max_bad_steps stops the run here: lower optim.lr, clip gradients "
                              "(optim.max_grad_norm) or check the data")
