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
  its sharded step and all-gather). Memory per stage: ``mmpipe.planning.memory.stage_breakdown``.

Every layout is predicted with and without activation checkpointing where the run leaves it to the
chooser (``parallel.activation_checkpointing: auto``): checkpointing costs a recomputed forward
per trained layer (``place.recomputed_ms``) and saves activations (``memory.activation_bytes``).

When the N ranks share fewer cores than they compute with (N x threads > cores, this CPU machine),
compute is stretched by that oversubscription (measured, ``oversubscription``); ranks that each have
their own cores are not stretched (the cache-cold profile already charges the shared cache). Every layout that does not fit the memory budget says
why. ``choose`` takes the fastest that fits, or within ``TIE`` of it the simplest.
"""
from __future__ import annotations

import os
import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Optional

from mmpipe.config.groups import frozen_layout, resolve_groups
from mmpipe.errors import ConfigError
from mmpipe.parallel.schedules import Order, default_order
from mmpipe.parallel.topology import threads_per_rank
from mmpipe.planning.collectives import CommModel, comm_group_sizes, get_comm_model
from mmpipe.planning.measure import META_PARAMS, get_profile, meta_profile, parameter_count
from mmpipe.planning.memory import (
    device_memory_bytes,
    run_shape,
    stage_breakdown,
    step_loss_bytes,
    state_bytes,
)
from mmpipe.planning.offline import resolve_for_plan
from mmpipe.planning.place import layer_costs, place, predict, recomputed_ms, stage_times, with_exchanges
from mmpipe.planning.simulate import simulate_shared_cores


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
    checkpointing: bool = False  # activation checkpointing
    breakdown: list = field(default_factory=list)  # per stage: MemoryBreakdown.to_dict()
    order: Optional[Order] = None  # a pipeline row's order (chosen with its cut)
    expert_parallel: int = 1  # a MoE model's routed experts split over this many data-parallel ranks

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
                    fetch_units=None, checkpointing=(False,), zero3_checkpointing_why: str = "",
                    schedule: str = "auto", num_experts: int = 0) -> list:
    """Every layout of ``world`` ranks (see the module doc), predicted; a list of ``LayoutPrediction``.
    ``fetch_units``: (modules whose parameters ZeRO-3 partitions, modules whose parameters it keeps
    persistent, the persistent parameters' element count, parameter tensors), or one count of
    partitioned modules; ZeRO-3 fetches each partitioned module separately, twice per micro-batch,
    and all-gathers the persistent parameters after each step; ZeRO-2 hooks every parameter tensor.
    Default: one partitioned module (and one tensor) per layer. ``checkpointing``: predict each
    layout without and/or with activation checkpointing; ``zero3_checkpointing_why``: the family cannot
    run ZeRO-3 with it (those rows do not fit, and say why); ``schedule``: ``parallel.schedule`` (a pipeline row's cut
    and order are chosen together, ``place``); ``num_experts``: a MoE model's routed experts per block: each layout with
    data parallelism is also predicted with them split over its data-parallel ranks (``expert_split``)."""
    out = []
    for ck in checkpointing:
        ctx = _Ctx({**prof, "checkpointing": ck}, comm, world, batch_size, micro_batch_size, precision, cores)
        ctx.schedule = schedule
        units = fetch_units if isinstance(fetch_units, tuple) else (fetch_units or len(ctx.costs), 0)
        units = tuple(units)[:4]
        units = units + (0,) * max(0, 3 - len(units)) + ((len(ctx.costs),) if len(units) < 4 else ())
        rows = [_dp_row(ctx, z, grouped_clip, units, e) for z in zero_stages if world > 1 or z == 0
                for e in expert_split(world, num_experts, z)]
        for P in range(2, min(world, max_pipeline or len(names)) + 1):
            if world % P:
                continue
            D = world // P
            for z in (0, 1) if D > 1 else (0,):
                rows += [_pp_row(ctx, P, D, z, pl, names, segments, e) for e in expert_split(D, num_experts, z)
                         for pl in placements]
        for row in rows:
            row.checkpointing = ck
            if ck:
                row.name += " +ckpt"
                if row.zero_stage == 3 and zero3_checkpointing_why and row.fits:
                    row.fits, row.why = False, zero3_checkpointing_why
        out += rows
    if memory_budget:
        for row in out:
            if row.fits and row.peak > memory_budget:
                row.fits = False
                row.why = (f"needs {row.peak / 2**30:.2f} GB on its fullest rank, over the "
                           f"{memory_budget / 2**30:.2f} GB budget")
    return out


def expert_split(data_parallel: int, num_experts: int, zero: int) -> list:
    """The expert-parallel degrees a layout is predicted with: 1, and (a MoE model, ZeRO 0-2) the largest divisor of
    the data-parallel degree that divides the experts (the common choice: each expert on as few ranks as the layout
    allows; the degrees between lie between the two)."""
    if not num_experts or zero == 3 or data_parallel < 2:
        return [1]
    e = max(d for d in range(1, data_parallel + 1) if data_parallel % d == 0 and num_experts % d == 0)
    return [1, e] if e > 1 else [1]


def expert_costs(comm, costs: list, D: int, e: int, g_b: int, w_b: int) -> tuple:
    """Expert parallelism's collectives over ``costs`` (layers of one rank) in ``e``-rank groups of ``D`` data-parallel
    ranks: (the gradient all-reduce of the step, the parameter all-gather after a ZeRO step, one micro-batch's token
    exchanges). Routed experts' gradients go over the ``D / e`` ranks holding the same ones, 1 / ``e`` of them each;
    the rest over all ``D``. Each MoE layer sends its routed rows (``LayerCost.routed_bytes``) out and back in its
    forward and again in its backward: four all-to-alls, priced as all-gathers of the rows over the ``e`` ranks (each
    rank sends (e - 1) / e of them, as a ring all-gather does)."""
    ge = sum(c.experts_trainable for c in costs) if e > 1 else 0
    we = sum(c.experts for c in costs) if e > 1 else 0
    G, W = sum(c.trainable for c in costs) - ge, sum(c.params for c in costs) - we
    grads = comm.time("allreduce", D, G * g_b) + (comm.time("allreduce", D // e, ge / e * g_b) if ge and D > e else 0)
    gather = comm.time("allgather", D, W * w_b) + (comm.time("allgather", D // e, we / e * w_b) if we and D > e else 0)
    a2a = sum(4 * comm.time("allgather", e, c.routed_bytes) for c in costs if c.routed_bytes) if e > 1 else 0.0
    return grads, gather, a2a


class _Ctx:
    """What every layout's prediction shares: the raw profile, the data-parallel stretch, sizes."""

    def __init__(self, prof, comm, world, batch_size, micro_batch_size, precision, cores):
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
        self.schedule = "auto"  # ``parallel.schedule``

    def micro_batches(self, row, dp: int) -> int:
        if self.batch % (self.mbs * dp):
            row.fits, row.why = False, f"batch {self.batch} is not a multiple of micro-batch {self.mbs} x {dp}"
            return 0
        return self.batch // (self.mbs * dp)


def loss_seconds(step_loss: Optional[dict], batch: int, dp: int, micro_batches: int) -> float:
    """One rank's step loss over the global batch (``parallel.step_loss``): the profiled seconds per pair
    times the pairs it computes, its own B / D rows x B with ``model.local_loss`` (else B x B); none with one
    micro-batch on one rank (the loss layer then runs in the graph, profiled with it)."""
    if not step_loss or dp * micro_batches == 1:
        return 0.0
    own = batch // dp if step_loss.get("local") and dp > 1 else batch
    return float(step_loss.get("pair_s", 0.0)) * own * batch


def step_loss_summary(prof: dict, batch: int, row: "LayoutPrediction") -> Optional[str]:
    """One line on a layout's step loss per rank: its pairs, FLOPs and peak bytes (``memory.step_loss_bytes``),
    beside what every rank computing the whole B x B would cost; None without a step loss."""
    sl = prof.get("step_loss")
    if not sl or not row.micro_batches:
        return None
    D, M, mbs = row.data_parallel, row.micro_batches, int(sl.get("rows") or 1)
    own = batch // D if sl.get("local") and D > 1 else batch
    width = sl["features_bytes"] / (4 * mbs) / 2  # one side's features (image | text)
    flops = 2 * own * batch * width * 3  # the logits, then their gradient for both sides' features
    if D * M == 1:
        return f"step loss: one micro-batch on one rank, {batch} x {batch} in the graph ({flops / 1e12:.2f} TFLOP)"
    mem = step_loss_bytes(run_shape(prof, default_order()), M, D)  # (the order does not change the loss's bytes)
    how = (f"its own {own} of {batch} rows (model.local_loss); every rank the whole B x B would be {D}x the work"
           if own < batch else "all of them" + (" (model.local_loss=false)" if D > 1 else ""))
    return (f"step loss per rank ({row.name}): {own} x {batch} pairs = {own * batch / 1e6:.1f}M, "
            f"{flops / 1e12:.2f} TFLOP a step, {mem / 2**30:.2f} GB at its peak: {how}")


def _dp_row(ctx: _Ctx, z: int, grouped_clip: bool, units: tuple, e: int = 1) -> LayoutPrediction:
    n, comm, costs = ctx.world, ctx.comm, ctx.costs
    row = LayoutPrediction((f"DP{n} ZeRO-{z}" if n > 1 else "single process") + (f" EP{e}" if e > 1 else ""), 1, n,
                           z, None, 0, clipping="grouped" if z < 2 else "DeepSpeed global", expert_parallel=e)
    M = row.micro_batches = ctx.micro_batches(row, n)
    if not M:
        return row
    if z >= 2 and grouped_clip:
        row.fits, row.why = False, "per-group max_grad_norm needs ZeRO 0/1"
    fb = sum(c.fwd_ms + c.bwd_ms + r for c, r in zip(costs, recomputed_ms(ctx.raw, costs))) / 1e3
    opt = sum(c.opt_ms for c in costs) / 1e3
    G = sum(c.trainable for c in costs) * ctx.g_b
    W = sum(c.params for c in costs) * ctx.w_b
    grads, gather, a2a = expert_costs(comm, costs, n, e, ctx.g_b, ctx.w_b)
    if z == 0:
        cm = grads
    elif z == 1:
        cm = grads + gather
    elif z == 2:
        # DeepSpeed's ZeRO-2 reduces each micro-batch's gradient buckets by all-reduce (its default
        # use_multi_rank_bucket_allreduce) and keeps its own partition; gloo's reduce-scatter costs 5x
        # the all-reduce per byte here, so which one it runs matters
        cm = M * grads + gather
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
    step_loss = ctx.raw.get("step_loss")
    if step_loss and M > 1:  # the forward-only pass for the features (the training pass takes a frozen
        # prefix's output from it); with one micro-batch per rank there is one pass (parallel.strategies)
        fb += sum(c.fwd_ms for c in costs[step_loss.get("frozen_prefix", 0) if z < 3 else 0:]) / 1e3
    if step_loss and n > 1:  # the features' all-gather
        cm += comm.time("allgather", n, M * step_loss["features_bytes"])
    # expert parallelism: every micro-batch's token exchanges (checkpointing: the forward's two again in backward)
    cm += M * a2a * (1.5 if ctx.raw.get("checkpointing") else 1.0)
    row.compute = M * fb + (opt / n if z >= 1 else opt) + loss_seconds(step_loss, ctx.batch, n, M) * ctx.over
    row.comm = cm * ctx.over + fixed  # collectives between oversubscribed ranks wait for the cores too
    row.step_time = row.compute + row.comm
    row.samples_per_s = ctx.batch / row.step_time if row.step_time > 0 else 0.0
    _memory(row, ctx, [0, len(costs)], M, z, n)
    return row


def _pp_row(ctx: _Ctx, P: int, D: int, z: int, pl: str, names: list, segments: list, e: int = 1) -> LayoutPrediction:
    tag = f"PP{P}" + (f"xDP{D}" if D > 1 else "") + f" {pl}" + (f" ZeRO-{z}" if D > 1 else "") + (f" EP{e}" if e > 1 else "")
    row = LayoutPrediction(tag, P, D, z, pl, 0, expert_parallel=e)
    M = row.micro_batches = ctx.micro_batches(row, D)
    if not M:
        return row
    # expert parallelism's token exchanges priced into their MoE layers (the cut and the order see them)
    raw = with_exchanges(ctx.raw, e, lambda nbytes: ctx.comm.time("allgather", e, nbytes))
    try:
        plan = place(names, segments, P, pl, M, schedule=ctx.schedule, prof=_scaled(raw, ctx.over),
                     micro_batch_size=ctx.mbs, precision=ctx.precision, zero_stage=z, data_parallel=D)
    except ConfigError as err:
        row.fits, row.why = False, str(err)
        return row
    parts = row.parts = list(plan.parts)
    row.placement = pl if pl != "auto" else f"auto:{plan.chosen or pl}"
    row.order = plan.order
    # oversubscription counts the ranks busy at once, instruction by instruction: a pipeline's
    # waiting stages free their cores (fill, drain, imbalance), its steady state does not
    t = stage_times(raw, parts)
    step_loss = raw.get("step_loss")
    gather = ctx.comm.time("allgather", D, M * step_loss["features_bytes"]) if step_loss and D > 1 else 0.0
    if ctx.cores and D * P * ctx.threads > ctx.cores:
        sim, _ = simulate_shared_cores(t["F"], t["B"], M, t["comm"], t["opt"], t["comm_grad"], D, ctx.threads,
                                       ctx.cores, ctx.slope, step_loss=bool(step_loss), first_pass=t.get("F1"),
                                       W=t["W"], order=plan.order)
        raw_busy = [M * (a + b + a1) + o for a, b, a1, o in zip(t["F"], t["B"], t.get("F1", [0.0] * P), t["opt"])]
        f = sum(sim.busy) / sum(raw_busy) if sum(raw_busy) else 1.0  # the mean stretch, for what follows
    else:
        sim, f = predict(raw, parts, M, plan.order), 1.0
    sprof = _scaled(raw, f)
    t = stage_times(sprof, parts)
    dp_comm = opt_saving = 0.0
    for s in range(P):
        grads, params, _ = expert_costs(ctx.comm, ctx.costs[parts[s]:parts[s + 1]], D, e, ctx.g_b, ctx.w_b)
        c_s = (grads + (params if z == 1 else 0.0)) * f
        dp_comm = max(dp_comm, c_s)
        if z == 1:
            opt_saving = max(opt_saving, t["opt"][s] * (1 - 1 / D))
    # the last stage's loss over the step, between the two passes (its rows only with model.local_loss)
    row.step_time = sim.step_time - opt_saving + dp_comm + gather * f + loss_seconds(step_loss, ctx.batch, D, M) * f
    row.compute = M * max(a + b + a1 for a, b, a1 in zip(t["F"], t["B"], t.get("F1", [0.0] * P)))
    row.comm = dp_comm + sim.step_time - max(sim.busy)  # waiting, transfers and the reduction
    row.bubble = sim.bubble
    row.samples_per_s = ctx.batch / row.step_time if row.step_time > 0 else 0.0
    _memory(row, ctx, parts, M, z, D)
    return row


def _memory(row, ctx: _Ctx, parts: list, M: int, z: int, dp: int) -> None:
    """The row's predicted peak per stage (``mmpipe.planning.memory``) under its order, totals and breakdowns."""
    shape = dataclasses.replace(run_shape(ctx.raw, row.order or default_order()), expert_parallel=row.expert_parallel)
    mem = stage_breakdown(ctx.costs, parts, M, ctx.precision, z, dp, shape)
    row.memory = [m.total for m in mem]
    row.breakdown = [m.to_dict() for m in mem]


TIE = 0.05  # predictions this close are a tie: the model's error on this machine is larger


def choose(rows: list, tie: float = TIE) -> tuple:
    """(the layout to run, one line saying why): of the layouts that fit, those predicted within
    ``tie`` of the fastest, the one with the fewest pipeline stages, then the lowest ZeRO stage,
    then without activation checkpointing, then the fastest. A deeper pipeline or a higher ZeRO stage adds hops, bubbles and collectives
    the model only estimates; a few percent of predicted gain does not pay for that risk."""
    ok = sorted((r for r in rows if r.fits), key=lambda r: r.step_time)
    if not ok:
        raise ConfigError("parallel.layout=auto: no layout fits: " + "; ".join(f"{r.name}: {r.why}" for r in rows)
                          + " (raise parallel.memory_budget_gb, use more ranks, or freeze/shrink the model)")
    near = ok if tie == float("inf") else [r for r in ok if r.step_time <= ok[0].step_time * (1 + tie)]
    best = min(near, key=lambda r: (r.pipeline_stages, r.zero_stage, r.checkpointing, r.expert_parallel, r.step_time))
    others = [r for r in ok if r is not best]
    runner_up = f", next {others[0].name} {1e3 * others[0].step_time:.1f} ms" if others else ""
    simpler = (f" (within {tie:.0%} of the fastest, {ok[0].name} {1e3 * ok[0].step_time:.1f} ms, with fewer "
               f"stages or a lower ZeRO stage)" if best is not ok[0] else "")
    dropped = [r.name for r in rows if not r.fits]
    why = (f"{'fastest predicted step' if best is ok[0] else 'predicted step'} that fits: {best.name} "
           f"{1e3 * best.step_time:.1f} ms{simpler}{runner_up}" + (f"; not fitting: {', '.join(dropped)}" if dropped else ""))
    return best, why


def format_table(rows: list, chosen: Optional[LayoutPrediction], batch_size: int, timed: bool = True) -> str:
    """One line per layout; ``timed`` False (a meta-device plan): memory only, by peak."""
    unit, scale = ("GB", 2**30) if max((r.peak for r in rows), default=0) > 2**32 else ("MB", 2**20)
    lines = [f"| layout | step ms | samples/s | bubble | peak {unit}/rank | per stage {unit} | clipping | fits |",
             "|---|---|---|---|---|---|---|---|"]
    order = (lambda r: (not r.fits, r.step_time if r.step_time == r.step_time else 1e9)) if timed else \
        (lambda r: (not r.fits, r.peak or 1e30))
    for r in sorted(rows, key=order):
        mark = " **chosen**" if chosen is not None and r.name == chosen.name else ""
        if r.micro_batches == 0:
            lines.append(f"| {r.name} | - | - | - | - | - | {r.clipping} | no: {r.why} |")
            continue
        fits = "yes" if r.fits else f"no: {r.why}"
        times = (f"{1e3 * r.step_time:.1f} | {r.samples_per_s:.1f} | {r.bubble:.0%}" if timed else "- | - | -")
        stages = " / ".join(f"{m / scale:.1f}" for m in r.memory)
        lines.append(f"| {r.name}{mark} | {times} | {r.peak / scale:.1f} | {stages} | {r.clipping} | {fits} |")
    return "\n".join(lines)


ZERO3_PERSISTENCE = 100_000  # DeepSpeed's stage3_param_persistence_threshold default (numel)


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


def plan_layouts(cfg, world: int, memory_gb: Optional[float] = None, use_cache: bool = True, log=print,
                 comm: Optional[CommModel] = None, refresh: bool = False,
                 refresh_comm: Optional[bool] = None, profile: Optional[dict] = None,
                 meta: Optional[bool] = False, unfit_ok: bool = False, gpu_kernels: Optional[bool] = None) -> dict:
    """Profile (at the threads a rank of ``world`` gets; or take ``profile``), measure collectives
    (or take ``comm``), predict every layout; ``refresh`` / ``refresh_comm`` (default: ``refresh``):
    profile / time the collectives again, replacing the cached entries. ``meta``: size the model on
    the meta device (``meta_profile``): memory only, no step times, the simplest layout that fits
    chosen; None: when it has more than ``META_PARAMS`` parameters (``mmpipe plan``; a training run
    profiles the real layers on its own device). ``unfit_ok``: when no layout fits, "chosen" is None
    rather than an error. ``gpu_kernels``: sized on the meta device, price dropout as a GPU runs it
    (``measure.meta_profile``; default: as this process's accelerator does)."""
    from deepspeed.accelerator import get_accelerator

    mbs = cfg.parallel.micro_batch_size
    if mbs == "auto":
        raise ConfigError("parallel.layout=auto needs an integer parallel.micro_batch_size (the layouts are "
                          "compared at one micro-batch shape)")
    rcfg, family = resolve_for_plan(cfg)
    groups = resolve_groups(rcfg.optim, type(family))
    _, frozen, forward_only = frozen_layout(family, groups)
    threads = threads_per_rank(world)
    if meta is None and profile is None:
        n = parameter_count(family)
        meta = n > META_PARAMS
        if meta:
            log(f"{n / 1e9:.2f}B parameters: sizing the model on the meta device (memory only: step times are not "
                f"predicted for a model this machine cannot time)")
    if meta:
        prof, comm = meta_profile(rcfg, family, mbs, forward_only, frozen, gpu_kernels), CommModel()
    prof = prof if meta else profile or get_profile(rcfg, family, mbs, forward_only, frozen, threads=threads,
                                                    use_cache=use_cache, log=log, refresh=refresh)
    comm = comm or get_comm_model(comm_group_sizes(world), use_cache=use_cache, log=log,
                                  refresh=refresh if refresh_comm is None else refresh_comm)
    if comm.measured:  # the stage-to-stage model from the same measurement as the collectives
        prof = {**prof, "comm": {**prof["comm"], "latency_s": comm.p2p[0], "s_per_byte": comm.p2p[1]}}
    gb = memory_gb if memory_gb is not None else cfg.parallel.memory_budget_gb
    budget = int(gb * 2**30) if gb else device_memory_bytes(world)
    on_cpu = get_accelerator().device_name() == "cpu" and not meta
    grouped_clip = any(g.max_grad_norm is not None for g in groups)
    rows = predict_layouts(prof, comm, world, cfg.train.batch_size, mbs, cfg.train.precision, family.layer_names(),
                           family.segments(), memory_budget=budget, cores=cores() if on_cpu else None,
                           grouped_clip=grouped_clip, fetch_units=fetch_units(family),
                           checkpointing=checkpointing_choices(cfg),
                           zero3_checkpointing_why=family.zero3_checkpointing_refusal(),
                           schedule=cfg.parallel.schedule,
                           num_experts=family.num_experts if getattr(family, "routed_experts", False) else 0)
    if unfit_ok and not any(r.fits for r in rows):  # (mmpipe plan: the table all the same; chosen None)
        best, why = None, "no layout fits"
    else:
        best, why = choose(rows, tie=float("inf") if meta else TIE)
    if meta and best is not None:
        why = (f"the simplest layout that fits: {best.name}, peak {best.peak / 2**30:.1f} GB per rank (fewest stages, "
               "then the lowest ZeRO stage, then without checkpointing; step times not predicted: sized on the meta "
               "device)")
    return {"meta": bool(meta), "world": world, "batch_size": cfg.train.batch_size, "micro_batch_size": mbs, "threads": threads,
            "precision": cfg.train.precision,
            "memory_budget": budget, "rows": rows, "chosen": best, "why": why, "comm": comm, "profile": prof}


def checkpointing_choices(cfg) -> tuple:
    """What the layout chooser weighs: activation checkpointing off and on (``auto``, the default), or
    what ``parallel.activation_checkpointing`` fixes."""
    return {"none": (False,), "all": (True,)}.get(cfg.parallel.activation_checkpointing, (False, True))


def layouts_json(result: dict) -> dict:
    return {"world": result["world"], "batch_size": result["batch_size"],
            "micro_batch_size": result["micro_batch_size"], "threads_per_rank": result["threads"],
            "memory_budget": result["memory_budget"], "chosen": result["chosen"].to_dict(), "why": result["why"],
            "layouts": [r.to_dict() for r in result["rows"]], "comm": result["comm"].to_dict()}
