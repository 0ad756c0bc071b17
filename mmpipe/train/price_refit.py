"""``data.balance: cost`` with ``data.balance_refit: N``: the prices that regroup each step, refit during
the run from what the stage clock measures.

The plan's prices come from the layer profile, taken on example batches (one image size, one text
length). Every step, each rank adds to the step's one gather the forward + backward seconds of each of
its micro-batches on its stage (``StageClock.micro_batch_busy``), and a data-reading rank the step's
micro-batches' vision units and token slots (``StepBalancer.features``). Every ``N`` steps rank 0 fits
each stage's prices to the micro-batches of the last ``2N`` steps (``planning.prices.refit_stage``:
per vision unit, per token slot and per micro-batch, the profile's prices as the prior) and tells every
rank (one broadcast); every data-reading rank's sampler regroups with them from a step its loader has
not reached yet (the same step on every rank, so every stage reads the same micro-batches). The fit is
logged as a ``refit`` record in metrics.jsonl (multipliers, base, the prediction error before and
after), and the prices in force are saved with the data position: a resume regroups with them.
Needs the stage clock (``log.stage_timing``), so pipelines only (P >= 2)."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch.distributed as dist

from mmpipe.planning.prices import refit_stage, stage_prices
from mmpipe.train.faults import _warn


class PriceRefit:
    def __init__(self, run, sampler, clock, start_step: int):
        cfg, topo = run.cfg, run.topo
        self.every = cfg.data.balance_refit
        self.prior = stage_prices(run.plan) if cfg.data.balance == "cost" else None
        self.on = self.every > 0 and self.prior is not None and topo.pipeline_stages > 1 and clock is not None
        if self.every > 0 and not self.on and run.is_reporter and "data.balance_refit" in cfg.explicit:
            why = ("it refits data.balance=cost's prices" if self.prior is None else
                   "it reads the stage clock of a pipeline" if topo.pipeline_stages == 1 else
                   "it reads the stage clock (log.stage_timing=false)")
            _warn(f"data.balance_refit={self.every} is off: {why}"
                  f"{'' if self.prior is None else '; the profile prices regroup every step'}")
        self.A, self.D, self.P = topo.accumulation_steps, topo.data_parallel, topo.pipeline_stages
        self.sampler = sampler if sampler is not None and sampler.balancer is not None else None
        self.clock = clock
        self.coords = [topo.coords(r) for r in range(run.world)]
        self.first = start_step + 2  # this process's first step warms up: not measured
        self.seen: list = []  # per step: (features [D*A, 3], busy [P, D, A])
        # the loader asks for at most workers x prefetch micro-batches ahead of the step being trained
        ahead = cfg.data.num_workers * cfg.data.prefetch_factor if cfg.data.num_workers else 0
        self.lead = 1 + math.ceil(ahead / self.A)

    def columns(self, step: int) -> list:
        """This rank's part of the step's gather: its micro-batches' busy seconds on its stage, then (a
        data-reading rank) every micro-batch's vision units, token slots and squares; [] when off."""
        if not self.on:
            return []
        feats = np.zeros(3 * self.D * self.A)
        plan = self.sampler.step_plan(step) if self.sampler is not None else None
        if plan is not None:
            feats = plan.features.reshape(-1)
        return self.clock.micro_batch_busy(self.A) + feats.tolist()

    def after_step(self, step: int, refit_cols: np.ndarray) -> Optional[dict]:
        """Keep the step's measurements; every ``every`` steps refit and reprice (every rank). Returns
        the ``refit`` record (on every rank), or None."""
        if not self.on or step < self.first or refit_cols.shape[1] == 0:
            return None
        A = self.A
        readers = np.nonzero(np.abs(refit_cols[:, A:]).sum(axis=1) > 0)[0]
        if len(readers) == 0:
            return None
        busy = np.zeros((self.P, self.D, A))
        for r, (s, d) in enumerate(self.coords):
            busy[s, d] = refit_cols[r, :A]
        self.seen = (self.seen + [(refit_cols[readers[0], A:].reshape(self.D * A, 3), busy)])[-2 * self.every:]
        if step % self.every:
            return None
        box = [self._fit() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        rec = box[0]
        prices = self.prior.scaled(rec["vision_scale"], rec["token_scale"], [b / 1e3 for b in rec["base_ms"]])
        if self.sampler is not None:
            self.sampler.reprice(prices, step + self.lead)
        return {"step": step, "from_step": step + self.lead, **rec}

    def _fit(self) -> dict:
        feats = np.concatenate([f for f, _ in self.seen])  # [steps x D x A, 3]
        text = self.prior.text_slots(feats)  # [P, micro-batches]: a stage's squares in its own slots
        out = {"vision_scale": [], "token_scale": [], "base_ms": [], "error_before": [], "error_after": [],
               "micro_batches": len(feats)}
        for s in range(self.P):
            busy = np.concatenate([b[s].reshape(-1) for _, b in self.seen])
            fit = refit_stage(self.prior.vision[s], self.prior.tokens[s], np.column_stack([feats[:, 0], text[s]]), busy)
            out["vision_scale"].append(round(fit["vision"], 4))
            out["token_scale"].append(round(fit["tokens"], 4))
            out["base_ms"].append(round(1e3 * fit["base"], 4))
            out["error_before"].append(round(fit["error_before"], 4))
            out["error_after"].append(round(fit["error_after"], 4))
        return out
