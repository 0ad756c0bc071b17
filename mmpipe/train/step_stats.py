"""What a step reports: every rank's counters gathered once into a typed ``StepStats``, the lr of
every group wherever it lives, the memory line and record per rank, the stage trace, and DeepSpeed's monitors."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from mmpipe.parallel import startup
from mmpipe.parallel.ds_compat import group_name
from mmpipe.parallel.stage_clock import FIELDS, write_timeline_png
from mmpipe.parallel.stage_clock import write_trace as write_trace_json


def memory_record(engine, inner_optimizer, rank: int, stage: int) -> dict:
    """What this rank holds after the first step (frozen groups show here): its parameters, the
    trainable ones, the inner optimizer's state in MB and its peak memory in MB (``peak_of``:
    ``max_rss`` on the CPU, ``device`` the accelerator's allocator peak). One entry of the run's
    ``metrics.jsonl`` memory record (``log_memory``)."""
    import resource

    from deepspeed.accelerator import get_accelerator
    params = list(engine.module.parameters())
    numel = lambda p: getattr(p, "ds_numel", p.numel())  # noqa: E731 - ZeRO-3 partitions parameters
    state = sum(t.numel() * t.element_size() for s in inner_optimizer.state.values() for t in s.values()
                if torch.is_tensor(t))
    acc = get_accelerator()
    cpu = acc.device_name() == "cpu"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 if cpu else acc.max_memory_allocated() / 2**20
    return {"rank": rank, "stage": stage, "params": sum(numel(p) for p in params),
            "trainable": sum(numel(p) for p in params if p.requires_grad), "optimizer_state_mb": state / 2**20,
            "peak_mb": peak, "peak_of": "max_rss" if cpu else "device", "cpu_threads": startup.CPU_THREADS}


def memory_line(rec: dict) -> str:
    """The human line of one rank's ``memory_record``."""
    peak = f"{'max RSS' if rec['peak_of'] == 'max_rss' else 'peak device memory'} {rec['peak_mb']:.0f} MB"
    return (f"rank {rec['rank']} stage {rec['stage']}: params {rec['params'] / 1e6:.2f}M (trainable "
            f"{rec['trainable'] / 1e6:.2f}M), optimizer state {rec['optimizer_state_mb']:.1f} MB, {peak}"
            + (f", {rec['cpu_threads']}" if rec["cpu_threads"] else ""))


def eval_due(step: int, eval_every: int, total_steps: int) -> bool:
    """Eval steps: every ``eval_every`` steps and the last step, whether or not a run stops
    (--stop-at) and resumes in between."""
    return step == total_steps or bool(eval_every and step % eval_every == 0)


def lr_fields(inner_optimizer, groups) -> list:
    """This rank's current lr of every configured group (NaN where the group is not on this rank),
    in config order: the trainer gathers them so every group's lr is logged in every layout."""
    current = {group_name(g): g["lr"] for g in inner_optimizer.param_groups}
    return [current.get(g.name, float("nan")) for g in groups]


def lr_record(per_group: list, groups, base_lr: float, ds_scheduler: bool = False) -> dict:
    """``lr.<group>`` for every trainable group, and ``lr``: the schedule applied to ``optim.lr``
    (the same in every layout, whichever groups the reporting rank holds). Under a DeepSpeed-JSON
    ``scheduler`` (WarmupLR, ...), which sets one absolute lr on every group, ``lr`` is that lr."""
    out = {f"lr.{g.name}": v for g, v in zip(groups, per_group) if math.isfinite(v)}
    held = [(g, v) for g, v in zip(groups, per_group) if math.isfinite(v)]
    if ds_scheduler:
        return {"lr": held[0][1] if held else 0.0, **out}
    ratio = next((v / g.lr for g, v in held if g.lr > 0), None)
    return {"lr": base_lr * ratio if ratio is not None else 0.0, **out}




BALANCE = ("before", "after", "step_before", "step_after", "ideal")  # data.balance=cost: a reading rank's prediction
FIXED = ("new_reports", "loader_wait", "drawn", "stop", "timed_save", "tokens", "real_tokens", "samples", "flops",
         "hw_flops") + tuple(f"balance_{k}" for k in BALANCE)


