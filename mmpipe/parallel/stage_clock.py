"""Where a pipeline stage's time goes: every instruction the DeepSpeed pipeline engine executes
(forward, backward, send/receive of activations and gradients, loading a micro-batch, gradient
reduction, optimizer step) is timed on the stage that runs it.

The engine dispatches instructions through its class-level ``_INSTRUCTION_MAP``; ``StageClock``
gives the engine instance its own copy with each entry wrapped. Cost: two ``perf_counter`` calls
per instruction on the CPU. On accelerators the wrapper records device events instead and the
step's durations are read once at its end (no per-instruction synchronisation).

Per step it yields totals per category and the step's wall time; ``busy`` is forward + backward +
optimizer, ``data`` is loading micro-batches (the first stage waits for its loader there), the rest
of the step (waiting inside blocking send/receive, transfers, reductions) is ``idle``. With
tracing on it keeps every instruction as an event for a Chrome/Perfetto trace.
"""
from __future__ import annotations

import time

from mmpipe.parallel.ds_compat import wrap_instructions
from mmpipe.parallel.schedules import PASSES

CATEGORY = {"ForwardPass": "fwd", "BackwardPass": "bwd", "BackwardInputPass": "bwd", "BackwardWeightPass": "bwd",
            "OptimizerStep": "opt", "LoadMicroBatch": "data",
            "SendActivation": "comm", "RecvActivation": "comm", "SendGrad": "comm", "RecvGrad": "comm",
            "ReduceGrads": "reduce", "ReduceTiedGrads": "reduce"}
FIELDS = ("fwd", "bwd", "opt", "data", "comm", "reduce", "wall")


class StageClock:
    def __init__(self, engine):
        from deepspeed.accelerator import get_accelerator
        self.engine = engine
        self.acc = get_accelerator()
        self.on_cpu = self.acc.device_name() == "cpu"
        self.tracing = False
        self.events: list = []  # (instruction, buffer_id, start, end, step) in this process's perf_counter
        self.step = 0
        self._pending: list = []
        self.totals = dict.fromkeys(FIELDS, 0.0)
        self.passes: list = []  # the step's forward / backward passes in order: (is backward, seconds)
        self.stream: list = []  # this stage's actions in a step (``parallel.schedules``)
        self._t0 = None
        wrap_instructions(engine, self._wrap)

    def _wrap(self, name: str, fn):
        cat = CATEGORY.get(name, "other")
        clock = self

        def timed(engine, *args, **kwargs):
            if clock.on_cpu:
                t0 = time.perf_counter()
                out = fn(engine, *args, **kwargs)
                t1 = time.perf_counter()
                clock.totals[cat] = clock.totals.get(cat, 0.0) + (t1 - t0)
                if cat in ("fwd", "bwd"):
                    clock.passes.append((cat == "bwd", t1 - t0))
                if clock.tracing:
                    clock.events.append((name, kwargs.get("buffer_id"), t0, t1, clock.step))
                return out
            start, end = clock.acc.Event(enable_timing=True), clock.acc.Event(enable_timing=True)
            start.record()
            out = fn(engine, *args, **kwargs)
            end.record()
            clock._pending.append((name, cat, kwargs.get("buffer_id"), start, end))
            return out

        return timed

    def begin_step(self, step: int, trace: bool = False) -> None:
        self.step, self.tracing = step, trace
        self.totals = dict.fromkeys(FIELDS, 0.0)
        self._pending, self.passes = [], []
        if not self.on_cpu:
            self.acc.synchronize()
        self._t0 = time.perf_counter()

    def end_step(self) -> list[float]:
        """[fwd, bwd, opt, data, comm, reduce, wall] seconds of the step just finished."""
        if not self.on_cpu:
            self.acc.synchronize()
            origin = None
            for name, cat, buf, start, end in self._pending:
                dur = start.elapsed_time(end) / 1e3
                self.totals[cat] = self.totals.get(cat, 0.0) + dur
                if cat in ("fwd", "bwd"):
                    self.passes.append((cat == "bwd", dur))
                if self.tracing:  # device events carry durations, not host timestamps: lay them end to end
                    origin = self._t0 if origin is None else origin
                    self.events.append((name, buf, origin, origin + dur, self.step))
                    origin += dur
        self.totals["wall"] = time.perf_counter() - self._t0
        return [self.totals.get(k, 0.0) for k in FIELDS]

    def micro_batch_busy(self, micro_batches: int) -> list[float]:
        """Forward + backward seconds of each of the step's micro-batches on this stage: the k-th pass it
        ran is the k-th pass of its stream (``runtime.install_schedule``; a step loss's features pass
        first)."""
        out = [0.0] * micro_batches
        for (_, dur), a in zip(self.passes, [a for a in self.stream if a.kind in PASSES]):
            out[a.micro_batch] += dur
        return out


