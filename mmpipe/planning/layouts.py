"""Which parallel layout should a run use? A cost model for every layout of N ranks, and the chooser.

From the layer profile (``mmpipe.planning.measure.get_profile``: forward/backward/optimizer time, activation,
parameter and output bytes per layer, at the run's micro-batch and threads per rank) and measured
collective costs (``CommModel``: all-reduce, reduce-scatter and all-gather latency + seconds per
byte per group size, and stage-to-stage send/recv, on the run's backend), predict per optimizer
step, for a world of N ranks and a global batch B of micro-batches of m samples:

- **data parallel** (P = 1) with ZeRO 0/1/2/3, M = B / (m N) micro-batches per rank:
  step = M (F + B) + optimizer + collectives, where the collectives are
  ZeRO-0: all-reduce(gradients); ZeRO-1: the same + all-gather(weights) after the sharded step;
  ZeRO-2: all-reduce(gradients) per micro-batch (DeepSpeed's bucket reduction; each rank keeps its
  partition) + all-gather(weights), plus its hooks and bucket copies per micro-batch and its step
  beyond ZeRO-0's share (measured per tensor and per byte: ``CommModel.zero2``);
  ZeRO-3: per micro-batch all-gather(weights) for forward and again for backward + reduce-scatter(gradients).
  Memory per rank: weights + gradients + optimizer state (ZeRO-1 shards the optimizer state, ZeRO-2
  also the gradients, ZeRO-3 everything, plus the largest layer gathered) + one micro-batch's
  activations.
- **pipelines** P | N with DP = N / P, modality and auto placement, ZeRO 0/1: DeepSpeed's 1F1B
  schedule replayed by ``mmpipe.planning.simulate`` with the stages' costs and the measured
  send/recv, then the data-parallel all-reduce of the largest stage's gradients (and, under ZeRO-1,
  its sharded step and all-gather). Memory per stage: ``mmpipe.planning.profiler.stage_memory``.

When the N ranks share fewer cores than they compute with (N x threads > cores, this CPU machine),
compute is stretched by that oversubscription (measured, ``oversubscription``); ranks that each have
their own cores are not stretched (the cache-cold profile already charges the shared cache). Every layout that does not fit the memory budget says
why. ``choose`` takes the fastest that fits, or within ``TIE`` of it the simplest.
"""
from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import Optional

OPS = ("allreduce", "allgather", "reduce_scatter")


