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
- ``zb_h1``: zero bubble's handcrafted ZB-H1 (Qi et al., arXiv 2401.10241): each backward split into ``B`` (the
  input gradient, ``BackwardInputPass``: what the stage before waits for) and ``W`` (the weight gradients,
  ``BackwardWeightPass``: nobody waits for them); 1F1B's warm-up forwards, then F, B and - from stage s's
  (s+1)-th backward on - the W of the micro-batch s backwards earlier; the remaining W's fill the cool-down (a B
  and its W with nothing between them - the first stage's, which sends no gradient - run as one ``BackwardPass``). Peak
  live activations (forward run, B not yet) are 1F1B's (P - s on stage s); at most s micro-batches' weight-gradient
  inputs wait in stage s's queue. With F = B = W the bubble is (P - 1) / (3M + P - 1), a third of 1F1B's.

The order a run uses is one value, ``Order`` (the schedule's name and what it needs: ``frozen``), decided once
(``planning.place``) and handed to every reader.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, NamedTuple, Optional

import numpy as np


class Action(NamedTuple):
    kind: str
    micro_batch: Optional[int] = None
    chunk: int = 0  # the model chunk on this rank (one per rank today; DualPipeV / interleaving: two or more)


BACKWARD = ("BackwardPass", "BackwardInputPass")  # what frees a micro-batch's activations (and sends its gradient)
PASSES = ("ForwardPass", "BackwardPass", "FeaturesPass", "BackwardInputPass", "BackwardWeightPass")
COMPUTE = PASSES + ("LoadMicroBatch", "OptimizerStep", "GatherFeatures")
PARTNER = {"SendActivation": (1, "RecvActivation"), "RecvActivation": (-1, "SendActivation"),
           "SendGrad": (-1, "RecvGrad"), "RecvGrad": (1, "SendGrad")}
TAIL = (Action("ReduceTiedGrads"), Action("ReduceGrads"), Action("OptimizerStep"))

SCHEDULES: dict[str, Callable] = {}
APPLIES: dict[str, Callable] = {}  # name -> applies(P, frozen): a candidate of ``auto`` where True
READS_FROZEN: set = set()  # the schedules whose order depends on ``frozen`` (the others run every stage alike)
DEFAULT = "1f1b"  # DeepSpeed's own order: what a run gets where nothing else applies (one stage, no profile)


def register(name: str, applies: Optional[Callable[[int, int], bool]] = None, reads_frozen: bool = False):
    """Add a schedule ``fn(P, M, stage, frozen) -> [Action]`` under ``name`` (a plugin may add its own); ``applies(P,
    frozen)``: where ``parallel.schedule=auto`` weighs it (None: never; it runs when asked for by name);
    ``reads_frozen``: its order depends on the leading stages that train nothing."""
    def add(fn):
        SCHEDULES[name] = fn
        if applies is not None:
            APPLIES[name] = applies
        if reads_frozen:
            READS_FROZEN.add(name)
        return fn
    return add


@dataclass(frozen=True)
class Order:
    """The pipeline order of a run: the schedule's ``name`` and what it needs (``frozen``: the leading stages that
    train nothing, which ``frozen_first`` runs forward only). Decided once (``planning.place``) and read by the
    simulator, the memory model, the cost balancer, the stage clock, the runtime and the checkpoint record."""
    name: str
    frozen: int = 0

    def stream(self, P: int, M: int, stage: int, step_loss: bool = False) -> list:
        return stream(self.name, P, M, stage, frozen=self.frozen, step_loss=step_loss)

    def streams(self, P: int, M: int, step_loss: bool = False) -> tuple:
        return streams(self.name, P, M, self.frozen, step_loss)

    def splits_backward(self) -> bool:
        """Whether its backward runs as ``B`` and ``W`` apart (the runtime then defers weight gradients)."""
        return any(a.kind == "BackwardWeightPass" for a in stream(self.name, 2, 2, 1, frozen=self.frozen))


def default_order() -> Order:
    return Order(DEFAULT)


def order_of(name: str, frozen: int) -> Order:
    """Schedule ``name`` on a cut whose ``frozen`` leading stages train nothing (recorded where the order reads it)."""
    return Order(name, frozen if name in READS_FROZEN else 0)


def candidates(P: int, frozen: int) -> list:
    """The orders ``auto`` weighs for a cut of ``P`` stages whose ``frozen`` leading stages train nothing."""
    return [order_of(n, frozen) for n, ok in APPLIES.items() if ok(P, frozen)]


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


@register("1f1b", applies=lambda P, frozen: True)
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


@register("frozen_first", applies=lambda P, frozen: P > 1 and frozen > 0, reads_frozen=True)
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


def zb_h1_passes(P: int, M: int, s: int) -> list:
    """ZB-H1's compute order on stage ``s``: (kind, micro-batch) with kind F, B or W (see the module doc)."""
    warm = min(P - 1 - s, M)
    out, nf, nb, nw = [("F", m) for m in range(warm)], warm, 0, 0
    while nb < M:
        if nf < M:
            out.append(("F", nf))
            nf += 1
        out.append(("B", nb))
        nb += 1
        if nb - nw > (s if nf < M else 0):  # W's lag s backwards, then fill the cool-down
            out.append(("W", nw))
            nw += 1
    return out + [("W", m) for m in range(nw, M)]


def _unit_times(P: int, M: int, passes: list) -> dict:
    """(stage, kind, micro-batch) -> (start, end) of ``passes`` (per stage) run with every pass one unit long and
    transfers free: when each message is made and each pass starts."""
    pos, free, done, when = [0] * P, [0] * P, {}, {}
    while any(pos[s] < len(passes[s]) for s in range(P)):
        moved = False
        for s in range(P):
            if pos[s] >= len(passes[s]):
                continue
            k, m = passes[s][pos[s]]
            dep = {"F": (s - 1, "F") if s > 0 else None, "B": (s, "F") if s == P - 1 else (s + 1, "B"),
                   "W": (s, "B")}[k]
            if dep is not None and (dep[0], dep[1], m) not in done:
                continue
            start = max(free[s], done[(dep[0], dep[1], m)] if dep is not None else 0)
            free[s] = done[(s, k, m)] = start + 1
            when[(s, k, m)] = start
            pos[s] += 1
            moved = True
        if not moved:
            raise RuntimeError(f"zb_h1: no pass can run at {pos}")
    return when


@lru_cache(maxsize=64)
def _zb_h1_streams(P: int, M: int) -> tuple:
    """Every stage's ZB-H1 stream: its passes, and each message placed where the unit-time run makes it (a send
    at the end of the pass that makes it, its receive at the same time on the neighbour; at one time, the
    boundary with the stage before first, an activation before a gradient): both sides of a boundary then meet
    their messages in one order, and the blocking sends cannot wait on each other in a cycle."""
    passes = [zb_h1_passes(P, M, s) for s in range(P)]
    when = _unit_times(P, M, passes)
    out = []
    for s in range(P):
        timed = []  # (time, rank within the time, action)
        for k, m in passes[s]:
            t = when[(s, k, m)]
            if k == "F":
                if s > 0:
                    timed.append((when[(s - 1, "F", m)] + 1, 0, 0, Action("RecvActivation", m)))
                if s in (0, P - 1):
                    timed.append((t, 2, 0, Action("LoadMicroBatch", m)))
                timed.append((t, 3, 0, Action("ForwardPass", m)))
                if s < P - 1:
                    timed.append((t + 1, 1, 0, Action("SendActivation", m)))
            elif k == "B":
                if s < P - 1:
                    timed.append((when[(s + 1, "B", m)] + 1, 1, 1, Action("RecvGrad", m)))
                timed.append((t, 3, 0, Action("BackwardInputPass", m)))
                if s > 0:
                    timed.append((t + 1, 0, 1, Action("SendGrad", m)))
            else:
                timed.append((t, 3, 0, Action("BackwardWeightPass", m)))
        out.append(tuple(_fused(a for *_, a in sorted(timed, key=lambda x: x[:3]))) + TAIL)
    return tuple(out)


def _fused(actions) -> list:
    """A micro-batch's B and W with nothing between them (a first stage sends no input gradient) as one
    ``BackwardPass``: the same order, without the split's cost (its weight-gradient inputs read back later)."""
    out = []
    for a in actions:
        if a.kind == "BackwardWeightPass" and out and out[-1] == Action("BackwardInputPass", a.micro_batch):
            out[-1] = Action("BackwardPass", a.micro_batch)
        else:
            out.append(a)
    return out


@register("zb_h1", applies=lambda P, frozen: P > 1)
def zb_h1(P: int, M: int, s: int, frozen: int = 0) -> list:
    """ZB-H1 (see the module doc): F, B (input gradient) and W (weight gradient) per micro-batch."""
    return list(_zb_h1_streams(P, M)[s])


def leading_frozen(parts: list, names: list, forward_only) -> int:
    """How many leading stages of the cut ``parts`` (P + 1 layer indices over ``names``) hold only
    forward-only layers (frozen, nothing trainable before them): ``frozen_first``'s ``frozen``."""
    k = 0
    while k < len(parts) - 1 and all(n in forward_only for n in names[parts[k]:parts[k + 1]]):
        k += 1
    return k


def live_activations(actions) -> int:
    """The most micro-batches whose forward ran and whose backward (or input gradient, ``B``) has not: the
    activations (and output buffers) a stage holds at once. A forward-only stream keeps none for a backward: 1
    (the one it runs)."""
    live = peak = 0
    for a in actions:
        live += (a.kind == "ForwardPass") - (a.kind in BACKWARD)
        peak = max(peak, live)
    return peak if not forward_only(actions) else 1


def queued_weight_grads(actions) -> int:
    """The most micro-batches whose input gradient ran and whose weight gradient (``W``) has not: the weight-gradient
    inputs (each deferred layer's input and output gradient) a stage keeps besides its live activations."""
    live = peak = 0
    for a in actions:
        live += (a.kind == "BackwardInputPass") - (a.kind == "BackwardWeightPass")
        peak = max(peak, live)
    return peak


def buffers(actions) -> int:
    """Pipe buffers a stage's stream needs (DeepSpeed's ``num_pipe_buffers``: at least two): the most micro-batches
    held at once from their first action (a received activation, a loaded batch, the forward) to their last that
    reads the buffer (the backward, or the input gradient and its send)."""
    first, last = {}, {}
    for i, a in enumerate(actions):
        if a.micro_batch is None:
            continue
        if a.kind in ("RecvActivation", "LoadMicroBatch", "ForwardPass"):
            first.setdefault(a.micro_batch, i)
        if a.kind in BACKWARD + ("SendGrad",):
            last[a.micro_batch] = i
    if not last:
        return max(2, live_activations(actions))
    events = sorted([(i, 1) for i in first.values()] + [(last.get(m, i) + 0.5, -1) for m, i in first.items()])
    held = peak = 0
    for _, d in events:
        held += d
        peak = max(peak, held)
    return max(2, peak)


def forward_only(actions) -> bool:
    return not any(a.kind in BACKWARD for a in actions)


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


def step_seconds(order: Order, C: np.ndarray) -> np.ndarray:
    """Predicted seconds of one step of ``order`` over micro-batches with per-stage costs ``C`` [..., M, P]
    (forward one third, backward two thirds - a split backward's input and weight gradients a third each; a
    forward-only stage's forward the whole), free transfers: [...]. One stage: the sum. The cost balancer's step
    price."""
    M, P = C.shape[-2], C.shape[-1]
    if P == 1:
        return C.sum(axis=(-1, -2))
    sts = order.streams(P, M)
    only = [forward_only(x) for x in sts]
    share = {"ForwardPass": 1 / 3, "BackwardPass": 2 / 3, "BackwardInputPass": 1 / 3, "BackwardWeightPass": 1 / 3}

    def duration(s, a, i):
        if a.kind not in share:
            return 0.0
        return C[..., a.micro_batch, s] * (1.0 if only[s] else share[a.kind])

    return np.max(np.stack(np.broadcast_arrays(*replay(sts, duration))), axis=0)
