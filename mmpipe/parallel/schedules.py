"""The pipeline order as data: per stage, the list of actions it runs in one optimizer step.

A schedule is a registered function ``(P, M, stage, frozen) -> [Action]``; ``stream`` adds a step loss's
forward-only features pass in front. Everything that needs the order reads these streams: the simulator
(``planning/simulate.py``), the memory model (``live_activations``), the cost balancer's step pricing
(``replay`` over candidate cost arrays), the stage clock's per-micro-batch attribution
(``StageClock.micro_batch_busy``), and the runtime, which installs a stage's stream as DeepSpeed's
pipeline schedule (``ds_compat.set_train_schedule``). Action kinds are DeepSpeed's instruction names, plus
``FeaturesPass`` (a step loss's forward-only pass) and ``GatherFeatures`` (the last stage's batch loss
between the passes). No DeepSpeed import here.

- ``1f1b``: DeepSpeed's ``TrainSchedule``, instruction for instruction (its deferred activation sends
  included; ``tests/test_schedules.py`` compares the two).
- ``gpipe``: every forward, then every backward (the comparison the bubble formula is about).
- ``frozen_first``: the ``frozen`` leading stages, whose layers are all frozen with nothing trainable before
  them, run their M forwards back to back and send them on; they never wait for or receive a gradient.
  The stages after them run 1F1B among themselves, the first of them receiving its inputs and sending no
  gradient back.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable, NamedTuple, Optional

import numpy as np


class Action(NamedTuple):
    kind: str
    micro_batch: Optional[int] = None
    chunk: int = 0  # the model chunk on this rank (one per rank today; DualPipeV / interleaving: two or more)


PASSES = ("ForwardPass", "BackwardPass", "FeaturesPass")
COMPUTE = PASSES + ("LoadMicroBatch", "OptimizerStep", "GatherFeatures")
PARTNER = {"SendActivation": (1, "RecvActivation"), "RecvActivation": (-1, "SendActivation"),
           "SendGrad": (-1, "RecvGrad"), "RecvGrad": (1, "SendGrad")}
TAIL = (Action("ReduceTiedGrads"), Action("ReduceGrads"), Action("OptimizerStep"))

SCHEDULES: dict[str, Callable] = {}


def register(name: str):
    """Add a schedule ``fn(P, M, stage, frozen) -> [Action]`` under ``name`` (a plugin may add its own)."""
    def add(fn):
        SCHEDULES[name] = fn
        return fn
    return add


def stream(name: str, P: int, M: int, stage: int, *, frozen: int = 0, step_loss: bool = False) -> list:
    """Stage ``stage``'s actions for one step of ``M`` micro-batches over ``P`` stages; ``frozen``: how many
    leading stages train nothing (``frozen_first`` reads it); ``step_loss``: a features pass first."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}: one of {', '.join(sorted(SCHEDULES))}")
    return (_features_pass(P, M, stage) if step_loss else []) + SCHEDULES[name](P, M, stage, frozen)


@lru_cache(maxsize=256)
def streams(name: str, P: int, M: int, frozen: int = 0, step_loss: bool = False) -> tuple:
    """Every stage's stream (cached; tuples)."""
    return tuple(tuple(stream(name, P, M, s, frozen=frozen, step_loss=step_loss)) for s in range(P))


def _features_pass(P: int, M: int, s: int) -> list:
    """A step loss's forward-only pass: DeepSpeed's ``InferenceSchedule`` (its forwards as ``FeaturesPass``),
    then the last stage's ``GatherFeatures``."""
    out = []
    for step in range(M + P - 1):
        m = step - s
        ok, prev = 0 <= m < M, 0 <= m - 1 < M
        if s in (0, P - 1) and ok:
            out.append(Action("LoadMicroBatch", m))
        send = [Action("SendActivation", m - 1)] if s < P - 1 and prev else []
        recv = [Action("RecvActivation", m)] if s > 0 and ok else []
        out += send + recv if s % 2 == 0 else recv + send
        if ok:
            out.append(Action("FeaturesPass", m))
    return out + ([Action("GatherFeatures")] if s == P - 1 else [])