@dataclass
class CommModel:
    """Collective and point-to-point costs: ``ops[op][n] = (latency s, s per byte)`` for a group of
    n ranks (bytes = the full buffer: the gradients reduced, the weights gathered); ``p2p``: one
    send/recv of a buffer."""
    backend: str = "gloo"
    ops: dict = field(default_factory=dict)
    p2p: tuple = (0.0, 0.0)
    measured: bool = False
    # ZeRO-3's fixed cost per module, bandwidth excluded, by group size: (per pass (forward or
    # backward) of a module whose parameters are partitioned and gathered, per pass of one whose
    # parameters stay persistent, per optimizer step of a partitioned one, per step of a persistent
    # one: DeepSpeed all-gathers every persistent parameter after each step, one tensor at a time)
    zero3: dict = field(default_factory=dict)
    # ZeRO-2's cost beyond ZeRO-0's (whose all-reduce of the same bytes the model already charges),
    # by group size: (per parameter tensor per micro-batch: its gradient hook and bucket bookkeeping,
    # per gradient byte per micro-batch: the copies into and out of the reduce buckets, per gradient
    # byte per optimizer step beyond the 1/n share of ZeRO-0's step): measured by DeepSpeed runs
    zero2: dict = field(default_factory=dict)
    # CPU only: how much slower one rank computes when n single-thread ranks compute at once on this
    # machine's cores, measured (time-sharing and the shared cache and memory included), by n
    stretch: dict = field(default_factory=dict)

    def zero3_module(self, n: int) -> Optional[tuple]:
        if n <= 1 or not self.zero3:
            return None
        table = {int(k): v for k, v in self.zero3.items()}
        k = n if n in table else min(table, key=lambda x: abs(x - n))
        v = (tuple(table[k]) + (0.0, 0.0))[:4]  # an older 2-value entry: no step cost measured
        if k == n:
            return v
        # hooks are per rank; the gather latencies (a pass's and the step's) grow like a ring
        return tuple(x * (n - 1) / max(1, k - 1) if i != 1 else x for i, x in enumerate(v))

    def zero2_costs(self, n: int) -> Optional[tuple]:
        """(s per tensor per micro-batch, s per byte per micro-batch, s per byte per step) at n ranks
        (the nearest measured group size: these are per-rank copies and hooks), None if unmeasured."""
        if n <= 1 or not self.zero2:
            return None
        table = {int(k): v for k, v in self.zero2.items()}
        return tuple(table[n if n in table else min(table, key=lambda x: abs(x - n))])

    def time(self, op: str, n: int, nbytes: float) -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        table = {int(k): v for k, v in self.ops.get(op, {}).items()}
        if not table:
            return 0.0
        if n in table:
            lat, spb = table[n]
            return lat + spb * nbytes
        # ring scaling from the nearest measured group size: latency ~ (n-1), bytes ~ (n-1)/n
        k = min(table, key=lambda x: abs(x - n))
        lat, spb = table[k]
        return lat * (n - 1) / max(1, k - 1) + spb * nbytes * ((n - 1) / n) / ((k - 1) / k)

    @classmethod
    def median(cls, models: list) -> "CommModel":
        """One model from several measurements of the same backend: every figure (each op's latency
        and seconds per byte, send/recv, the ZeRO-3 costs, the stretch) is its median over them."""
        def med(values):
            return tuple(statistics.median(v) for v in zip(*values))
        first = models[0]
        ops = {op: {n: med([m.ops[op][n] for m in models if n in m.ops.get(op, {})]) for n in t}
               for op, t in first.ops.items()}
        zero3 = {n: med([m.zero3[n] for m in models if n in m.zero3]) for n in first.zero3}
        zero2 = {n: med([m.zero2[n] for m in models if n in m.zero2]) for n in first.zero2}
        stretch = {n: statistics.median(m.stretch[n] for m in models if n in m.stretch) for n in first.stretch}
        return cls(first.backend, ops, med([m.p2p for m in models]), all(m.measured for m in models), zero3, zero2,
                   stretch)

    def to_dict(self) -> dict:
        return {"backend": self.backend, "ops": {op: {str(n): list(v) for n, v in t.items()} for op, t in self.ops.items()},
                "p2p": list(self.p2p), "measured": self.measured,
                "zero3": {str(n): list(v) for n, v in self.zero3.items()},
                "zero2": {str(n): list(v) for n, v in self.zero2.items()},
                "stretch": {str(n): v for n, v in self.stretch.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "CommModel":
        return cls(d["backend"], {op: {int(n): tuple(v) for n, v in t.items()} for op, t in d["ops"].items()},
                   tuple(d["p2p"]), d.get("measured", True),
                   {int(n): tuple(v) for n, v in d.get("zero3", {}).items()},
                   {int(n): tuple(v) for n, v in d.get("zero2", {}).items()},
                   {int(n): float(v) for n, v in d.get("stretch", {}).items()})


# ---- memory -------------------------------------------------------------------------------------------
def state_bytes(precision: str) -> tuple[int, int, int]:
    """(weight, gradient, optimizer-state) bytes per trainable parameter: fp32 = 4, 4, 8 (Adam m, v);
    bf16/fp16 = 2, 2, 16 (fp32 master, m, v and the fp32 gradient accumulator)."""
    return (4, 4, 8) if precision == "fp32" else (2, 2, 16)


def dp_memory(costs: list, precision: str, zero: int, n: int) -> int:
    """Peak bytes of one data-parallel rank holding the whole model (see the module doc)."""
    w, g, o = state_bytes(precision)
    trainable = sum(c.trainable for c in costs)
    frozen = sum(c.params - c.trainable for c in costs)
    if zero == 0:
        static = trainable * (w + g + o)
    elif zero == 1:
        static = trainable * (w + g + o / n)
    elif zero == 2:
        static = trainable * (w + (g + o) / n)
    else:  # everything sharded; the largest layer is gathered whole (weights, and gradients in backward)
        static = trainable * (w + g + o) / n + max((c.params * w + c.trainable * g) for c in costs)
    static += frozen * w / (n if zero == 3 else 1)
    acts = sum(c.act_bytes for c in costs) + max(c.out_bytes for c in costs)
    return int(static + acts)


def optimizer_state_bytes(costs: list, precision: str, zero: int, dp: int, parts: Optional[list] = None) -> float:
    """Optimizer state on the fullest rank: the largest stage's (or, without ``parts``, the whole
    model's) trainable parameters times the state bytes per parameter, sharded over ``dp`` ranks
    from ZeRO-1 on (the term ``dp_memory`` and ``stage_memory`` count)."""
    o = state_bytes(precision)[2]
    spans = list(zip(parts, parts[1:])) if parts else [(0, len(costs))]
    trainable = max(sum(c.trainable for c in costs[a:b]) for a, b in spans)
    return trainable * o / (dp if zero >= 1 else 1)


# ---- prediction ---------------------------------------------------------------------------------------
@dataclass
class LayoutPrediction:
    name: str
    pipeline_stages: int
    data_parallel: int
    zero_stage: int
    placement: Optional[str]
    micro_batches: int  # per data-parallel rank per step
    step_time: float = float("nan")
    samples_per_s: float = 0.0
    bubble: float = 0.0
    memory: list = field(default_factory=list)  # peak bytes per stage (DP: one entry)
    compute: float = 0.0
    comm: float = 0.0
    fits: bool = True
    why: str = ""  # why it does not fit / cannot run
    parts: Optional[list] = None
    clipping: str = "grouped"

    @property
    def peak(self) -> int:
        return max(self.memory) if self.memory else 0

    def to_dict(self) -> dict:
        return {**asdict(self), "peak": self.peak}


def _scaled(prof: dict, factor: float) -> dict:
    if factor == 1.0:
        return prof
    layers = [{**c, "fwd_ms": c["fwd_ms"] * factor, "bwd_ms": c["bwd_ms"] * factor, "opt_ms": c["opt_ms"] * factor}
              for c in prof["layers"]]
    return {**prof, "layers": layers}


def oversubscription(world: int, threads: int, cores: Optional[int], measured: Optional[dict] = None) -> float:
    """How much slower each rank computes when ``world`` ranks of ``threads`` threads share ``cores``:
    1 while every thread has a core of its own (the layer profile is timed cache-cold, so sharing
    the last-level cache and memory is already in it: two single-thread ranks each running the
    image-heavy model at once took 68.7 / 133 ms forward / backward per micro-batch, the cold
    profile 69.1 / 136, here); beyond that, the measured stretch for that many ranks
    (``CommModel.stretch``: time-sharing a core, where each slice starts on a cache the other rank
    filled) where there is one, else the share of a core each thread gets."""
    if not cores or world * threads <= cores:
        return 1.0
    if measured and threads == 1 and world in measured:
        return max(1.0, measured[world])
    return max(1.0, world * threads / cores)


def predict_layouts(prof: dict, comm: CommModel, world: int, batch_size: int, micro_batch_size: int,
                    precision: str, names: list, segments: list, memory_budget: Optional[int] = None,
                    cores: Optional[int] = None, zero_stages=(0, 1, 2, 3), placements=("modality", "auto"),
                    max_pipeline: Optional[int] = None, grouped_clip: bool = False,
                    fetch_units=None) -> list:
    """Every layout of ``world`` ranks (see the module doc), predicted; a list of ``LayoutPrediction``.
    ``fetch_units``: (modules whose parameters ZeRO-3 partitions, modules whose parameters it keeps
    persistent, the persistent parameters' element count, parameter tensors), or one count of
    partitioned modules; ZeRO-3 fetches each partitioned module separately, twice per micro-batch,
    and all-gathers the persistent parameters after each step; ZeRO-2 hooks every parameter tensor.
    Default: one partitioned module (and one tensor) per layer."""
    ctx = _Ctx(prof, comm, world, batch_size, micro_batch_size, precision, cores)
    units = fetch_units if isinstance(fetch_units, tuple) else (fetch_units or len(ctx.costs), 0)
    units = tuple(units)[:4]
    units = units + (0,) * max(0, 3 - len(units)) + ((len(ctx.costs),) if len(units) < 4 else ())
    out = [_dp_row(ctx, z, grouped_clip, units) for z in zero_stages if world > 1 or z == 0]
    for P in range(2, min(world, max_pipeline or len(names)) + 1):
        if world % P:
            continue
        D = world // P
        for z in (0, 1) if D > 1 else (0,):
            out += [_pp_row(ctx, P, D, z, pl, names, segments) for pl in placements]
    if memory_budget:
        for row in out:
            if row.fits and row.peak > memory_budget:
                row.fits = False
                row.why = (f"needs {row.peak / 2**30:.2f} GB on its fullest rank, over the "
                           f"{memory_budget / 2**30:.2f} GB budget")
    return out


class _Ctx:
    """What every layout's prediction shares: the raw profile, the data-parallel stretch, sizes."""

    def __init__(self, prof, comm, world, batch_size, micro_batch_size, precision, cores):
        from mmpipe.planning.place import layer_costs
        self.raw, self.comm, self.world, self.batch = prof, comm, world, batch_size
        self.mbs, self.precision, self.cores = micro_batch_size, precision, cores
        self.threads = int(prof.get("key", {}).get("threads", 1))
        # data parallel: every rank always computes
        self.over = oversubscription(world, self.threads, cores, comm.stretch)
        # stretch per unit of oversubscription beyond 1 (measured: over at the fair share), so that
        # a pipeline moment with fewer ranks computing pays proportionally less
        fair = oversubscription(world, self.threads, cores)
        self.slope = (self.over - 1) / (fair - 1) if fair > 1 else 1.0
        self.costs = layer_costs(_scaled(prof, self.over))
        self.w_b, self.g_b, _ = state_bytes(precision)

    def micro_batches(self, row, dp: int) -> int:
        if self.batch % (self.mbs * dp):
            row.fits, row.why = False, f"batch {self.batch} is not a multiple of micro-batch {self.mbs} x {dp}"
            return 0
        return self.batch // (self.mbs * dp)


def _dp_row(ctx: _Ctx, z: int, grouped_clip: bool, units: tuple) -> LayoutPrediction:
    n, comm, costs = ctx.world, ctx.comm, ctx.costs
    row = LayoutPrediction(f"DP{n} ZeRO-{z}" if n > 1 else "single process", 1, n, z, None, 0,
                           clipping="grouped" if z < 2 else "DeepSpeed global")
    M = row.micro_batches = ctx.micro_batches(row, n)
    if not M:
        return row
    if z >= 2 and grouped_clip:
        row.fits, row.why = False, "per-group max_grad_norm needs ZeRO 0/1"
    fb = sum(c.fwd_ms + c.bwd_ms for c in costs) / 1e3
    opt = sum(c.opt_ms for c in costs) / 1e3
    G = sum(c.trainable for c in costs) * ctx.g_b
    W = sum(c.params for c in costs) * ctx.w_b
    if z == 0:
        cm = comm.time("allreduce", n, G)
    elif z == 1:
        cm = comm.time("allreduce", n, G) + comm.time("allgather", n, W)
    elif z == 2:
        # DeepSpeed's ZeRO-2 reduces each micro-batch's gradient buckets by all-reduce (its default
        # use_multi_rank_bucket_allreduce) and keeps its own partition; gloo's reduce-scatter costs 5x
        # the all-reduce per byte here, so which one it runs matters
        cm = M * comm.time("allreduce", n, G) + comm.time("allgather", n, W)
    else:  # every partitioned module fetched for forward and again for backward; after the step,
        # the updated persistent parameters all-gathered (their latency is in the measured step cost)
        kept = units[2] * ctx.w_b
        cm = M * (2 * comm.time("allgather", n, W - kept) + comm.time("reduce_scatter", n, G))
        if kept:
            cm += comm.time("allgather", n, kept) - comm.time("allgather", n, 1.0)
    fixed = 0.0
    z2 = comm.zero2_costs(n) if z == 2 else None
    if z2:  # measured with n ranks at once (their contention included): not stretched again
        tensors, gbytes = units[3], sum(c.trainable for c in costs) * 4  # (fp32 buckets)
        fixed = M * (tensors * z2[0] + gbytes * z2[1]) + gbytes * z2[2]
    if z == 3:
        per = comm.zero3_module(n)
        if per:  # measured with n ranks at once (their contention included): not stretched again
            fixed = M * 2 * (units[0] * per[0] + units[1] * per[1]) + units[0] * per[2] + units[1] * per[3]
        else:  # unmeasured: one gather latency per further module
            cm += M * 2 * (units[0] + units[1] - 1) * comm.time("allgather", n, 1.0)
    row.compute = M * fb + (opt / n if z >= 1 else opt)
    row.comm = cm * ctx.over + fixed  # collectives between oversubscribed ranks wait for the cores too
    row.step_time = row.compute + row.comm
    row.samples_per_s = ctx.batch / row.step_time
    row.memory = [dp_memory(costs, ctx.precision, z, n)]
    return row


def _pp_row(ctx: _Ctx, P: int, D: int, z: int, pl: str, names: list, segments: list) -> LayoutPrediction:
    from mmpipe.errors import ConfigError
    from mmpipe.planning.place import place, predict, stage_times
    from mmpipe.planning.profiler import stage_memory
    tag = f"PP{P}" + (f"xDP{D}" if D > 1 else "") + f" {pl}" + (f" ZeRO-{z}" if D > 1 else "")
    row = LayoutPrediction(tag, P, D, z, pl, 0)
    M = row.micro_batches = ctx.micro_batches(row, D)
    if not M:
        return row
    try:
        plan = place(names, segments, P, pl, M, prof=_scaled(ctx.raw, ctx.over), micro_batch_size=ctx.mbs,
                     precision=ctx.precision, zero_stage=z, data_parallel=D)
    except ConfigError as e:
        row.fits, row.why = False, str(e)
        return row
    parts = row.parts = list(plan.parts)
    row.placement = pl if pl != "auto" else f"auto:{plan.chosen or pl}"
    # oversubscription counts the ranks busy at once, instruction by instruction: a pipeline's
    # waiting stages free their cores (fill, drain, imbalance), its steady state does not
    t = stage_times(ctx.raw, parts)
    if ctx.cores and D * P * ctx.threads > ctx.cores:
        from mmpipe.planning.simulate import simulate_shared_cores
        sim, _ = simulate_shared_cores(t["F"], t["B"], M, t["comm"], t["opt"], t["comm_grad"], D, ctx.threads,
                                       ctx.cores, ctx.slope)
        raw_busy = [M * (a + b) + o for a, b, o in zip(t["F"], t["B"], t["opt"])]
        f = sum(sim.busy) / sum(raw_busy) if sum(raw_busy) else 1.0  # the mean stretch, for what follows
    else:
        sim, f = predict(ctx.raw, parts, M), 1.0
    sprof = _scaled(ctx.raw, f)
    t = stage_times(sprof, parts)
    dp_comm = opt_saving = 0.0
    for s in range(P):
        G = sum(c.trainable for c in ctx.costs[parts[s]:parts[s + 1]]) * ctx.g_b
        W = sum(c.params for c in ctx.costs[parts[s]:parts[s + 1]]) * ctx.w_b
        c_s = (ctx.comm.time("allreduce", D, G) + (ctx.comm.time("allgather", D, W) if z == 1 else 0.0)) * f
        dp_comm = max(dp_comm, c_s)
        if z == 1:
            opt_saving = max(opt_saving, t["opt"][s] * (1 - 1 / D))
    row.step_time = sim.step_time - opt_saving + dp_comm
    row.compute = M * max(a + b for a, b in zip(t["F"], t["B"]))
    row.comm = dp_comm + sim.step_time - max(sim.busy)  # waiting, transfers and the reduction
    row.bubble = sim.bubble
    row.samples_per_s = ctx.batch / row.step_time
    row.memory = stage_memory(ctx.costs, parts, M, ctx.precision, z, D)
    return row


TIE = 0.05  # predictions this close are a tie: the model's error on this machine is larger


def choose(rows: list, tie: float = TIE) -> tuple:
    """(the layout to run, one line saying why): of the layouts that fit, those predicted within
    ``tie`` of the fastest, the one with the fewest pipeline stages, then the lowest ZeRO stage,
    then the fastest. A deeper pipeline or a higher ZeRO stage adds hops, bubbles and collectives
    the model only estimates; a few percent of predicted gain does not pay for that risk."""
    ok = sorted((r for r in rows if r.fits), key=lambda r: r.step_time)
    if not ok:
        from mmpipe.errors import ConfigError
        raise ConfigError("parallel.layout=auto: no layout fits: " + "; ".join(f"{r.name}: {r.why}" for r in rows)
                          + " (raise parallel.memory_budget_gb, use more ranks, or freeze/shrink the model)")
    near = [r for r in ok if r.step_time <= ok[0].step_time * (1 + tie)]
    best = min(near, key=lambda r: (r.pipeline_stages, r.zero_stage, r.step_time))
    others = [r for r in ok if r is not best]
    runner_up = f", next {others[0].name} {1e3 * others[0].step_time:.1f} ms" if others else ""
    simpler = (f" (within {tie:.0%} of the fastest, {ok[0].name} {1e3 * ok[0].step_time:.1f} ms, with fewer "
               f"stages or a lower ZeRO stage)" if best is not ok[0] else "")
    dropped = [r.name for r in rows if not r.fits]
    why = (f"{'fastest predicted step' if best is ok[0] else 'predicted step'} that fits: {best.name} "
           f"{1e3 * best.step_time:.1f} ms{simpler}{runner_up}" + (f"; not fitting: {', '.join(dropped)}" if dropped else ""))
    return best, why


def format_table(rows: list, chosen: Optional[LayoutPrediction], batch_size: int) -> str:
    lines = ["| layout | step ms | samples/s | bubble | peak MB/rank | compute ms | comm+wait ms | clipping | fits |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (not r.fits, r.step_time if r.step_time == r.step_time else 1e9)):
        mark = " **chosen**" if chosen is not None and r.name == chosen.name else ""
        if r.micro_batches == 0:
            lines.append(f"| {r.name} | - | - | - | - | - | - | {r.clipping} | no: {r.why} |")
            continue
        fits = "yes" if r.fits else f"no: {r.why}"
        lines.append(f"| {r.name}{mark} | {1e3 * r.step_time:.1f} | {r.samples_per_s:.1f} | {r.bubble:.0%} | "
                     f"{r.peak / 2**20:.1f} | {1e3 * r.compute:.1f} | {1e3 * r.comm:.1f} | {r.clipping} | {fits} |")
    return "\n".join(lines)


def write_png(path: str, rows: list, chosen: Optional[LayoutPrediction] = None,
              measured: Optional[dict] = None, title: str = "") -> None:
    """Predicted step time (and measured, if given) per layout; layouts that do not fit hatched."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in rows if r.micro_batches]
    fig, ax = plt.subplots(figsize=(2 + 0.9 * len(rows), 4))
    xs = range(len(rows))
    ax.bar(xs, [1e3 * r.step_time for r in rows], 0.4 if measured else 0.7,
           color=["C2" if chosen is not None and r.name == chosen.name else "C0" for r in rows],
           hatch=None, label="predicted")
    for i, r in enumerate(rows):
        if not r.fits:
            ax.text(i, 1e3 * r.step_time, "does not fit", ha="center", va="bottom", fontsize=7, rotation=90)
    if measured:
        ax.bar([i + 0.4 for i in xs], [1e3 * measured.get(r.name, float("nan")) for r in rows], 0.4, color="C1",
               label="measured")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r.name for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms per step")
    ax.set_title(title or "layouts: predicted step time (green: chosen)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- measuring the collectives --------------------------------------------------------------------------
def _coll_worker(rank: int, n: int, port: int, sizes: list, repeats: int, backend: str, device: str, out) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(n),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import deepspeed
    if device == "cpu":  # as a training rank runs (and no shared-memory buffer left in /dev/shm)
        from mmpipe.parallel.cpu_process import keep_freed_memory
        from mmpipe.parallel.ds_compat import skip_cpu_shm_allreduce
        keep_freed_memory()
        skip_cpu_shm_allreduce()
    deepspeed.init_distributed(backend, verbose=False)
    res = {op: {} for op in OPS}
    res["p2p"] = {}
    for nbytes in sizes:
        numel = max(n, nbytes // 4 // n * n)
        full = torch.zeros(numel, dtype=torch.float32, device=device)
        shard = torch.zeros(numel // n, dtype=torch.float32, device=device)
        ops = {"allreduce": lambda: dist.all_reduce(full),
               "allgather": lambda: dist.all_gather_into_tensor(full, shard),
               "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full)}
        if n == 2:
            from mmpipe.planning.profiler import pingpong
            ops["p2p"] = lambda: pingpong(rank, full)
        for op, f in ops.items():
            if op == "p2p":  # half a round trip, its mean: a pipeline pays the slow transfers too
                from mmpipe.planning.profiler import P2P_REPEATS
                res[op][numel * 4] = _median_time(f, P2P_REPEATS, stat=statistics.mean) / 2
            else:
                res[op][numel * 4] = _median_time(f, repeats)
    res["zero3"] = _zero3_probe(device, repeats)
    res["stretch"] = _stretch_probe(rank) if device == "cpu" else 1.0
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def _median_time(f, repeats: int, after=None, stat=None) -> float:
    """Median (or ``stat``) over ``repeats`` (after 2 warm-ups) of ``f`` started together on every
    rank; ``after`` (untimed) runs after each."""
    import time

    import torch.distributed as dist
    times = []
    for _ in range(repeats + 2):
        dist.barrier()
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
        if after is not None:
            after()
    return (stat or statistics.median)(times[2:])


def _stretch_probe(rank: int, iters: int = 30) -> float:
    """Median time of a transformer-sized MLP forward + backward with every rank computing at once,
    over its time with rank 0 computing alone (the others block in a barrier)."""
    import time

    import torch
    import torch.distributed as dist
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    x = torch.randn(256, 256)

    def work() -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            mlp(x).sum().backward()
        return time.perf_counter() - t0
    work()  # warm-up
    alone, together = [], []
    for _ in range(5):  # interleaved, so a drift of this machine's speed hits both alike
        dist.barrier()
        if rank == 0:
            alone.append(work())
        dist.barrier()
        together.append(work())
    t = torch.tensor([statistics.median(together)])
    dist.all_reduce(t)  # the mean over ranks
    return float(t) / dist.get_world_size() / statistics.median(alone) if rank == 0 else 0.0


ZERO3_PERSISTENCE = 100_000  # DeepSpeed's stage3_param_persistence_threshold default (numel)


def _zero3_probe(device: str, repeats: int, modules: int = 16) -> dict:
    """DeepSpeed ZeRO-3's cost per module per pass on this backend: forward + backward of a chain of
    ``modules`` tiny-input modules under a ZeRO-3 engine minus under a ZeRO-0 engine, for modules
    whose weights are partitioned (a 512x256 Linear, above the persistence threshold: gathered and
    released every pass) and modules small enough to stay persistent (LayerNorm(256): hooks only);
    and the optimizer step's cost per module beyond ZeRO-0's, timed alone."""
    import logging

    import deepspeed
    import torch
    from deepspeed.utils import logger
    from torch import nn
    logger.setLevel(logging.ERROR)

    class Chain(nn.Module):
        def __init__(self, big: bool):
            super().__init__()
            self.big = big
            self.m = nn.ModuleList(nn.Linear(512, 256) if big else nn.LayerNorm(256) for _ in range(modules))

        def forward(self, x):
            for m in self.m:
                y = m(x)
                x = torch.cat([y, y], -1) if self.big else y
            return x.sum()

    res = {}
    n = torch.distributed.get_world_size()
    for big in (True, False):
        t, s = {}, {}
        for z in (0, 2, 3):
            net = Chain(big)
            cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                   "zero_optimization": {"stage": z}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
            eng, *_ = deepspeed.initialize(model=net, config=cfg, model_parameters=net.parameters())
            x = torch.randn(1, 512 if big else 256, device=device)
            # forward + backward timed, each followed by a step, as in training; then the step alone
            t[z] = _median_time(lambda: eng.backward(eng(x)), repeats, after=eng.step)
            eng.backward(eng(x))
            s[z] = _median_time(eng.step, repeats, after=lambda: eng.backward(eng(x)))
            if hasattr(eng, "destroy"):
                eng.destroy()
        key = "partitioned" if big else "persistent"
        res[key] = max(0.0, (t[3] - t[0]) / (2 * modules))
        # ZeRO-3's step beyond its 1/n share of ZeRO-0's (which the cost model already charges)
        res[key + "_step"] = max(0.0, (s[3] - s[0] / n) / modules)
        # ZeRO-2, per micro-batch (forward + backward; the same all-reduce as ZeRO-0's) and per step
        res["zero2_" + key] = (t[2] - t[0], s[2] - s[0] / n)
    res["partitioned_bytes"] = (512 * 256 + 256) * 4
    res["chains"] = {"partitioned": (2 * modules, modules * (512 * 256 + 256) * 4),  # (tensors, gradient bytes)
                     "persistent": (2 * modules, modules * 2 * 256 * 4)}
    return res


def zero2_fit(probe: dict, allgather_s_per_byte: float) -> tuple:
    """ZeRO-2's (s per tensor per micro-batch, s per byte per micro-batch, s per byte per step) from
    the probe's two chains (many bytes per tensor, few): two equations in the two per-micro-batch
    unknowns; the step's cost per byte beyond the all-gather of the updated partitions the model
    already charges. Negative solutions (noise) are 0."""
    (tb, bb), (ts, bs) = probe["chains"]["partitioned"], probe["chains"]["persistent"]
    yb, ys = probe["zero2_partitioned"][0], probe["zero2_persistent"][0]
    det = tb * bs - ts * bb
    per_tensor = max(0.0, (yb * bs - ys * bb) / det) if det else 0.0
    per_byte = max(0.0, (yb - tb * per_tensor) / bb)
    step = max(0.0, probe["zero2_partitioned"][1] / bb - allgather_s_per_byte)
    return per_tensor, per_byte, step


def _fit(samples: dict) -> tuple:
    from mmpipe.planning.profiler import fit_comm
    return fit_comm({int(k): v for k, v in samples.items()})


def measure_collectives(group_sizes: list, sizes=(4096, 1 << 18, 1 << 21, 1 << 23), repeats: int = 9,
                        log=None) -> CommModel:
    """Time all-reduce, all-gather, reduce-scatter (and send/recv at 2) for each group size with the
    accelerator's backend, in spawned processes; fit latency + bytes / bandwidth per op and size; and
    ZeRO-3's fixed cost per module (``_zero3_probe``)."""
    import socket

    import torch.multiprocessing as mp
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    backend = acc.communication_backend_name()
    device = acc.device_name() if acc.device_name() == "cpu" else f"{acc.device_name()}:0"
    model = CommModel(backend=backend, measured=True)
    for n in _group_sizes(group_sizes):
        if log:
            log(f"timing collectives over {n} processes ({backend}) ...")
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=_coll_worker, args=(r, n, port, list(sizes), repeats, backend, device, q))
                 for r in range(n)]
        for p in procs:
            p.start()
        res = q.get(timeout=600)
        for p in procs:
            p.join()
        for op in OPS:
            model.ops.setdefault(op, {})[n] = _fit(res[op])
        if res["p2p"]:
            model.p2p = _fit(res["p2p"])
        z3 = res["zero3"]  # per module-pass, less the bandwidth share its gathers and reduce-scatter count
        b = z3["partitioned_bytes"]
        bw = (2 * model.ops["allgather"][n][1] + model.ops["reduce_scatter"][n][1]) * b / 2
        model.zero3[n] = (max(0.0, z3["partitioned"] - bw), z3["persistent"], z3["partitioned_step"],
                          z3["persistent_step"])
        model.zero2[n] = zero2_fit(z3, model.ops["allgather"][n][1])
        if device == "cpu":
            model.stretch[n] = res["stretch"]
    return model


def get_comm_model(group_sizes: list, use_cache: bool = True, log=None, refresh: bool = False) -> CommModel:
    """``measure_collectives`` cached per backend, device, host and group sizes (``$MMPIPE_CACHE``);
    ``refresh``: measure again and replace the cached entry."""
    import socket

    from deepspeed.accelerator import get_accelerator

    from mmpipe.planning.measure import _write_json, cache_dir
    acc = get_accelerator()
    sizes = _group_sizes(group_sizes)
    key = f"comm6-{acc.communication_backend_name()}-{acc.device_name()}-{socket.gethostname()}-" + "_".join(map(str, sizes))
    path = os.path.join(cache_dir(), key + ".json")
    if use_cache and not refresh and os.path.isfile(path):
        with open(path) as fh:
            if log:
                log(f"collective costs from cache {path}")
            return CommModel.from_dict(json.load(fh))
    model = measure_collectives(sizes, log=log)
    if use_cache:
        _write_json(path, model.to_dict())
    return model


def fetch_units(family) -> tuple:
    """(modules owning a parameter larger than ZeRO-3's persistence threshold: partitioned, gathered
    for every pass; other modules owning parameters: persistent, hooks only; the persistent
    parameters' element count, all-gathered after every step; the parameter tensors, each with a
    ZeRO-2 gradient hook), built on meta."""
    import torch
    big = small = kept = tensors = 0
    for name in family.layer_names():
        with torch.device("meta"):
            m = family.build_unseeded(name)
        for mod in m.modules():
            own = [p.numel() for p in mod.parameters(recurse=False)]
            if own:
                big, small = (big + 1, small) if max(own) > ZERO3_PERSISTENCE else (big, small + 1)
                kept += sum(k for k in own if k <= ZERO3_PERSISTENCE)  # DeepSpeed decides per parameter
                tensors += len(own)
    return big, small, kept, tensors


def cores() -> int:
    return os.cpu_count() or 1


def device_memory_bytes(world: int) -> int:
    """One rank's memory: the accelerator's, or (CPU) this machine's RAM shared by ``world`` ranks."""
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    if acc.device_name() != "cpu":
        return int(acc.total_memory())
    import psutil
    return int(psutil.virtual_memory().total // max(1, world))


def divisors_of(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def comm_group_sizes(world: int) -> list:
    """The group sizes whose collectives a world's layouts use (2 is always timed: send/recv)."""
    return _group_sizes(divisors_of(world))


def _group_sizes(sizes) -> list:
    return sorted({n for n in sizes if n >= 2} | {2})


def plan_layouts(cfg, world: int, memory_gb: Optional[float] = None, use_cache: bool = True, log=print,
                 comm: Optional[CommModel] = None, refresh: bool = False,
                 refresh_comm: Optional[bool] = None, profile: Optional[dict] = None) -> dict:
    """Profile (at the threads a rank of ``world`` gets; or take ``profile``), measure collectives
    (or take ``comm``), predict every layout; ``refresh`` / ``refresh_comm`` (default: ``refresh``):
    profile / time the collectives again, replacing the cached entries."""
    from mmpipe.config.groups import frozen_layout, resolve_groups
    from mmpipe.planning.measure import get_profile, resolve_for_plan
    from mmpipe.parallel.topology import threads_per_rank
    from deepspeed.accelerator import get_accelerator
    mbs = cfg.parallel.micro_batch_size
    if mbs == "auto":
        from mmpipe.errors import ConfigError
        raise ConfigError("parallel.layout=auto needs an integer parallel.micro_batch_size (the layouts are "
                          "compared at one micro-batch shape)")
    rcfg, family = resolve_for_plan(cfg)
    groups = resolve_groups(rcfg.optim, type(family))
    _, frozen, forward_only = frozen_layout(family, groups)
    threads = threads_per_rank(world)
    prof = profile or get_profile(rcfg, family, mbs, forward_only, frozen, threads=threads, use_cache=use_cache,
                                  log=log, refresh=refresh)
    comm = comm or get_comm_model(comm_group_sizes(world), use_cache=use_cache, log=log,
                                  refresh=refresh if refresh_comm is None else refresh_comm)
    if comm.measured:  # the stage-to-stage model from the same measurement as the collectives
        prof = {**prof, "comm": {**prof["comm"], "latency_s": comm.p2p[0], "s_per_byte": comm.p2p[1]}}
    gb = memory_gb if memory_gb is not None else cfg.parallel.memory_budget_gb
    budget = int(gb * 2**30) if gb else device_memory_bytes(world)
    on_cpu = get_accelerator().device_name() == "cpu"
    grouped_clip = any(g.max_grad_norm is not None for g in groups)
    rows = predict_layouts(prof, comm, world, cfg.train.batch_size, mbs, cfg.train.precision, family.layer_names(),
                           family.segments(), memory_budget=budget, cores=cores() if on_cpu else None,
                           grouped_clip=grouped_clip, fetch_units=fetch_units(family))
    best, why = choose(rows)
    return {"world": world, "batch_size": cfg.train.batch_size, "micro_batch_size": mbs, "threads": threads,
            "precision": cfg.train.precision,
            "memory_budget": budget, "rows": rows, "chosen": best, "why": why, "comm": comm, "profile": prof}


def cmd_plan_world(args) -> int:
    """``mmpipe plan --world N [--memory-gb M]``: every layout of N ranks predicted, the fastest that
    fits marked; layouts.json and layouts.png."""
    from mmpipe.config.schema import load_config
    cfg = load_config(args.config, args.overrides)
    log = lambda m: print(f"[plan] {m}", flush=True)  # noqa: E731
    res = plan_layouts(cfg, args.world, args.memory_gb, use_cache=not args.no_cache, log=log)
    print(f"{args.world} ranks, batch {cfg.train.batch_size}, micro-batch {res['micro_batch_size']}, "
          f"{res['threads']} thread(s) per rank, {res['comm'].backend}, memory budget "
          f"{res['memory_budget'] / 2**30:.2f} GB per rank; predicted per optimizer step:")
    print(format_table(res["rows"], res["chosen"], cfg.train.batch_size))
    print(f"\nchosen: {res['chosen'].name} ({res['why']})")
    out = args.out or os.path.join(cfg.train.output_dir, "plan")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "layouts.json"), "w") as fh:
        json.dump(layouts_json(res), fh, indent=1)
    write_png(os.path.join(out, "layouts.png"), res["rows"], res["chosen"],
              title=f"{args.world} ranks: predicted step per layout (green: chosen)")
    print(f"wrote {out}/layouts.json and {out}/layouts.png (train with --set parallel.layout=auto to use it)")
    return 0


def layouts_json(result: dict) -> dict:
    return {"world": result["world"], "batch_size": result["batch_size"],
            "micro_batch_size": result["micro_batch_size"], "threads_per_rank": result["threads"],
            "memory_budget": result["memory_budget"], "chosen": result["chosen"].to_dict(), "why": result["why"],
            "layouts": [r.to_dict() for r in result["rows"]], "comm": result["comm"].to_dict()}
