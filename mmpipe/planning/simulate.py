"""Pipeline schedule simulator: predicts step time, per-stage busy/idle and the bubble.

It replays the run's pipeline order (``mmpipe.parallel.schedules``: per stage the stream the runtime
installs as the engine's schedule; ``1f1b`` is DeepSpeed's own, its deferred activation sends included)
with given durations: ``ForwardPass`` = F[s], ``BackwardPass`` = B[s] (a split backward's
``BackwardInputPass`` = B[s] - W[s], ``BackwardWeightPass`` = W[s]), ``OptimizerStep`` = opt[s],
``LoadMicroBatch`` = load[s]. Sends and receives are blocking rendezvous between neighbours (as
``torch.distributed.send/recv`` are): a pair starts when both sides reach it and takes the
boundary's transfer time. Any registered schedule (``gpipe``, ``frozen_first``, a plugin's) is
simulated by name.

Busy = forward + backward + optimizer + load; everything else in the step (waiting in a
send/receive, transfers) is idle. ``bubble`` is the mean idle fraction over stages.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mmpipe.parallel.schedules import Order, replay
from mmpipe.planning.memory import divisors


@dataclass
class SimResult:
    step_time: float
    busy: list  # seconds per stage
    idle_frac: list  # per stage
    bubble: float
    timeline: list = field(default_factory=list)  # (stage, kind, micro_batch, start, end)
    parts: Optional[list] = None  # the partition simulated, when known

    def to_dict(self) -> dict:
        return {"step_time": self.step_time, "busy": self.busy, "idle_frac": self.idle_frac, "bubble": self.bubble,
                "parts": self.parts}


BUSY_KINDS = ("ForwardPass", "BackwardPass", "OptimizerStep", "LoadMicroBatch", "FeaturesPass", "BackwardInputPass",
              "BackwardWeightPass")


def simulate(F: list, B: list, micro_batches: int, comm: Optional[list] = None, opt: Optional[list] = None,
             load: Optional[list] = None, comm_grad: Optional[list] = None, stretch: Optional[list] = None,
             step_loss: bool = False, gather: float = 0.0, first_pass: Optional[list] = None,
             W: Optional[list] = None, *, order: Order) -> SimResult:
    """The step of ``order`` (``mmpipe.parallel.schedules``). ``F``, ``B``, ``opt``, ``load``: seconds per stage
    (``F``/``B``: or per stage a list over micro-batches); ``W``: the seconds of ``B`` a split backward
    defers (per stage; default none); ``comm[s]``: seconds to move one
    micro-batch's activations across the boundary between stage s and s+1, ``comm_grad[s]`` its
    gradients back (default: ``comm[s]``); ``stretch[s][i]``: a factor on the duration of stage s's
    i-th instruction (``simulate_shared_cores``); ``step_loss``: a forward-only pass first, its
    forwards ``first_pass[s]`` seconds (default ``F``; then ``F`` is the training pass's, less a
    frozen prefix it takes from the first pass), and ``gather`` seconds on the last stage between
    the passes."""
    P, M = len(F), micro_batches
    comm = comm if comm is not None else [0.0] * max(0, P - 1)
    back = comm_grad if comm_grad is not None else comm
    opt = opt if opt is not None else [0.0] * P
    load = load if load is not None else [0.0] * P
    first_pass = first_pass if first_pass is not None else F
    W = W if W is not None else [0.0] * P
    sts = order.streams(P, M, step_loss)
    per = {"ForwardPass": F, "FeaturesPass": first_pass, "BackwardPass": B, "BackwardInputPass": B}
    own = {"OptimizerStep": opt, "LoadMicroBatch": load}

    def duration(s, a, i):
        if a.kind == "BackwardWeightPass":
            d = W[s]
        elif a.kind in per:
            d = per[a.kind][s]
            d = d[a.micro_batch] if isinstance(d, (list, tuple)) else d
            d = d - W[s] if a.kind == "BackwardInputPass" else d
        elif a.kind in own:
            d = own[a.kind][s]
        else:
            d = gather if a.kind == "GatherFeatures" else 0.0
        return d * stretch[s][i] if stretch else d

    def transfer(s, t, a):
        return (comm if a.kind in ("SendActivation", "RecvActivation") else back)[min(s, t)]

    steps = []
    clock = replay(sts, duration, transfer, steps)
    timeline = [e[:5] for e in steps]
    busy = [0.0] * P
    for s, kind, _, a, b in timeline:
        if kind in BUSY_KINDS:
            busy[s] += b - a
    step = max(clock)
    idle = [1.0 - b / step if step > 0 else 0.0 for b in busy]
    return SimResult(step, busy, idle, sum(idle) / P, timeline)


def simulate_shared_cores(F: list, B: list, micro_batches: int, comm: Optional[list], opt: Optional[list],
                          comm_grad: Optional[list], replicas: int, threads: int, cores: int, slope: float = 1.0,
                          iters: int = 40, step_loss: bool = False, gather: float = 0.0,
                          first_pass: Optional[list] = None, W: Optional[list] = None, *, order: Order) -> tuple:
    """The schedule when the stages' ranks (``replicas`` data-parallel copies of the pipeline, each
    rank ``threads`` threads) share ``cores``: each compute instruction runs slower by the
    oversubscription o = ranks computing at once x threads / cores while it runs: 1 + (o - 1) x
    ``slope`` where o > 1 (slope 1: a fair share of the cores; measured here 1.15: 4 ranks on 2
    cores ran 2.15x slower, not 2x), found by iterating the timeline to a fixed point. A pipeline's fill and drain leave cores free; its
    steady state, where every stage computes, does not (one uniform factor from the mean load had
    predicted 4 stages on 2 cores 8-11% fast). Returns (SimResult, stretch per instruction)."""
    import bisect
    P = len(F)
    sts = order.streams(P, micro_batches, step_loss)
    stretch = [[1.0] * len(st) for st in sts]
    kinds_of = [[i for i, a in enumerate(st) if a.kind in BUSY_KINDS] for st in sts]
    extra = {"step_loss": step_loss, "gather": gather, "first_pass": first_pass, "W": W}
    r = simulate(F, B, micro_batches, comm, opt, comm_grad=comm_grad, order=order, **extra)
    for it in range(iters):
        busy = [(s, a, b) for s, kind, _, a, b in r.timeline if kind in BUSY_KINDS]  # stream order per stage
        edges = sorted({t for _, a, b in busy for t in (a, b)})
        count = [0] * len(edges)  # busy stages on [edges[k], edges[k+1])
        for _, a, b in busy:
            for k in range(bisect.bisect_left(edges, a), bisect.bisect_left(edges, b)):
                count[k] += 1
        new = [[1.0] * len(st) for st in sts]
        idx = [0] * P  # the timeline's busy entries of a stage, in stream order
        for s, a, b in busy:
            i = kinds_of[s][idx[s]]
            idx[s] += 1
            if b > a:
                lo, hi = bisect.bisect_left(edges, a), bisect.bisect_left(edges, b)
                mean = sum(count[k] * (edges[k + 1] - edges[k]) for k in range(lo, hi)) / (b - a)
                new[s][i] = 1.0 + max(0.0, replicas * mean * threads / cores - 1.0) * slope
        moved = max(abs(x - y) for u, v in zip(stretch, new) for x, y in zip(u, v))
        w = 1.0 if it == 0 else 0.5  # damped after the first update (stretching one stage moves the others)
        stretch = [[(1 - w) * x + w * y for x, y in zip(u, v)] for u, v in zip(stretch, new)]
        r = simulate(F, B, micro_batches, comm, opt, comm_grad=comm_grad, stretch=stretch, order=order, **extra)
        if moved < 1e-4:
            break
    return r, stretch


def bubble_formula(stages: int, micro_batches: int) -> float:
    """Idle share of an ideal 1F1B/GPipe step with equal stages and free transfers."""
    return (stages - 1) / (micro_batches + stages - 1)


def recommend_micro_batches(F: list, B: list, comm: list, opt: list, per_rank_batch: int, target_bubble: float,
                            stage_peak_bytes=None, budget_bytes: Optional[int] = None, W: Optional[list] = None, *,
                            order: Order) -> dict:
    """The fewest micro-batches per step (a divisor of the per-rank batch, so the global batch
    holds) whose simulated bubble is under ``target_bubble``. ``F``/``B`` are per micro-batch of
    the *current* size; a count M means micro-batches of per_rank_batch / M samples, with times
    scaled linearly (a lower bound on small micro-batches, which run less efficiently).
    ``stage_peak_bytes(M)`` (optional) gives the fullest stage's peak memory for M; ``order``: the run's pipeline
    order (``W``: the seconds of ``B`` it defers, per stage)."""
    W = W if W is not None else [0.0] * len(F)
    rows = []
    for M in divisors(per_rank_batch):
        scale = 1.0 / M
        r = simulate([f * scale for f in F], [b * scale for b in B], M, [c * scale for c in comm], opt,
                     W=[w * scale for w in W], order=order)
        fits = budget_bytes is None or stage_peak_bytes is None or stage_peak_bytes(M) <= budget_bytes
        rows.append({"micro_batches": M, "micro_batch_size": per_rank_batch // M, "bubble": r.bubble,
                     "step_time": r.step_time, "fits": fits})
    ok = [r for r in rows if r["bubble"] <= target_bubble and r["fits"]]
    best = ok[0] if ok else None
    why = None
    if best is None:
        feasible = [r for r in rows if r["fits"]]
        lowest = min(feasible, key=lambda r: r["bubble"]) if feasible else None
        # the bubble left with (nearly) unlimited micro-batches is the stages' imbalance
        big = 1024
        floor = simulate([f / big for f in F], [b / big for b in B], big, [c / big for c in comm], opt,
                         W=[w / big for w in W], order=order).bubble
        cause = (f"the stages are unbalanced: even unlimited micro-batches leave a {floor:.0%} bubble; balance them "
                 "(parallel.placement=auto)" if floor > target_bubble else
                 f"the per-rank batch of {per_rank_batch} allows at most {rows[-1]['micro_batches']} micro-batches; "
                 "raise train.batch_size")
        why = (f"no micro-batch count gets the bubble under {target_bubble:.0%}"
               + (f" (best: {lowest['micro_batches']} with {lowest['bubble']:.0%})" if lowest else "") + f": {cause}")
    return {"rows": rows, "best": best, "why": why}