def _step_micro_batch(step: int, P: int, s: int) -> tuple:
    """DeepSpeed's ``TrainSchedule._step_to_micro_batch``: (micro-batch, is forward) of a step slot."""
    if step % 2 == s % 2:
        return (step - s % 2) // 2 - s // 2, True
    if step % 2 == 0:
        return step // 2 - P + (s + 1) // 2, False
    return (step - 1) // 2 - P + 1 + s // 2, False


@register("1f1b")
def pipedream_flush(P: int, M: int, s: int, frozen: int = 0) -> list:
    """1F1B (PipeDream-Flush) as DeepSpeed's ``TrainSchedule`` runs it: ``P - 1 - s`` warm-up forwards, then
    a forward and a backward in turn; an activation is sent one slot late (before the next backward's
    gradient is received)."""
    out, prev = [], -1
    for step in range(2 * (M + P - 1)):
        m, fwd = _step_micro_batch(step, P, s)
        ok, was = 0 <= m < M, 0 <= prev < M
        if fwd:
            out += [Action("SendGrad", prev)] if was and s > 0 else []
            out += [Action("RecvActivation", m)] if ok and s > 0 else []
        else:
            out += [Action("RecvGrad", m)] if ok and s < P - 1 else []
            out += [Action("SendActivation", prev)] if was and s < P - 1 else []
        if fwd and ok and s in (0, P - 1):
            out.append(Action("LoadMicroBatch", m))
        if ok:
            out.append(Action("ForwardPass" if fwd else "BackwardPass", m))
        prev = m
    return out + list(TAIL)


@register("gpipe")
def gpipe(P: int, M: int, s: int, frozen: int = 0) -> list:
    """Every forward, then every backward in reverse (each send right after its pass)."""
    out = []
    for m in range(M):
        out += [Action("RecvActivation", m)] if s > 0 else []
        out += [Action("LoadMicroBatch", m)] if s in (0, P - 1) else []
        out += [Action("ForwardPass", m)] + ([Action("SendActivation", m)] if s < P - 1 else [])
    for m in reversed(range(M)):
        out += ([Action("RecvGrad", m)] if s < P - 1 else []) + [Action("BackwardPass", m)]
        out += [Action("SendGrad", m)] if s > 0 else []
    return out + list(TAIL)


@register("frozen_first")
def frozen_first(P: int, M: int, s: int, frozen: int = 0) -> list:
    """The ``frozen`` leading stages forward only, back to back; 1F1B on the stages after them."""
    k = min(max(frozen, 0), P - 1)
    if s < k:
        out = []
        for m in range(M):
            out += [Action("RecvActivation", m)] if s > 0 else [Action("LoadMicroBatch", m)]
            out += [Action("ForwardPass", m), Action("SendActivation", m)]
        return out + list(TAIL)
    sub = pipedream_flush(P - k, M, s - k)
    if s > k or k == 0:
        return sub
    out = []  # the first trained stage: its inputs come from stage k - 1, no gradient goes back
    for a in sub:
        if a.kind == "LoadMicroBatch":
            out += [Action("RecvActivation", a.micro_batch)] + ([a] if s == P - 1 else [])
        else:
            out.append(a)
    return out


def leading_frozen(parts: list, names: list, forward_only) -> int:
    """How many leading stages of the cut ``parts`` (P + 1 layer indices over ``names``) hold only
    forward-only layers (frozen, nothing trainable before them): ``frozen_first``'s ``frozen``."""
    k = 0
    while k < len(parts) - 1 and all(n in forward_only for n in names[parts[k]:parts[k + 1]]):
        k += 1
    return k


def live_activations(actions) -> int:
    """The most micro-batches whose forward ran and whose backward has not: the activations (and output
    buffers) a stage holds at once. A forward-only stream keeps none for a backward: 1 (the one it runs)."""
    live = peak = 0
    for a in actions:
        live += (a.kind == "ForwardPass") - (a.kind == "BackwardPass")
        peak = max(peak, live)
    return peak if any(a.kind == "BackwardPass" for a in actions) else 1


def buffers(actions) -> int:
    """Pipe buffers a stage's stream needs (DeepSpeed's ``num_pipe_buffers``: at least two)."""
    return max(2, live_activations(actions))


