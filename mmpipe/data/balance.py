"""``data.balance: cost``: each optimizer step's samples regrouped so that every (data-parallel rank,
micro-batch) slot costs about the same on every pipeline stage.

A sample is two numbers (``SampleUnits``): its vision units (image tokens: what the vision tower and
projector compute on; 1 per image for a dual encoder) and its tokens (what the text side computes on).
``StagePrices`` holds, per pipeline stage, the seconds per vision unit and per token slot (forward +
backward, from the measured layer profile: ``mmpipe.planning.prices``). A micro-batch's cost on
stage s is ``vision[s] x its vision units + tokens[s] x rows x padded length + squares[s] x rows x padded
length²`` (the last: attention's score products, which grow with a row's length squared; a linear-attention
or recurrent layer has none) (padding as the collate pads: to the longest row, rounded up to
``pad_multiple``, at most ``max_length``; or always ``max_length``), so grouping similar lengths (less padding) and spreading the heavy samples are one
objective. A rank's step is its micro-batches run through the run's pipeline schedule
(``parallel.schedules.step_seconds``: the simulator's replay of the stages' streams, backward = 2 x forward),
so uneven slots cost the bubbles they cause; the step is the slowest rank's. ``regroup`` searches swaps of samples between micro-batches of the step
(the same sizes, the same set of samples: the step's loss and gradients are the same sums) that
lower (slowest rank, mean rank, sum of squared stage costs), deterministically, and reports the
predicted spread (max / mean slot pace) before and after."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from mmpipe.data.processes import pool_context
from mmpipe.parallel.schedules import Order, step_seconds


@dataclass
class SampleUnits:
    """Per dataset item: ``vision`` units (image tokens; 1 per image for a dual encoder) and text
    ``tokens`` (image tokens included where the language model reads them)."""
    vision: np.ndarray
    tokens: np.ndarray

    def __post_init__(self):
        self.vision = np.asarray(self.vision, dtype=np.float64)
        self.tokens = np.asarray(self.tokens, dtype=np.int64)


@dataclass
class StagePrices:
    """Seconds per vision unit and per token slot (a row's padded position), per stage; ``max_length``,
    ``pad_multiple`` and ``fixed_length`` say how the collate pads a micro-batch's rows."""
    vision: list
    tokens: list
    max_length: int
    pad_multiple: int = 1
    fixed_length: bool = False
    base: Optional[list] = None  # seconds per micro-batch per stage, whatever it holds (a refit's intercept)
    order: Optional[Order] = None  # the run's pipeline order: how a rank's micro-batches are priced as a step
    # (``schedules.step_seconds``; one stage: their sum)
    squares: Optional[list] = None  # seconds per row x padded length², per stage (attention's scores)

    def __post_init__(self):
        self.base = list(self.base) if self.base is not None else [0.0] * len(self.vision)
        self.squares = list(self.squares) if self.squares is not None else [0.0] * len(self.vision)

    def scaled(self, vision: list, tokens: list, base: list) -> "StagePrices":
        """These prices with each stage's vision and text prices multiplied (a row's slots and its squares by
        the same factor) and its base set."""
        return StagePrices([p * a for p, a in zip(self.vision, vision)], [p * b for p, b in zip(self.tokens, tokens)],
                           self.max_length, self.pad_multiple, self.fixed_length, list(base), self.order,
                           [p * b for p, b in zip(self.squares, tokens)])

    def text_slots(self, features: np.ndarray) -> np.ndarray:
        """[stages, micro-batches]: each micro-batch's text work on each stage in token slots (its slots, plus
        its squares at the stage's price per square over its price per slot): what a refit scales."""
        F = np.asarray(features, dtype=np.float64).reshape(-1, 3)
        ratio = [q / t if t > 0 else 0.0 for q, t in zip(self.squares, self.tokens)]
        return np.stack([F[:, 1] + r * F[:, 2] for r in ratio])

    def step(self, C: np.ndarray) -> np.ndarray:
        """Predicted seconds of a rank's step over micro-batches with per-stage costs ``C`` [..., M, P]."""
        if C.shape[-1] > 1 and self.order is None:
            raise ValueError("StagePrices.order: a pipeline's prices need the run's order")
        return step_seconds(self.order, C) if C.shape[-1] > 1 else C.sum(axis=(-1, -2))


class StepBalancer:
    """Regroups a step's micro-batches (``regroup``); keeps the last step's predicted spreads."""

    def __init__(self, units: SampleUnits, prices: StagePrices, ranks: int, max_swaps: Optional[int] = None,
                 variable: bool = False, evenness: float = 0.25, micro_batch_sync: bool = False):
        self.units, self.ranks = units, ranks
        self.ahead = None  # ``start_ahead``: the next step regrouped in a worker process
        self._args = (ranks, max_swaps, variable, evenness, micro_batch_sync)
        self.variable = variable  # micro-batches may change size (a family whose shapes change per micro-batch)
        self.schedule: list = []  # [(first step, StagePrices)]: refit prices from that step on (``reprice``)
        self.set_prices(prices)
        self.max_swaps = max_swaps
        self.last: dict = {}
        # the objective's weight on the slot spread (max / mean pace - 1), per unit of the mean rank's step.
        # One stage: a rank's micro-batches run back to back, the ranks meet at the step's gradient reduction,
        # so the slots' evenness does not matter and the spread is the ranks' - unless the ranks meet at every
        # micro-batch (``micro_batch_sync``: ZeRO-2/3 reduce each micro-batch's gradients)
        self.by_rank = len(self.pv) == 1 and not micro_batch_sync
        self.EVEN = 0.0 if self.by_rank else evenness

    def set_prices(self, prices: StagePrices) -> None:
        self.prices = prices
        self.pv = np.asarray(prices.vision, dtype=np.float64)
        self.pt = np.asarray(prices.tokens, dtype=np.float64)
        self.pb = np.asarray(prices.base, dtype=np.float64)
        self.pq = np.asarray(prices.squares, dtype=np.float64)

    def reprice(self, prices: StagePrices, first_step: int) -> None:
        """Regroup from step ``first_step`` on with ``prices`` (``mmpipe.train.price_refit``)."""
        if not self.schedule:
            self.schedule.append((0, self.prices))
        self.schedule = self.schedule[-3:] + [(first_step, prices)]
        if self.ahead is not None:
            self.ahead.drop_from(first_step)

    def prices_at(self, step: int) -> StagePrices:
        """The prices in force at ``step``: the last refit that starts by then (else the current)."""
        return next((p for s, p in reversed(self.schedule) if s <= step), self.prices)

    def prices_for(self, step: int) -> None:
        """Take the prices in force at ``step``."""
        p = self.prices_at(step)
        if p is not self.prices:
            self.set_prices(p)

    def regroup_step(self, step: int, groups: list, following: Optional[list] = None) -> list:
        """``regroup`` of step ``step`` with the prices in force then (done ahead in the worker process,
        where one runs: ``start_ahead``); ``following``: the next step's groups, to start on now."""
        self.prices_for(step)
        got = None
        try:
            got = self.ahead.take(step, self.prices) if self.ahead is not None else None
            if self.ahead is not None and following is not None:
                self.ahead.submit(step + 1, following, self.prices_at(step + 1))
        except Exception as e:  # a lost worker (killed, out of memory): regroup here from now on
            import warnings
            warnings.warn(f"data.balance=cost: the regrouping worker failed ({type(e).__name__}: {e}); "
                          "regrouping in the training process from now on")
            self.close()
            got = None
        if got is None:
            return self.regroup(groups)
        out, self.last = got
        return out

    def start_ahead(self) -> None:
        """Regroup each next step in a worker process while this one trains (the search costs 0.1-1.5 s
        a step at 32-256 samples on one core): the same function of the same inputs, so the same groups."""
        if self.ahead is None:
            self.ahead = _Ahead(self)

    def close(self) -> None:
        if self.ahead is not None:
            ahead, self.ahead = self.ahead, None
            ahead.close()

    def schedule_from(self, step: int) -> list:
        """[[first step, prices as a dict]] of the prices in force at ``step`` and those to come (saved
        with a checkpoint's data position)."""
        from dataclasses import asdict
        now = max((s for s, _ in self.schedule if s <= step), default=0)
        return [[max(s, step), asdict(p)] for s, p in self.schedule if s >= now]

    def restore_schedule(self, saved: list) -> None:
        self.schedule = [(int(s), StagePrices(**{**{k: v for k, v in p.items() if k not in ("order", "frozen")},
                                                 "order": self.prices.order}))  # this run's pipeline order
                         for s, p in saved]

    # ---- costs -------------------------------------------------------------------------------
    def features(self, groups: list) -> np.ndarray:
        """[micro-batches, 3]: each micro-batch's vision units, token slots (rows x padded length) and squares
        (rows x padded length²)."""
        out = np.zeros((len(groups), 3))
        for k, g in enumerate(groups):
            idx = np.asarray(g, dtype=np.int64)
            if len(idx):
                L = float(self._padded(self.units.tokens[idx].max()))
                out[k] = (self.units.vision[idx].sum(), len(idx) * L, len(idx) * L * L)
        return out

    def group_cost(self, group) -> np.ndarray:
        """Predicted seconds of one micro-batch on each stage."""
        v, slots, squares = self.features([group])[0]
        return self.pv * v + self.pt * slots + self.pq * squares + (self.pb if len(group) else 0.0)

    def slot_costs(self, groups: list) -> np.ndarray:
        """[micro-batches, stages] predicted seconds."""
        return np.stack([self.group_cost(g) for g in groups])

    def spread(self, groups: list) -> float:
        """Max over mean of the slots' paces (a slot's pace: its slowest stage); of the ranks' steps where
        only they wait for each other (``by_rank``)."""
        pace = self.slot_costs(groups).max(axis=1)
        if self.by_rank:
            pace = pace.reshape(self.ranks, -1).sum(axis=1)
        return float(pace.max() / pace.mean()) if pace.mean() > 0 else 1.0

    def step_time(self, groups: list) -> float:
        """Predicted step: the slowest rank's 1F1B (rank r holds micro-batches r*A .. r*A+A-1)."""
        C = self.slot_costs(groups)
        return float(self.prices.step(C.reshape(self.ranks, -1, C.shape[1])).max())

    # ---- search ------------------------------------------------------------------------------
    def _objective(self, C: np.ndarray) -> float:
        """Slowest rank + half the mean rank + the slot spread's excess (weighed by ``EVEN``: even slots
        keep the pipeline's pace when the predictions err) + a small sum of squared stage costs."""
        T = self.prices.step(C.reshape(self.ranks, -1, C.shape[1]))
        pace = C.max(axis=1)
        spread = pace.max() / pace.mean() if pace.mean() > 0 else 1.0
        return float(T.max() + 0.5 * T.mean() + self.EVEN * (spread - 1) * T.mean() + self._kappa * (C * C).sum())

    def regroup(self, groups: list) -> list:
        """The step's micro-batches (rank-major, each a list of dataset indices) regrouped: the same
        count and set of samples, the same sizes (unless ``variable``: then none empty and none heavier
        than the heaviest given one); each group keeps its samples in ascending index order."""
        groups = [list(g) for g in groups]
        if not groups:
            return groups
        C0 = self.slot_costs(groups)
        self._kappa = 1e-3 / max(float(C0.mean()), 1e-30)
        self._cap = self._caps(groups)
        before = {"before": self.spread(groups), "step_before": self.step_time(groups)}
        best = groups
        if len(groups) > 1:
            cands = [self._search(groups)]
            # a second start: lengths sorted into groups, dealt to ranks in a snake (little padding)
            order = sorted((i for g in groups for i in g), key=lambda i: (-int(self.units.tokens[i]), i))
            A, start, k = len(groups) // self.ranks, [], 0
            snake = [None] * len(groups)
            for j, g in enumerate(groups):
                rnd, pos = divmod(j, self.ranks)
                r = pos if rnd % 2 == 0 else self.ranks - 1 - pos
                snake[r * A + rnd] = order[k:k + len(g)]
                k += len(g)
            if [len(g) for g in snake] == [len(g) for g in groups] and self._within(snake):
                cands.append(self._search(snake))
            lpt = self._longest_first(groups)
            if lpt is not None:
                cands.append(self._search(lpt))
            for c in cands:
                if self._objective(self.slot_costs(c)) < self._objective(self.slot_costs(best)) * (1 - 1e-9):
                    best = c
        best = [sorted(g) for g in best]
        ideal = float(self.slot_costs(best).sum(axis=0).max()) / self.ranks  # every stage busy, every rank equal
        self.last = {**before, "after": self.spread(best), "step_after": self.step_time(best),
                     "ideal": ideal}
        return best

    def _padded(self, longest):
        """The collate's padded length of rows whose longest holds ``longest`` tokens (elementwise)."""
        p = self.prices
        if p.fixed_length:
            return np.full_like(longest, p.max_length)
        return np.minimum(p.max_length, -(-longest // p.pad_multiple) * p.pad_multiple)

    def _search(self, groups: list) -> list:
        """Best-improvement changes until none lowers the objective: one sample of a slowest-paced group
        swapped with any sample of another group (all candidates of a sample priced at once), or, with
        ``variable`` sizes, moved to another group (within ``caps``: no group over the step's heaviest
        plain micro-batch in vision units or token slots; none emptied)."""
        groups = [list(g) for g in groups]
        G, R = len(groups), self.ranks
        A = G // R
        ids = np.array([i for g in groups for i in g], dtype=np.int64)
        owner = np.array([h for h, g in enumerate(groups) for _ in g], dtype=np.int64)
        rows = np.array([len(g) for g in groups], dtype=np.int64)
        v, t = self.units.vision[ids].copy(), self.units.tokens[ids].copy()
        pv, pt, pb, pq = self.pv[None, :], self.pt[None, :], self.pb[None, :], self.pq[None, :]
        cap_v, cap_s = self._cap
        cap = self.max_swaps if self.max_swaps is not None else 4 * len(ids)
        for _ in range(cap):
            V = np.bincount(owner, weights=v, minlength=G)
            rows = np.bincount(owner, minlength=G)
            # per position: the longest other row of its group (top two per group)
            top1 = np.full(G, -1, dtype=np.int64)
            np.maximum.at(top1, owner, t)
            is_top = t == top1[owner]
            n_top = np.bincount(owner, weights=is_top.astype(np.float64), minlength=G)
            t2 = np.where(is_top, -1, t)
            top2 = np.full(G, -1, dtype=np.int64)
            np.maximum.at(top2, owner, t2)
            excl = np.where(is_top & (n_top[owner] < 2), top2[owner], top1[owner])
            L1 = self._padded(np.maximum(top1, 0)).astype(np.float64)
            C = pv * V[:, None] + pt * (rows * L1)[:, None] + pq * (rows * L1 * L1)[:, None] + pb
            pace = C.max(axis=1)
            Cr = C.reshape(R, A, -1)
            T = self.prices.step(Cr)
            spread = pace.max() / pace.mean() if pace.mean() > 0 else 1.0
            obj = T.max() + 0.5 * T.mean() + self.EVEN * (spread - 1) * T.mean() + self._kappa * (C * C).sum()
            order = np.argsort(-pace, kind="stable")
            top, topv = np.full(3, -1), np.zeros(3)
            top[:min(3, G)], topv[:min(3, G)] = order[:3], pace[order[:3]]
            state = (C, Cr, T, pace, top, topv)
            best = None
            for g in order[:4]:
                for a in np.nonzero(owner == g)[0]:
                    # a swapped with each sample j of another group h
                    j = np.nonzero(owner != g)[0]
                    h = owner[j]
                    Lg = self._padded(np.maximum(np.maximum(excl[a], t[j]), 0))
                    Vg, Sg, Qg = V[g] - v[a] + v[j], rows[g] * Lg, rows[g] * Lg.astype(np.float64) ** 2
                    Lh = self._padded(np.maximum(np.maximum(excl[j], t[a]), 0))
                    Vh, Sh, Qh = V[h] - v[j] + v[a], rows[h] * Lh, rows[h] * Lh.astype(np.float64) ** 2
                    cands = [(j, h, Vg, Sg, Qg, Vh, Sh, Qh)]
                    if self.variable and rows[g] > 1:  # a moved to each other group h
                        h = np.array([x for x in range(G) if x != g], dtype=np.int64)
                        Lg = self._padded(np.full(len(h), max(int(excl[a]), 0)))
                        Lh = self._padded(np.maximum(np.maximum(top1[h], t[a]), 0))
                        Lg, Lh = Lg.astype(np.float64), Lh.astype(np.float64)
                        cands.append((None, h, np.full(len(h), V[g] - v[a]), (rows[g] - 1) * Lg, (rows[g] - 1) * Lg * Lg,
                                      V[h] + v[a], (rows[h] + 1) * Lh, (rows[h] + 1) * Lh * Lh))
                    for j, h, Vg, Sg, Qg, Vh, Sh, Qh in cands:
                        ok = (Vg <= cap_v) & (Sg <= cap_s) & (Vh <= cap_v) & (Sh <= cap_s)
                        if not ok.any():
                            continue
                        Cg = pv * Vg[:, None] + pt * Sg[:, None] + pq * Qg[:, None] + pb
                        Ch = pv * Vh[:, None] + pt * Sh[:, None] + pq * Qh[:, None] + pb
                        o = np.where(ok, self._score(state, g, h, Cg, Ch, A), np.inf)
                        k = int(np.argmin(o))
                        if o[k] < obj * (1 - 1e-9) and (best is None or o[k] < best[0]):
                            best = (o[k], a, None if j is None else j[k], h[k])
                if best is not None:
                    break
            if best is None:
                break
            _, a, b, h = best
            if b is None:
                owner[a] = h
            else:
                owner[a], owner[b] = owner[b], owner[a]
        return [sorted(ids[owner == h].tolist()) for h in range(G)]

    def _score(self, state, g: int, h: np.ndarray, Cg: np.ndarray, Ch: np.ndarray, A: int) -> np.ndarray:
        """The objective after each candidate change of group ``g`` (to costs ``Cg`` [K, P]) and group
        ``h[k]`` (to ``Ch[k]``)."""
        C, Cr, T, pace, top, topv = state
        G = len(pace)
        K, rg = len(h), g // A
        Tn = np.repeat(T[None, :], K, axis=0)
        # the rank of g, with g (and h where it is on the same rank) changed
        X = np.repeat(Cr[rg][None], K, axis=0)
        X[:, g % A] = Cg
        same = h // A == rg
        X[same, h[same] % A] = Ch[same]
        Tn[:, rg] = self.prices.step(X)
        for r in set((h // A).tolist()) - {rg}:  # the other rank h is on
            sel = np.nonzero(h // A == r)[0]
            Y = np.repeat(Cr[r][None], len(sel), axis=0)
            Y[np.arange(len(sel)), h[sel] % A] = Ch[sel]
            Tn[sel, r] = self.prices.step(Y)
        sq = (C * C).sum() - (C[g] ** 2).sum() - (C[h] ** 2).sum(axis=1) + (Cg ** 2).sum(axis=1) + (Ch ** 2).sum(axis=1)
        pg, ph = Cg.max(axis=1), Ch.max(axis=1)
        mean = (pace.sum() - pace[g] - pace[h] + pg + ph) / G
        # the largest pace of the other slots: the first of the three largest that is neither g nor h
        rest = np.where((top[0] != g) & (top[0] != h), topv[0],
                        np.where((top[1] != g) & (top[1] != h), topv[1], topv[2]))
        sp = np.maximum(np.maximum(rest, pg), ph) / np.maximum(mean, 1e-30)
        return Tn.max(axis=1) + 0.5 * Tn.mean(axis=1) + self.EVEN * (sp - 1) * Tn.mean(axis=1) + self._kappa * sq

    def _longest_first(self, groups: list) -> Optional[list]:
        """A third start: the step's samples, longest first, each into the micro-batch it leaves the least
        paced (within the caps; with fixed sizes, one with room), the micro-batches then dealt to ranks
        heaviest first in a snake. With ``variable`` sizes long rows end up with few others (little
        padding) and short ones together. None where the caps leave a sample nowhere to go."""
        G, R = len(groups), self.ranks
        size = max(len(g) for g in groups)
        order = sorted((i for g in groups for i in g),
                       key=lambda i: (-int(self.units.tokens[i]), -float(self.units.vision[i]), i))
        bins = [[] for _ in range(G)]
        V, L, rows = np.zeros(G), np.zeros(G, dtype=np.int64), np.zeros(G, dtype=np.int64)
        for i in order:
            Vn, Ln = V + self.units.vision[i], self._padded(np.maximum(L, int(self.units.tokens[i])))
            Sn = (rows + 1) * Ln
            Qn = (rows + 1) * Ln.astype(np.float64) ** 2
            pace = (self.pv[None, :] * Vn[:, None] + self.pt[None, :] * Sn[:, None] + self.pq[None, :] * Qn[:, None]
                    + self.pb[None, :]).max(axis=1)
            ok = (Vn <= self._cap[0]) & (Sn <= self._cap[1])
            if not self.variable:
                ok &= rows < size
            if not ok.any():
                return None
            b = int(np.argmin(np.where(ok, pace, np.inf)))
            bins[b].append(i)
            V[b], L[b], rows[b] = Vn[b], max(L[b], int(self.units.tokens[i])), rows[b] + 1
        if min(len(b) for b in bins) == 0 or (not self.variable and sorted(map(len, bins)) != sorted(map(len, groups))):
            return None
        heavy = sorted(range(G), key=lambda b: -float(self.slot_costs([bins[b]]).max()))
        A, out = G // R, [None] * G
        for j, b in enumerate(heavy):
            rnd, pos = divmod(j, R)
            out[(pos if rnd % 2 == 0 else R - 1 - pos) * A + rnd] = sorted(bins[b])
        return out

    def _within(self, groups: list) -> bool:
        f = self.features(groups)
        return bool(f[:, 0].max() <= self._cap[0] and f[:, 1].max() <= self._cap[1])

    def _caps(self, groups: list) -> tuple:
        """No regrouped micro-batch holds more vision units or token slots than the step's heaviest
        plain one (what the memory plan and the ``none`` run already meet)."""
        f = self.features(groups)
        return float(f[:, 0].max()), float(f[:, 1].max())


# ---- regrouping ahead, in a worker process --------------------------------------------------------
_WORKER: Optional[StepBalancer] = None


def _worker_start(units: SampleUnits, prices: StagePrices, args: tuple) -> None:
    global _WORKER
    ranks, max_swaps, variable, evenness, micro_batch_sync = args
    _WORKER = StepBalancer(units, prices, ranks, max_swaps, variable, evenness, micro_batch_sync)


def _worker_regroup(groups: list, prices: StagePrices) -> tuple:
    _WORKER.set_prices(prices)
    return _WORKER.regroup(groups), dict(_WORKER.last)


class _Ahead:
    """One worker process holding the samples' units; ``submit`` a step's groups with the prices in force
    then, ``take`` its regrouping (None where it was asked with other prices, or never)."""

    def __init__(self, balancer: StepBalancer):
        from concurrent.futures import ProcessPoolExecutor

        self.pool = ProcessPoolExecutor(1, mp_context=pool_context("mmpipe.data.balance"), initializer=_worker_start,
                                        initargs=(balancer.units, balancer.prices, balancer._args))
        self.pending: dict = {}  # step -> (prices, future)

    def submit(self, step: int, groups: list, prices: StagePrices) -> None:
        if step not in self.pending:
            self.pending[step] = (prices, self.pool.submit(_worker_regroup, groups, prices))

    def take(self, step: int, prices: StagePrices):
        item = self.pending.pop(step, None)
        for k in [k for k in self.pending if k < step]:
            self.pending.pop(k)[1].cancel()
        if item is None or item[0] is not prices:
            return None
        return item[1].result()

    def drop_from(self, step: int) -> None:
        for k in [k for k in self.pending if k >= step]:
            self.pending.pop(k)[1].cancel()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
