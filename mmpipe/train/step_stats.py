"""TODO docstring."""
from __future__ import annotations
import json
import math
import time
from typing import Optional
import torch
from mmpipe.parallel import startup
from mmpipe.parallel.strategies import LABEL_PLACEHOLDER


# --------------------------------------------------------------------------------------------
# data streams per stage
# --------------------------------------------------------------------------------------------
class DataStats:
    """Per-rank data counters for the current step: the bad-file reports of the micro-batches this
    rank consumed (merged over all ranks by the trainer into the run's ``BadSampleLedger``),
    samples drawn, and seconds the training loop waited for the loader."""

    def __init__(self, sample_log: Optional[str] = None, rank: int = 0, stage: int = 0):
        self.sample_log = open(sample_log, "a") if sample_log else None
        self.rank, self.stage, self.step = rank, stage, 0  # ``step``: set by the trainer before each step
        self.reset()

    def reset(self) -> None:
        self.reports, self.wait, self.drawn = [], 0.0, 0

    def add(self, batch) -> None:
        self.drawn += len(batch["keys"]) + len(batch["bad"])
        if self.sample_log is not None:  # one JSON object per micro-batch
            self.sample_log.write(json.dumps({"rank": self.rank, "step": self.step, "stage": self.stage,
                                              "keys": [str(k) for k in batch["keys"]]}) + "\n")
            self.sample_log.flush()
        self.reports.extend((str(path), str(why)) for path, why in batch["bad"])


def memory_summary(engine, inner_optimizer, rank: int, stage: int) -> str:
    """One line per rank after the first step: what this rank holds (frozen groups show here)."""
    import resource

    from deepspeed.accelerator import get_accelerator
    params = list(engine.module.parameters())
    numel = lambda p: getattr(p, "ds_numel", p.numel())  # noqa: E731 - ZeRO-3 partitions parameters
    total = sum(numel(p) for p in params)
    trainable = sum(numel(p) for p in params if p.requires_grad)
    state = sum(t.numel() * t.element_size() for s in inner_optimizer.state.values() for t in s.values()
                if torch.is_tensor(t))
    acc = get_accelerator()
    if acc.device_name() == "cpu":
        peak = f"max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB"
    else:
        peak = f"peak device memory {acc.max_memory_allocated() / 2**20:.0f} MB"
    return (f"rank {rank} stage {stage}: params {total / 1e6:.2f}M (trainable {trainable / 1e6:.2f}M), "
            f"optimizer state {state / 2**20:.1f} MB, {peak}" + (f", {startup.CPU_THREADS}" if startup.CPU_THREADS else ""))


def _as_pipe_batches(loader, stats: DataStats, family, count: bool = True):
    """(first-stage fields, last-stage fields) per micro-batch; ``count``: this rank's draws and bad
    files count for the run (the first stage's; a last stage that reads only for labels does not)."""
    it = iter(loader)
    while True:
        t0 = time.perf_counter()
        try:
            b = next(it)
        except StopIteration:
            return
        if count:
            stats.wait += time.perf_counter() - t0
            stats.add(b)
        yield tuple(b[f] for f in family.inputs), tuple(b[f] for f in family.labels) or LABEL_PLACEHOLDER


def eval_due(step: int, eval_every: int, total_steps: int) -> bool:
    """Eval steps: every ``eval_every`` steps and the last step, whether or not a run stops
    (--stop-at) and resumes in between."""
    return step == total_steps or bool(eval_every and step % eval_every == 0)


def lr_fields(inner_optimizer, groups) -> list:
    """This rank's current lr of every configured group (NaN where the group is not on this rank),
    in config order: the trainer gathers them so every group's lr is logged in every layout."""
    current = {g.get("name"): g["lr"] for g in inner_optimizer.param_groups}
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