def forward_only(actions) -> bool:
    return not any(a.kind == "BackwardPass" for a in actions)


_ORDERS: dict = {}  # id(streams) -> (streams, order): ``streams()`` hands out the same tuples, and a tuple of
# tuples is hashed anew on every lookup (the balancer replays thousands of candidates a step)


def order(sts: tuple) -> tuple:
    hit = _ORDERS.get(id(sts))
    if hit is not None and hit[0] is sts:
        return hit[1]
    out = _order(sts)
    if len(_ORDERS) > 256:
        _ORDERS.clear()
    _ORDERS[id(sts)] = (sts, out)
    return out


def _order(sts: tuple) -> tuple:
    """A dependency order over every stage's actions: ``(s, i, t, j)`` for a send/receive pair (stage s's
    i-th action with stage t's j-th: blocking rendezvous, as ``torch.distributed.send/recv``) or
    ``(s, i, -1, -1)`` for one stage's own action. Raises on a deadlock."""
    P = len(sts)
    ptr, out = [0] * P, []
    total = sum(len(x) for x in sts)
    while len(out) < total:
        moved = False
        for s in range(P):
            while ptr[s] < len(sts[s]):
                kind = sts[s][ptr[s]].kind
                if kind in PARTNER:
                    d, other = PARTNER[kind]
                    t = s + d
                    if ptr[t] >= len(sts[t]) or sts[t][ptr[t]].kind != other:
                        break  # until the neighbour reaches the matching action
                    out.append((s, ptr[s], t, ptr[t]))
                    out.append(None)  # (counts the partner's action)
                    ptr[s] += 1
                    ptr[t] += 1
                else:
                    out.append((s, ptr[s], -1, -1))
                    ptr[s] += 1
                moved = True
        if not moved:
            raise RuntimeError("pipeline schedule deadlock at "
                               f"{[sts[s][ptr[s]] if ptr[s] < len(sts[s]) else None for s in range(P)]}")
    return tuple(x for x in out if x is not None)


def replay(sts: tuple, duration: Callable, transfer: Optional[Callable] = None, timeline: Optional[list] = None):
    """Run the streams ``sts`` with ``duration(s, action, i)`` seconds per own action (a float, or an ndarray
    for many candidates at once) and ``transfer(s, t, action)`` per send/receive pair (default free): per
    stage, the time it finishes. ``timeline`` (optional) gets (stage, kind, micro-batch, start, end, i)."""
    clock: list = [0.0] * len(sts)
    for s, i, t, j in order(sts):
        a = sts[s][i]
        if t < 0:
            start = clock[s]
            clock[s] = start + duration(s, a, i)
            if timeline is not None:
                timeline.append((s, a.kind, a.micro_batch, start, clock[s], i))
            continue
        x, y = clock[s], clock[t]
        start = max(x, y) if type(x) is float and type(y) is float else np.maximum(x, y)
        end = start + (transfer(s, t, a) if transfer is not None else 0.0)
        clock[s] = clock[t] = end
        if timeline is not None:
            timeline.append((s, a.kind, a.micro_batch, start, end, i))
            timeline.append((t, sts[t][j].kind, sts[t][j].micro_batch, start, end, j))
    return clock


def step_seconds(name: str, C: np.ndarray, frozen: int = 0) -> np.ndarray:
    """Predicted seconds of one step of ``name`` over micro-batches with per-stage costs ``C`` [..., M, P]
    (forward one third, backward two thirds; a forward-only stage's forward the whole), free transfers:
    [...]. One stage: the sum. The cost balancer's step price."""
    M, P = C.shape[-2], C.shape[-1]
    if P == 1:
        return C.sum(axis=(-1, -2))
    sts = streams(name, P, M, frozen)
    only = [forward_only(x) for x in sts]
    share = {"ForwardPass": 1 / 3, "BackwardPass": 2 / 3}

    def duration(s, a, i):
        if a.kind not in share:
            return 0.0
        return C[..., a.micro_batch, s] * (1.0 if only[s] else share[a.kind])

    return np.max(np.stack(np.broadcast_arrays(*replay(sts, duration))), axis=0)