def stage_record(vectors: dict, num_stages: int) -> dict:
    """metrics.jsonl fields from {stage: [FIELDS...]} (mean over a stage's data-parallel ranks)."""
    rec = {}
    for s in range(num_stages):
        v = vectors[s]
        wall = v[FIELDS.index("wall")] or 1e-12
        busy = v[0] + v[1] + v[2]
        rec[f"stage{s}.busy"] = busy / wall
        rec[f"stage{s}.data"] = v[3] / wall
        rec[f"stage{s}.idle"] = max(0.0, 1.0 - (busy + v[3]) / wall)
        for i, k in enumerate(FIELDS):
            rec[f"stage{s}.{k}_ms"] = 1e3 * v[i]
    return rec


# ---- trace outputs ---------------------------------------------------------------------------------
COLORS = {"ForwardPass": "#4C72B0", "BackwardPass": "#DD8452", "BackwardInputPass": "#F0B27A",
          "BackwardWeightPass": "#C44E52", "OptimizerStep": "#55A868", "LoadMicroBatch": "#8172B3",
          "SendActivation": "#C7C7C7", "RecvActivation": "#AAAAAA", "SendGrad": "#D0D0D0", "RecvGrad": "#B5B5B5",
          "ReduceGrads": "#937860", "ReduceTiedGrads": "#937860"}


def write_trace(path: str, per_rank: list, coords: list) -> dict:
    """Chrome trace-event JSON (open in ui.perfetto.dev or chrome://tracing): one process per
    stage, one thread per rank, an ``X`` event per instruction (args: micro-batch buffer, step).
    ``per_rank[r]`` = (events, offset) with offset = time.time() - perf_counter() of that rank."""
    import json
    evs = []
    t_min = min((e[2] + off for events, off in per_rank for e in events), default=0.0)
    for r, (events, off) in enumerate(per_rank):
        stage, dp = coords[r]
        evs.append({"name": "process_name", "ph": "M", "pid": stage, "args": {"name": f"stage {stage}"}})
        evs.append({"name": "thread_name", "ph": "M", "pid": stage, "tid": r,
                    "args": {"name": f"rank {r} (data-parallel {dp})"}})
        for name, buf, t0, t1, step in events:
            evs.append({"name": name, "cat": CATEGORY.get(name, "other"), "ph": "X", "pid": stage, "tid": r,
                        "ts": round((t0 + off - t_min) * 1e6, 1), "dur": round((t1 - t0) * 1e6, 1),
                        "args": {"buffer": buf, "step": step}})
    trace = {"traceEvents": evs, "displayTimeUnit": "ms"}
    with open(path, "w") as fh:
        json.dump(trace, fh)
    return trace


def write_timeline_png(path: str, per_rank: list, coords: list, title: str = "") -> None:
    """Gantt chart of the traced steps: a row per rank (labelled by stage), a bar per instruction."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    t_min = min((e[2] + off for events, off in per_rank for e in events), default=0.0)
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.6 * len(per_rank)))
    for r, (events, off) in enumerate(per_rank):
        for name, buf, t0, t1, step in events:
            ax.broken_barh([((t0 + off - t_min) * 1e3, max((t1 - t0) * 1e3, 1e-3))], (r - 0.4, 0.8),
                           facecolors=COLORS.get(name, "#999999"))
    ax.set_yticks(range(len(per_rank)))
    ax.set_yticklabels([f"rank {r} / stage {coords[r][0]}" for r in range(len(per_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title or "pipeline timeline")
    ran = {e[0] for events, _ in per_rank for e in events}
    backward = [k for k in ("BackwardPass", "BackwardInputPass", "BackwardWeightPass") if k in ran] or ["BackwardPass"]
    shown = ["ForwardPass"] + backward + ["OptimizerStep", "LoadMicroBatch", "RecvActivation", "RecvGrad", "ReduceGrads"]
    ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in shown], loc="upper center",
              bbox_to_anchor=(0.5, -0.45), ncol=len(shown), fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