@dataclass
class StepStats:
    """Every rank's counters of one step, gathered once (one small all-gather, read by the host
    once: the fields are numpy arrays), a field per column: new bad-file reports, seconds waiting
    for the loader, samples drawn, a stop request (1 + the rank, else 0), rank 0's save clock,
    tokens, samples, the analytic FLOPs of the micro-batches read, the step's loss as the rank holds
    it (a device tensor until this gather); then every group's lr and the stage clock's fields."""
    new_reports: np.ndarray  # one value per rank
    loader_wait: np.ndarray
    drawn: np.ndarray
    stop: np.ndarray
    timed_save: np.ndarray
    tokens: np.ndarray  # token positions the rank's micro-batches held (padding included)
    real_tokens: np.ndarray  # ... of which real tokens (the padding fraction is the rest)
    samples: np.ndarray  # usable samples trained on (packed rows hold several)
    flops: np.ndarray  # analytic model FLOPs of the micro-batches the rank read (planning.flops)
    hw_flops: np.ndarray  # ... and hardware FLOPs (recomputed forwards included)
    balance_before: np.ndarray  # data.balance=cost: the step's predicted slot spread before regrouping (0: none)
    balance_after: np.ndarray  # ... after it
    balance_step_before: np.ndarray  # ... its predicted step seconds before
    balance_step_after: np.ndarray  # ... and after
    balance_ideal: np.ndarray  # ... and the balanced ideal (the busiest stage's total per rank)
    loss: np.ndarray  # the step's loss on each rank (the reporting rank's is the run's)
    lrs: np.ndarray  # world x groups (NaN where a group is not on that rank)
    timings: np.ndarray  # world x stage-clock fields
    # world x ``PriceRefit.columns``: each rank's micro-batches' busy seconds on its stage, then their
    # vision units and token slots (data.balance=cost with a refit; no columns otherwise)
    refit: np.ndarray
    family: Optional[np.ndarray] = None  # world x the family's ``step_columns`` (None: it has none)

    @classmethod
    def gather(cls, fixed: dict, loss: torch.Tensor, lrs: list, timings: list, world: int, device,
               refit: list = (), family: Optional[torch.Tensor] = None) -> "StepStats":
        host = torch.stack([torch.as_tensor(v, dtype=torch.float64)  # a host tensor (real tokens) is copied, not read
                            for v in [fixed[k] for k in FIXED] + lrs + timings + list(refit)])
        if host.device != torch.device(device):  # pinned, so the copy to the device does not wait for it
            host = host.pin_memory()
        own = family.to(device=device, dtype=torch.float64).reshape(-1) if family is not None else host[:0].to(device)
        mine = torch.cat([loss.detach().reshape(1).to(device=device, dtype=torch.float64), own,
                          host.to(device, non_blocking=True)])  # NCCL gathers device tensors only
        everyone = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
        s, n = torch.stack(everyone).cpu().numpy(), len(FIXED)  # the step's one host read
        f = 1 + own.numel()
        loss, fam, s = s[:, 0], s[:, 1:f], s[:, f:]
        t = n + len(lrs) + len(timings)
        return cls(*(s[:, i] for i in range(n)), loss, s[:, n:n + len(lrs)], s[:, n + len(lrs):t], s[:, t:],
                   family=fam if family is not None else None)

    def balance_record(self) -> dict:
        """``data.balance: cost``'s predicted slot spread before / after the step's regrouping, the
        predicted gain and the step over the balanced ideal (from a rank that reads data; {} without)."""
        if self.balance_step_after.max() <= 0:
            return {}
        r = int(np.argmax(self.balance_step_after > 0))
        return {"spread_before": round(float(self.balance_before[r]), 4),
                "spread_after": round(float(self.balance_after[r]), 4),
                "predicted_gain": round(float(self.balance_step_before[r] / self.balance_step_after[r]), 4),
                "over_ideal": round(float(self.balance_step_after[r] / max(self.balance_ideal[r], 1e-30)), 4)}

    @property
    def stop_rank(self) -> Optional[int]:
        first = int(self.stop.max())
        return first - 1 if first > 0 else None

    def lr_now(self) -> list:
        """Every group's lr, from whichever rank holds it."""
        return [float(np.nanmax(col)) if not np.isnan(col).all() else float("nan") for col in self.lrs.T]

    def stage_means(self, stage_ranks: list) -> dict:
        return {s: self.timings[ranks].mean(0).tolist() for s, ranks in enumerate(stage_ranks)}


