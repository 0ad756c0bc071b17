"""One planner: stage boundaries for any number of segments, as one ``Plan`` with one JSON schema.

``place(...)`` takes the layer names, their segment tags and either measured costs (a profile from
``mmpipe.planning.measure.get_profile``) or per-layer parameter costs, and returns the ``Plan`` of a placement:
``modality`` (stages never mix segments; the K segments, in order, share the stages by cost),
``balanced`` (boundaries anywhere, optionally under a memory cap), ``auto`` (whichever the simulator
predicts faster), DeepSpeed's ``uniform`` / ``parameters`` / ``type:REGEX`` (computed with DeepSpeed's
own functions), or a plan file. **The cut and the pipeline order are chosen together**: with measured
costs, every candidate cut is predicted under every order that applies to it (``parallel.schedule:
auto``; else the one asked for) - its step time, and the peak memory of its fullest stage under that
order (activations in flight, a split backward's weight-gradient queue) against ``parallel.memory_budget_gb``
- and the fastest pair that fits wins (``Plan.weighed`` lists them all). A cut fixed otherwise (DeepSpeed's
methods, a plan file, no profile) takes the order by the same rule on that cut. Training calls it once per
run (rank 0) and writes the result to ``plan.json``; ``mmpipe plan`` writes the same schema.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Optional

from mmpipe.errors import ConfigError
from mmpipe.parallel.plan import Plan, parts_from_lists
from mmpipe.parallel.schedules import Order, candidates, default_order, leading_frozen, order_of
from mmpipe.planning.memory import bytes_per_param, held, run_shape, stage_memory
from mmpipe.planning.partition import every_stage_trains, min_max_partition, modality_partition
from mmpipe.planning.profiler import LayerCost
from mmpipe.planning.simulate import simulate

MEASURED = ("modality", "balanced", "auto")
ORDER_TIE = 0.05  # orders of one cut predicted this close are a tie (the model's error here is larger): least memory


def place(names: list, segments: list, num_stages: int, placement: str, micro_batches: int, *, schedule: str,
          prof: Optional[dict] = None, param_costs: Optional[list] = None, plan_file: Optional[str] = None,
          micro_batch_size: Optional[int] = None, memory_cap: Optional[int] = None, precision: str = "fp32",
          zero_stage: int = 0, data_parallel: int = 1, trains: Optional[list] = None,
          forward_only: Optional[frozenset] = None, freeze_hint: Optional[Callable[[str], str]] = None) -> Plan:
    """The ``Plan`` of ``placement`` and ``schedule`` (``parallel.schedule``: ``auto`` or a name) for these layers on
    ``num_stages`` stages (see the module doc). Measured placements use ``prof`` when given, else ``param_costs``
    (e.g. trainable parameters). ``trains`` (per layer: holds a trained parameter; else read from ``prof``): under
    bf16 or ZeRO, whose optimizers cannot hold a stage without one, a stage of frozen layers only takes the next
    stage's layers up to its first trained one (LoRA's frozen ViT + projector at P = 2). ``forward_only``: the layers
    that run without autograd (else the profile's); ``freeze_hint``: see ``pick_schedule``."""
    if num_stages > len(names):
        raise ConfigError(f"parallel.pipeline_stages={num_stages} is more than the model's {len(names)} layers "
                          f"({names[0]} .. {names[-1]}): use at most {len(names)} stages")
    plan = Plan(list(names), list(segments), [0, len(names)], placement, micro_batches, micro_batch_size)
    if num_stages == 1:
        return plan
    forward_only = frozenset(forward_only if forward_only is not None else
                             (prof or {}).get("key", {}).get("forward_only", []))
    weigh = None
    if plan_file:
        plan.parts, plan.costs = parts_from_plan_file(plan_file, names, num_stages), "plan file"
    elif placement.startswith("type:"):
        plan.parts, plan.costs = type_partition(names, placement, num_stages), "deepspeed"
    elif placement in ("uniform", "parameters"):
        weights = [c["params"] for c in prof["layers"]] if prof else param_costs
        plan.parts, plan.costs = ds_parts(weights, num_stages, placement, names), "deepspeed"
    elif prof is not None:
        try:
            cuts, over = _measured_cuts(prof, segments, num_stages, placement, micro_batches, memory_cap, precision,
                                        zero_stage, data_parallel)
        except ValueError as e:
            raise ConfigError(f"parallel.placement={placement}: {e}; raise parallel.memory_budget_gb or use more "
                              "stages") from None
        weigh = dict(cuts=cuts, over=over)
        plan.costs = "profile"
    else:
        try:
            plan.parts = (modality_partition(param_costs, segments, num_stages) if placement == "modality"
                          else min_max_partition(param_costs, num_stages))
        except ValueError as e:
            raise ConfigError(f"parallel.placement={placement}: {e}; use fewer stages or parallel.placement=balanced") \
                from None
    trains = trains if trains is not None else [c.trainable > 0 for c in layer_costs(prof)] if prof else None
    movable = trains and not plan_file and placement in ("modality", "balanced", "auto") and \
        (zero_stage > 0 or precision != "fp32")
    if weigh is not None:
        first = dict(weigh["cuts"])
        if movable:  # (a cut the optimizer cannot hold is weighed as it will run)
            weigh["cuts"] = {k: every_stage_trains(v, trains) for k, v in weigh["cuts"].items()}
        _weigh(plan, prof, schedule, weigh["cuts"], weigh["over"], memory_cap, precision, zero_stage, data_parallel,
               forward_only, freeze_hint)
        was = next(first[k] for k, v in weigh["cuts"].items() if v == plan.parts)
        if was != plan.parts:
            plan.why = (f"{plan.why}; " if plan.why else "") + _moved(names, was, plan.parts, precision, zero_stage)
    plan.parts = [int(x) for x in plan.parts]
    if movable and weigh is None:
        parts = every_stage_trains(plan.parts, trains)
        if parts != plan.parts:
            plan.why = (f"{plan.why}; " if plan.why else "") + _moved(names, plan.parts, parts, precision, zero_stage)
            plan.parts = parts
    if weigh is None:
        pick_schedule(schedule, plan, prof, forward_only, freeze_hint, precision=precision, zero_stage=zero_stage,
                      data_parallel=data_parallel, memory_cap=memory_cap)
    return plan


def _moved(names: list, was: list, parts: list, precision: str, zero_stage: int) -> str:
    moved = ", ".join(n for a, b in zip(was[1:-1], parts[1:-1]) for n in names[a:b])
    return (f"a stage held only frozen layers, which the {precision}/ZeRO-{zero_stage} optimizer cannot hold: {moved} "
            "moved onto the stage before")


def orders_for(requested: str, parts: list, names: list, forward_only, freeze_hint=None) -> list:
    """The orders a cut is weighed under: those that apply to it for ``auto`` (``schedules.candidates``), else the
    one asked for (``frozen_first`` where stage 0 trains is refused in one line, naming the layer)."""
    P, frozen = len(parts) - 1, leading_frozen(parts, names, forward_only)
    if requested == "auto":
        return candidates(P, frozen)
    if requested == "frozen_first" and not frozen:
        first = next(n for n in names[parts[0]:parts[1]] if n not in forward_only)
        how = f" ({freeze_hint(first)})" if freeze_hint is not None else ""
        raise ConfigError(f"parallel.schedule=frozen_first: stage 0 ({names[parts[0]]} .. {names[parts[1] - 1]}) "
                          f"trains {first}{how}; frozen_first needs leading stages whose layers are all frozen (and "
                          "fp32 with zero_stage 0); use parallel.schedule=1f1b or auto")
    return [order_of(requested, frozen)]


def _weigh(plan: Plan, prof: dict, requested: str, cuts: dict, over: dict, memory_cap: Optional[int], precision: str,
           zero_stage: int, data_parallel: int, forward_only, freeze_hint, cut_fixed: bool = False) -> None:
    """Every (cut, order) pair predicted - step time, and the peak of its fullest stage under that order - the
    fastest that fits ``memory_cap`` taken (a model sized on the meta device has no times: the lowest peak)."""
    costs, M, names = layer_costs(prof), plan.micro_batches, plan.layers
    rows = []
    for cut, parts in cuts.items():
        for order in orders_for(requested, parts, names, forward_only, freeze_hint):
            sim = predict(prof, parts, M, order)
            mem = stage_memory(costs, parts, M, precision, zero_stage, data_parallel, run_shape(prof, order))
            rows.append({"cut": cut, "parts": list(parts), "schedule": order.name, "frozen_stages": order.frozen,
                         "step_time": sim.step_time, "peak_bytes": int(max(mem)), "total_bytes": int(sum(mem)),
                         "sim": sim, "fits": memory_cap is None or max(mem) <= memory_cap})
    untimed = prof.get("timed") is False
    pool = [r for r in rows if r["fits"]] or rows  # (none fits: the cut search already said what it could)
    # the fastest pair's cut (a model sized on the meta device has no times: the lowest peak's); of its orders, those
    # predicted within ``ORDER_TIE`` of the fastest are a tie, and the one holding least wins (the fullest stage,
    # then all stages: frozen_first does a subset of 1F1B's work and is often predicted the same; a split backward
    # holds its queue, so it is taken where it gains more than the model's error)
    fastest = min(pool, key=lambda r: (r["peak_bytes"] if untimed else r["step_time"], rows.index(r)))
    tied = [r for r in pool if r["cut"] == fastest["cut"] and (untimed or r["step_time"] <= fastest["step_time"]
                                                                * (1 + ORDER_TIE))]
    best = min(tied, key=lambda r: (r["peak_bytes"], r["total_bytes"], rows.index(r)))
    plan.parts, plan.order = list(best["parts"]), Order(best["schedule"], best["frozen_stages"])
    plan.weighed = [{k: v for k, v in r.items() if k != "sim"} for r in rows]
    plan.schedules = {r["schedule"]: r["step_time"] for r in rows if r["cut"] == best["cut"]}
    if cut_fixed:
        return
    firsts = {}
    for r in rows:  # each cut's prediction under the order chosen (or its best)
        if r["cut"] not in firsts or r["schedule"] == best["schedule"]:
            firsts[r["cut"]] = r
    plan.predicted = {cut: r["sim"].to_dict() for cut, r in firsts.items()}
    if plan.placement == "auto":
        plan.chosen = best["cut"]
        ranked = sorted(rows, key=lambda r: r["step_time"])
        plan.why = "fastest predicted step: " + ", ".join(
            f"{r['cut']}+{r['schedule']} {1e3 * r['step_time']:.1f} ms" + ("" if r["fits"] else " (over the budget)")
            for r in ranked)
        if over:  # a faster cut that does not fit is no candidate: said
            plan.why += "; over parallel.memory_budget_gb: " + ", ".join(
                f"{k} ({v / 2**30:.3g} GB on its fullest stage)" for k, v in over.items())


def _measured_cuts(prof: dict, segments: list, num_stages: int, placement: str, micro_batches: int,
                   memory_cap: Optional[int], precision: str, zero_stage: int, data_parallel: int) -> tuple:
    """({placement: parts} of the candidate cuts, {placement over ``memory_cap``: its fullest stage's bytes}) from
    measured costs (forward + backward per layer, and the recomputed forward under checkpointing; a frozen
    forward-only layer costs its forward alone). Under ``memory_cap`` only cuts that fit are candidates (counted
    with stage 0's micro-batches in flight on every stage, as 1F1B holds them); none: ValueError."""
    costs = layer_costs(prof)
    recomputed = recomputed_ms(prof, costs)
    per_t, per_f = bytes_per_param(precision, zero_stage, data_parallel)
    # worst case in flight (stage 0) for every stage: conservative, keeps the DP additive; checkpointed
    # (recomputed_ms > 0), a layer keeps its input per micro-batch in flight
    k = held(0, num_stages, micro_batches, default_order())
    ckpt = bool(prof.get("checkpointing"))
    forward_only = set(prof.get("key", {}).get("forward_only", []))
    kept = [c.in_bytes if ckpt and c.name not in forward_only and c.in_bytes is not None else c.act_bytes
            for c in costs]
    mem = [c.static_bytes(per_t, per_f) + k * a for c, a in zip(costs, kept)]
    # a model sized on the meta device has no times: its stages are balanced by memory
    work = mem if prof.get("timed") is False else [c.fwd_ms + c.bwd_ms + r for c, r in zip(costs, recomputed)]
    candidates = {}
    if placement in ("modality", "auto"):
        candidates["modality"] = modality_partition(work, segments, num_stages)
    if placement in ("balanced", "auto"):
        candidates["balanced"] = min_max_partition(work, num_stages, memory=mem if memory_cap is not None else None,
                                                   memory_cap=memory_cap)
    over = {}
    if memory_cap is not None:  # every cut a plan can return fits the cap (the balanced one is cut under it)
        for name, parts in list(candidates.items()):
            peak = max(sum(mem[a:b]) for a, b in zip(parts, parts[1:]))
            if peak > memory_cap:
                over[name] = peak
                del candidates[name]
        if not candidates:
            raise ValueError(f"no cut fits the memory cap ({memory_cap / 2**30:.3g} GB a stage; the {placement} cut "
                             f"needs {min(over.values()) / 2**30:.3g} GB)")
    return candidates, over


def layer_costs(prof: dict) -> list:
    return [LayerCost(**d) for d in prof["layers"]]


def with_exchanges(prof: dict, expert_parallel: int, exchange=None) -> dict:
    """``prof`` for a run with its routed experts split over ``expert_parallel`` ranks: each MoE layer's forward and
    backward priced with its token exchanges (the routed rows, ``LayerCost.routed_bytes``, out and back: two
    all-to-alls each way; ``exchange(nbytes)`` seconds for one, by default the profile's stage-to-stage transfer
    model for the (E - 1) / E of the rows that leave the rank), so a cut and an order see them; and the memory model
    told the degree (``RunShape.expert_parallel``)."""
    e = expert_parallel
    if e <= 1:
        return {**prof, "expert_parallel": 1}
    if exchange is None:
        lat, spb = prof["comm"]["latency_s"], prof["comm"]["s_per_byte"]
        exchange = lambda nbytes: lat + spb * nbytes * (e - 1) / e  # noqa: E731
    layers = []
    for d in prof["layers"]:
        t = 2e3 * exchange(d["routed_bytes"]) if d.get("routed_bytes") else 0.0
        if t:
            d = {**d, "fwd_ms": d["fwd_ms"] + t, "bwd_ms": d["bwd_ms"] + t}
            if d.get("bwd_in_ms") is not None:  # (a split backward: the input gradient's pass exchanges)
                d["bwd_in_ms"] += t
        layers.append(d)
    return {**prof, "layers": layers, "expert_parallel": e}


def recomputed_ms(prof: dict, costs: list) -> list:
    """Per layer, the forward milliseconds its backward runs again: activation checkpointing
    (``prof["checkpointing"]``) recomputes every layer but the forward-only ones."""
    if not prof.get("checkpointing"):
        return [0.0] * len(costs)
    forward_only = set(prof.get("key", {}).get("forward_only", []))
    return [0.0 if c.name in forward_only else c.fwd_ms for c in costs]


def stage_times(prof: dict, parts: list) -> dict:
    """Per-stage forward, backward, optimizer seconds per micro-batch, and per boundary the seconds to
    send one micro-batch's activations (``comm``: one message per tensor of the tuple) and to send
    their gradients back (``comm_grad``: one message per float tensor that wants one); a backward
    includes the recomputed forward under activation checkpointing; ``W``: the part of the backward a split
    backward defers (the weight gradients of the trainable linear layers: ``LayerCost.backward_split``). With a
    step loss (``prof["step_loss"]``), ``F1`` is the forward-only pass's forward per stage and ``F`` the
    training pass's, which takes a frozen prefix's output from the first pass (``FirstPassMemo``)."""
    costs = layer_costs(prof)
    P = len(parts) - 1
    F = [sum(c.fwd_ms for c in costs[parts[s]:parts[s + 1]]) / 1e3 for s in range(P)]
    recompute = recomputed_ms(prof, costs)
    halves = [c.backward_split() for c in costs]
    B = [sum(b + w + r for (b, w), r in zip(halves[parts[s]:parts[s + 1]], recompute[parts[s]:parts[s + 1]])) / 1e3
         for s in range(P)]
    W = [sum(w for _, w in halves[parts[s]:parts[s + 1]]) / 1e3 for s in range(P)]
    opt = [sum(c.opt_ms for c in costs[parts[s]:parts[s + 1]]) / 1e3 for s in range(P)]
    lat, spb = prof["comm"]["latency_s"], prof["comm"]["s_per_byte"]
    last = [costs[parts[s + 1] - 1] for s in range(P - 1)]
    comm = [c.out_tensors * lat + spb * c.out_bytes for c in last]
    back = [c.grad_tensors * lat + spb * (c.out_bytes if c.grad_bytes is None else c.grad_bytes) for c in last]
    out = {"F": F, "B": B, "W": W, "opt": opt, "comm": comm, "comm_grad": back}
    if prof.get("step_loss"):  # the forward-only pass runs every layer; the training pass skips a frozen prefix
        out["F1"] = list(F)
        F[0] -= sum(c.fwd_ms for c in costs[:min(prof["step_loss"].get("frozen_prefix", 0), parts[1])]) / 1e3
    return out


def predict(prof: dict, parts: list, micro_batches: int, order: Order):
    """The simulated step of ``parts`` under ``order`` (a step loss's forward-only pass included,
    ``prof["step_loss"]``)."""
    t = stage_times(prof, parts)
    r = simulate(t["F"], t["B"], micro_batches, t["comm"], t["opt"], comm_grad=t["comm_grad"],
                 step_loss=bool(prof.get("step_loss")), first_pass=t.get("F1"), W=t["W"], order=order)
    r.parts = list(parts)
    return r


def pick_schedule(requested: str, plan: Plan, prof: Optional[dict], forward_only,
                  freeze_hint: Optional[Callable[[str], str]] = None, precision: str = "fp32", zero_stage: int = 0,
                  data_parallel: int = 1, memory_cap: Optional[int] = None) -> Plan:
    """The order of a fixed cut (``plan.parts``): ``requested`` by name, or for ``auto`` the orders that apply to
    the cut weighed as ``place`` weighs them with measured costs (``plan.schedules``, ``plan.weighed``); without
    them ``frozen_first`` where leading stages train nothing (a subset of 1F1B's work: no gradient sent to or
    awaited by those stages, one micro-batch's outputs held on them), else DeepSpeed's 1F1B - a split backward's
    memory is not taken unpriced. ``freeze_hint(layer)``: how to freeze what a layer trains
    (``config.groups.freeze_key``), for the refusal of ``frozen_first``."""
    if plan.num_stages == 1:
        plan.order = default_order()
        return plan
    orders = orders_for(requested, plan.parts, plan.layers, forward_only, freeze_hint)
    if prof is not None and prof.get("timed") is not False:
        _weigh(plan, prof, requested, {plan.chosen or plan.placement: plan.parts}, {}, memory_cap, precision,
               zero_stage, data_parallel, forward_only, freeze_hint, cut_fixed=True)
        return plan
    frozen = next((o for o in orders if o.name == "frozen_first"), None)
    plan.order = orders[0] if requested != "auto" else frozen or default_order()
    return plan


def ds_parts(weights: Optional[list], num_stages: int, method: str, names: list) -> list:
    """What DeepSpeed's own partition_method gives for these layers (parameters: DeepSpeed counts
    the layers' parameters as built, before mmpipe applies freezing, given as ``weights``;
    type:REGEX matches layer names)."""
    import re

    from deepspeed.runtime import utils as ds_utils
    if method == "uniform":
        return list(ds_utils.partition_uniform(num_items=len(names), num_parts=num_stages))
    if method == "parameters":
        return list(ds_utils.partition_balanced(weights=list(weights), num_parts=num_stages))
    if method.startswith("type:"):
        rx = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        return list(ds_utils.partition_balanced(weights=[1 if rx.search(n) else 0 for n in names],
                                                num_parts=num_stages))
    raise ValueError(method)


def type_partition(names: list, placement: str, num_stages: int) -> list[int]:
    """``type:REGEX``: DeepSpeed's rule (balance the layers the regex matches) over mmpipe's layer
    names, as ``mmpipe plan`` shows it (DeepSpeed itself would match the class name, PipeLayer)."""
    import re

    from deepspeed.runtime import utils as ds_utils

    try:
        rx = re.compile(placement.split(":", 1)[1], re.IGNORECASE)
    except re.error as e:
        raise ConfigError(f"parallel.placement={placement}: not a valid regex ({e})") from None
    weights = [1 if rx.search(n) else 0 for n in names]
    if sum(weights) < num_stages:
        raise ConfigError(f"parallel.placement={placement} matches {sum(weights)} layer(s), fewer than the "
                          f"{num_stages} stages (layers: {', '.join(names)}); use a regex that matches at least one "
                          "layer per stage, e.g. type:blocks")
    parts = [int(x) for x in ds_utils.partition_balanced(weights=weights, num_parts=num_stages)]
    if any(b <= a for a, b in zip(parts, parts[1:])):
        raise ConfigError(f"parallel.placement={placement} leaves a stage empty (boundaries {parts}); use a regex "
                          "that matches more layers, or placement balanced")
    return parts


def parts_from_plan_file(path: str, names: list, num_stages: int) -> list[int]:
    if not os.path.isfile(path):
        raise ConfigError(f"parallel.plan: file not found: {path} (a plan.json from a run, or {{\"stages\": [[layer names]...]}})")
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"parallel.plan: {path} is not valid JSON ({e}); give a run's plan.json or "
                          "{\"stages\": [[layer names], ...]}") from None
    stages = doc.get("stages") if isinstance(doc, dict) else None
    if not isinstance(stages, list) or len(stages) != num_stages:
        raise ConfigError(f"parallel.plan: {path} must hold \"stages\": a list of {num_stages} lists of layer names")
    try:
        return parts_from_lists(names, stages)
    except ValueError as e:
        raise ConfigError(f"parallel.plan: {path}: {e} (layers: {', '.join(names)})") from None
