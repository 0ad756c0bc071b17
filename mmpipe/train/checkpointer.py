"""The run's checkpoint policy: when to save (``train.save_every``, ``train.save_every_minutes`` by
rank 0's clock, the last step, a stop), what a save carries beyond DeepSpeed's files (the
bad-sample ledger, skipped steps, batch size, the data position), keep-K, and the restore of
``--resume``. The files themselves: ``mmpipe.train.checkpoint``."""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from mmpipe.data.badsamples import BadSampleLedger
from mmpipe.train import checkpoint
from mmpipe.train.checkpoint_record import absolute_paths, base_fingerprint
from mmpipe.train.faults import _warn, agree
from mmpipe.train.resume_checks import check_resume


class Checkpointer:
    def __init__(self, run, eng):
        self.run, self.eng = run, eng
        self.dir = os.path.join(run.out_dir, "checkpoints")
        self.last_save_time = time.time()
        self.timed_due = False  # rank 0's clock passed save_every_minutes (agreed in the step's gather)
        # a LoRA run's frozen base never changes: its checkpoints hold the adapters (and the optimizer
        # state, the schedule, the data position); ZeRO-3 partitions keep everything
        self.exclude_frozen = run.family.lora is not None and run.cfg.parallel.zero_stage < 3
        self._base = None

    def record(self) -> dict:
        """The run record a checkpoint carries; with the frozen base left out, rank 0 adds the
        fingerprint of the pretrained directories it is rebuilt from (read once: their weight files)."""
        if self.exclude_frozen and self.run.rank == 0 and self._base is None:
            self._base = base_fingerprint(self.run.cfg.to_dict()["model"])
        return {**self.eng.record, "frozen_base": self._base} if self._base is not None else self.eng.record

    def clock_due(self) -> bool:
        minutes = self.run.cfg.train.save_every_minutes
        return bool(minutes) and self.run.rank == 0 and time.time() - self.last_save_time >= 60 * minutes

    def due(self, step: int, end: int) -> bool:
        every = self.run.cfg.train.save_every
        if not self.run.cfg.train.save:
            return False
        return step == end or bool(every and step % every == 0) or self.timed_due

    def open_ledger(self) -> BadSampleLedger:
        """The run's bad-sample record: every rank needs the training set's size for the bad-fraction check."""
        run = self.run
        n_train = torch.tensor([run.source.size or 0 if run.where.reads_data else 0], dtype=torch.int64,
                               device=self.eng.engine.device)
        dist.all_reduce(n_train, op=dist.ReduceOp.MAX)
        return BadSampleLedger(run.cfg.data.max_bad_fraction, int(n_train))

    def restore(self, ledger: BadSampleLedger) -> dict:
        """With --resume: weights, optimizer, RNG and the ledger; returns the run records (step,
        skipped steps, data position). Without: a fresh start."""
        run, eng = self.run, self.eng
        if not run.resume:
            return {"step": 0, "skipped_steps": 0, "data_position": None}
        ties = {a: b for pair in run.family.tied_weights() for a, b in (pair, pair[::-1])}
        model = absolute_paths(run.cfg.to_dict()["model"])
        current, packing = self.record(), bool(getattr(run.cfg.data, "packing", False))
        agree(run.rank, lambda: check_resume(self.dir, current, packing))
        client = agree(run.rank, lambda: checkpoint.load(eng.engine, self.dir, eng.layout, eng.inner,
                                                         eng.named_params, ties, model))
        ledger.load_state_dict(client.get("data") or {})
        saved_batch, batch = client.get("batch_size"), run.topo.batch_size
        if saved_batch and saved_batch != batch and run.rank == 0:
            _warn(f"train.batch_size {saved_batch} at the checkpoint, {batch} now: the epoch continues at its next "
                  f"unseen sample ({(client.get('data_position') or {}).get('sample', '?')})")
        return {"step": int(client.get("step", 0)), "skipped_steps": int(client.get("skipped_steps", 0)),
                "data_position": client.get("data_position")}

    def save(self, step: int, ledger: BadSampleLedger, skipped: int, position) -> None:
        eng, run = self.eng, self.run
        if position is not None:  # what the position counts: packs or samples (a resume must count the same)
            position = {**position, "packing": bool(getattr(run.cfg.data, "packing", False))}
        checkpoint.save(eng.engine, self.dir, step, {"bad_samples": ledger.count, "data": ledger.state_dict(),
                                                     "skipped_steps": skipped, "batch_size": run.topo.batch_size,
                                                     "data_position": position},
                        eng.layer_names, eng.parts, keep=run.cfg.train.keep_checkpoints, record=self.record(),
                        plain_optimizer=(eng.inner, eng.named_params, run.where.stage, run.where.dp_rank),
                        exclude_frozen=self.exclude_frozen)
        self.last_save_time, self.timed_due = time.time(), False
