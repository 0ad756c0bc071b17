"""Evaluation during training: the family's evaluation on ``data.val`` from the last layer's
eval-mode outputs, with unusable val samples replaced (as in training), named once and counted."""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from mmpipe.config.fields import thawed_copy
from mmpipe.data.sampler import eval_batches
from mmpipe.parallel.strategies import LABEL_PLACEHOLDER
from mmpipe.train.batches import DataStats, _as_pipe_batches
from mmpipe.train.faults import _warn, agree
from mmpipe.train.step_stats import to_monitor


class Evaluator:
    def __init__(self, run, eng, collate, writer):
        self.run, self.eng, self.collate, self.writer = run, eng, collate, writer
        self.named = set()  # bad val files already named (once per run)

    def __call__(self, step: int) -> Optional[dict]:
        run, family, val = self.run, self.run.family, self.run.val_samples
        if not val:
            return None
        idx, n_real = eval_batches(val, run.topo.micro_batch_size, pad=not family.dynamic_shapes)
        stats = DataStats()  # the val set's own: not the training set's bad fraction, nor its loader wait

        def val_batches():
            if run.where.reads_data:
                data_cfg = thawed_copy(run.cfg.data)
                data_cfg.packing = False  # one row per val sample (idx counts samples)
                ds = family.dataset(val, run.tok, data_cfg)
                return list(_as_pipe_batches((self.collate([ds[i] for i in mb]) for mb in idx), stats, family,
                                             keyed=self.eng.runner.keyed))
            return [(None, LABEL_PLACEHOLDER)] * len(idx) if run.topo.is_last_stage(run.rank) else None

        # every rank decodes (or waits) here, before any stage enters the pipeline: an error on one
        # rank (a val set with no usable sample, an unreadable file) stops every rank at once
        batches = agree(run.rank, val_batches)
        bad = self.val_bad_samples(stats.reports)
        outputs = self.eng.runner.eval_outputs(batches, len(idx))
        record = None
        if outputs is not None and run.is_reporter:
            record = {"step": step, **family.evaluate(outputs, [b[1] for b in batches], val[:n_real]),
                      "val_bad_samples": bad}
            self.writer.log_eval(record, family.eval_line(record))
        if self.eng.monitor is not None:  # every rank joins (the record travels from the reporting rank)
            to_monitor(run, self.eng.monitor, step, record, "mmpipe/eval/")
        return record

    def val_bad_samples(self, reports: list) -> int:
        """Unusable val samples: every reading rank's reports merged; the reporter names each file
        once per run. Returns how many."""
        per_rank = [None] * self.run.world
        dist.all_gather_object(per_rank, reports)
        files = dict(r for rr in per_rank for r in rr)
        for path, why in files.items():
            if self.run.is_reporter and path not in self.named:
                _warn(f"skipped bad val sample {path}: {why}")
        self.named |= set(files)
        return len(files)