def gather_step(run, eng, ledger, data_stats, loss: torch.Tensor, lrs: list, stop_requested: bool,
                timed_save: bool, refit: list = ()) -> tuple:
    """(``StepStats``, the bad-file reports new to the run, merged over ranks in rank order). ``loss``:
    the runner's step loss (a device tensor, read here with everything else); ``lrs``: this rank's lr
    per group as the step began (the scheduler moves it in the step); ``refit``: this rank's
    ``PriceRefit.columns``."""
    timings = []
    if eng.runner.clock is not None:  # the norm all-reduce in the optimizer step waits for other stages: idle
        timings = list(eng.runner.timings)
        w = min(eng.clipper.wait_seconds, timings[FIELDS.index("opt")])
        timings[FIELDS.index("opt")] -= w
        timings[FIELDS.index("comm")] += w
    reports = ledger.unknown(data_stats.reports)
    fixed = {"new_reports": len(reports), "loader_wait": data_stats.wait, "drawn": data_stats.drawn,
             "stop": 1.0 + run.rank if stop_requested else 0.0, "timed_save": timed_save,
             "tokens": data_stats.tokens, "real_tokens": data_stats.real_tokens, "samples": data_stats.samples,
             "flops": data_stats.flops, "hw_flops": data_stats.hw_flops,
             **{f"balance_{k}": float(data_stats.balance.get(k, 0.0)) for k in BALANCE}}
    stats = StepStats.gather(fixed, loss, lrs, timings, run.world, eng.engine.device, refit,
                             run.family.step_columns(eng.engine.device))
    if stats.new_reports.sum() > 0:  # new bad files somewhere: merge every rank's, in rank order
        per_rank = [None] * run.world
        dist.all_gather_object(per_rank, reports)
        reports = [r for rr in per_rank for r in rr]
    data_stats.reset()
    return stats, reports


def to_monitor(run, monitor, step: int, record: Optional[dict], prefix: str = "mmpipe/") -> None:
    """The step's metrics.jsonl scalars to DeepSpeed's own monitors (``tensorboard``,
    ``csv_monitor``, ``wandb``, ``comet`` blocks of the DeepSpeed JSON), as ``mmpipe/<key>``.
    DeepSpeed writes them from rank 0; the record is the reporting rank's."""
    src = run.topo.reporting_rank
    if src != 0:
        box = [record if run.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        record = box[0]
    if run.rank == 0:
        events = [(f"{prefix}{k}", float(v), step) for k, v in (record or {}).items()
                  if k != "step" and isinstance(v, (int, float)) and v is not None]
        monitor.write_events(events)


def write_trace(run, eng, writer, trace_offset: float) -> None:
    """The traced steps' stage events of every rank: a Perfetto trace and a timeline PNG."""
    if eng.runner.clock is None:
        return
    import os

    events = [None] * run.world
    dist.all_gather_object(events, (eng.runner.clock.events, trace_offset))
    eng.runner.clock.events = []
    if run.is_reporter:
        coords = [run.topo.coords(r) for r in range(run.world)]
        first, last = run.cfg.log.trace
        write_trace_json(os.path.join(run.out_dir, "trace.json"), events, coords)
        write_timeline_png(os.path.join(run.out_dir, "timeline.png"), events, coords,
                           f"steps {first}-{last}, {run.topo.describe()}")
        writer.info(f"wrote {run.out_dir}/trace.json (open in ui.perfetto.dev) and {run.out_dir}/timeline.png")


def log_memory(run, eng, writer) -> None:
    """What each rank holds (frozen groups show here), after the first step: a line per rank printed
    by the reporter, and one ``kind: memory`` record of every rank's figures in ``metrics.jsonl``."""
    recs = [None] * run.world
    dist.all_gather_object(recs, memory_record(eng.engine, eng.clipper.inner, run.rank, run.where.stage))
    for rec in recs:
        writer.info(memory_line(rec))
    writer.log_memory(recs)
