"""What a unit of work costs on each layer, from the measured layer profile: ``data.balance: cost``
prices each micro-batch of a step with it (``mmpipe.data.balance``).

A layer whose segment the family's ``cost_driver`` calls ``vision`` computes on the micro-batch's vision units (image
tokens, or images of a dual encoder's fixed size), every other layer on its token slots (rows x padded
length) and, where it has attention scores, on its squares (rows x padded length²: QK^T and AV grow with a
row's length squared; a linear-attention, recurrent or MLP layer has none). Its price is its forward +
backward (+ recomputed forward) time at the profiled example shapes over the units those shapes hold (a
family profiled at several image sizes: their weighted means); a text layer's time is split between its
slots and its squares as its analytic forward FLOPs split at those shapes (``Family.matmuls``: the part that
grows fourfold when the rows double in length; a family without analytic FLOPs: all slots)."""
from __future__ import annotations

import torch

from mmpipe.data.balance import StagePrices
from mmpipe.planning.place import layer_costs, recomputed_ms


def layer_prices(prof: dict, family, cfg, micro_batch_size: int) -> dict:
    """``{"drivers": [vision|tokens per layer], "seconds": [per unit per layer], "squares": [per row x length²
    per layer], "max_length", "pad_multiple", "fixed_length"}``: kept in the run's plan (a resume regroups its
    steps the same way)."""
    costs = layer_costs(prof)
    again = recomputed_ms(prof, costs)
    shapes = [(w, b) for w, b in family.example_batches(micro_batch_size, cfg.data.max_length, torch.device("cpu"),
                                                        packed=cfg.data.packing, data_cfg=cfg.data) if w > 0]
    total = sum(w for w, _ in shapes) or 1.0
    units = [sum(w * family.batch_units(b)[k] for w, b in shapes) / total for k in (0, 1)]
    mbs = [(w, family.micro_batch(b)) for w, b in shapes]
    squares_unit = sum(w * mb.rows * mb.seq_len ** 2 for w, mb in mbs) / total
    drivers, seconds, squares = [], [], []
    for name, c, r, seg in zip(family.layer_names(), costs, again, family.segments()):
        drivers.append(family.cost_driver(seg))
        d = 0 if drivers[-1] == "vision" else 1
        t = (c.fwd_ms + c.bwd_ms + r) / 1e3
        share = square_share(family, name, mbs) if d == 1 else 0.0
        seconds.append(t * (1 - share) / units[d] if units[d] > 0 else 0.0)
        squares.append(t * share / squares_unit if squares_unit > 0 else 0.0)
    return {"drivers": drivers, "seconds": seconds, "squares": squares, "max_length": int(cfg.data.max_length),
            "pad_multiple": int(cfg.data.pad_multiple), "fixed_length": cfg.data.padding == "max_length"}


def stage_prices(plan):
    """The per-stage ``StagePrices`` of ``plan.prices`` under the plan's cut (None without prices)."""
    if not plan.prices:
        return None
    p = plan.prices
    vision, tokens, squares = [], [], []
    for s in range(plan.num_stages):
        span = range(plan.parts[s], plan.parts[s + 1])
        vision.append(sum(p["seconds"][i] for i in span if p["drivers"][i] == "vision"))
        tokens.append(sum(p["seconds"][i] for i in span if p["drivers"][i] == "tokens"))
        squares.append(sum(p.get("squares", [0.0] * len(p["seconds"]))[i] for i in span if p["drivers"][i] == "tokens"))
    return StagePrices(vision, tokens, p["max_length"], p["pad_multiple"], p["fixed_length"], order=plan.order,
                       squares=squares)


def _forward_flops(family, name: str, mb) -> float:
    return sum(2.0 * p.m * p.k * p.n for p in family.matmuls(name, mb) if p.forward)


def square_share(family, name: str, mbs: list) -> float:
    """The share of layer ``name``'s forward FLOPs that grows with its rows' length squared, over the example
    micro-batches ``mbs`` ([(weight, MicroBatch)]): F(2L) - 2 F(L) = 2 x the quadratic part (the linear parts
    cancel; a product that pads to a chunk may make it negative: none). 0 without analytic FLOPs."""
    quad = full = 0.0
    try:
        for w, mb in mbs:
            f = _forward_flops(family, name, mb)
            quad += w * max(0.0, (_forward_flops(family, name, mb._replace(seq_len=2 * mb.seq_len)) - 2 * f) / 2)
            full += w * f
    except NotImplementedError:
        return 0.0
    return min(1.0, quad / full) if full > 0 else 0.0


def refit_stage(vision_price: float, token_price: float, features, busy, weight: float = 1.0) -> dict:
    """One stage's prices refit from measured micro-batches: ``busy`` [n] seconds (forward + backward, the
    stage clock's) of micro-batches holding ``features`` [n, 2] (vision units, token slots), fitted as
    ``base + a x vision_price x units + b x token_price x slots`` by least squares with the profile's
    prices as the prior (``a = b = 1``, counted as ``weight`` typical micro-batches; ``base = 0``,
    weakly). A price the data cannot tell apart from the base (every micro-batch the same units) stays
    near the prior. A fit whose mean absolute error on these micro-batches is above the prior's is not
    taken: a few micro-batches slowed by something else pull least squares off the typical one, and
    the prior's prices then predict the run better. Returns the multipliers ``vision``/``tokens``, the ``base`` seconds and the mean
    absolute error of the prices before and after, relative to the mean measured micro-batch."""
    import numpy as np
    F, y = np.asarray(features, dtype=np.float64).reshape(-1, 2), np.asarray(busy, dtype=np.float64).reshape(-1)
    scale = max(float(np.abs(y).mean()), 1e-12)  # residuals in units of the mean micro-batch
    X = np.column_stack([np.ones(len(y)), F[:, 0] * vision_price / scale, F[:, 1] * token_price / scale])
    yn = y / scale
    prior = np.array([0.0, 1.0, 1.0])
    pull = np.diag([1e-2] + [weight * float(np.mean(X[:, k] ** 2)) for k in (1, 2)])
    free = [k for k in range(3) if k == 0 or X[:, k].any()]  # a price no micro-batch uses stays as it was
    theta = prior.copy()
    for keep in (free, [k for k in free if k]):  # without a base when the fit wants a negative one
        A = X[:, keep].T @ X[:, keep] + pull[np.ix_(keep, keep)]
        theta = prior.copy()
        theta[keep] = np.linalg.solve(A, X[:, keep].T @ yn + pull[np.ix_(keep, keep)] @ prior[keep])
        if theta[0] >= 0:
            break
        theta[0] = 0.0
    theta[1:] = np.clip(theta[1:], 0.05, 20.0)
    before, after = float(np.abs(X @ prior - yn).mean()), float(np.abs(X @ theta - yn).mean())
    if after > before:  # least squares chased a few slow micro-batches (a pause): the prior predicts better
        theta, after = prior, before
    return {"vision": float(theta[1]), "tokens": float(theta[2]), "base": float(theta[0] * scale),
            "error_before": before, "error_after": after}
