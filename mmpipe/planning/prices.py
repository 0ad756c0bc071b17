"""What a unit of work costs on each layer, from the measured layer profile: ``data.balance: cost``
prices each micro-batch of a step with it (``mmpipe.data.balance``).

A layer whose segment the family's ``cost_driver`` calls ``vision`` computes on the micro-batch's vision units (image
tokens, or images of a dual encoder's fixed size), every other layer on its token slots (rows x padded
length). Its price is its forward + backward (+ recomputed forward) time at the profiled example shapes
over the units those shapes hold (a family profiled at several image sizes: their weighted means)."""
from __future__ import annotations

import torch

from mmpipe.planning.place import layer_costs, recomputed_ms


def layer_prices(prof: dict, family, cfg, micro_batch_size: int) -> dict:
    """``{"drivers": [vision|tokens per layer], "seconds": [per unit per layer], "max_length",
    "pad_multiple", "fixed_length"}``: kept in the run's plan (a resume regroups its steps the same way)."""
    costs = layer_costs(prof)
    again = recomputed_ms(prof, costs)
    shapes = [(w, b) for w, b in family.example_batches(micro_batch_size, cfg.data.max_length, torch.device("cpu"),
                                                        packed=cfg.data.packing, data_cfg=cfg.data) if w > 0]
    total = sum(w for w, _ in shapes) or 1.0
    units = [sum(w * family.batch_units(b)[k] for w, b in shapes) / total for k in (0, 1)]
    drivers, seconds = [], []
    for c, r, seg in zip(costs, again, family.segments()):
        drivers.append(family.cost_driver(seg))
        d = 0 if drivers[-1] == "vision" else 1
        seconds.append((c.fwd_ms + c.bwd_ms + r) / 1e3 / units[d] if units[d] > 0 else 0.0)
    return {"drivers": drivers, "seconds": seconds, "max_length": int(cfg.data.max_length),
            "pad_multiple": int(cfg.data.pad_multiple), "fixed_length": cfg.data.padding == "max_length"}


def stage_prices(plan):
    """The per-stage ``StagePrices`` of ``plan.prices`` under the plan's cut (None without prices)."""
    from mmpipe.data.balance import StagePrices
    if not plan.prices:
        return None
    p = plan.prices
    vision, tokens = [], []
    for s in range(plan.num_stages):
        span = range(plan.parts[s], plan.parts[s + 1])
        vision.append(sum(p["seconds"][i] for i in span if p["drivers"][i] == "vision"))
        tokens.append(sum(p["seconds"][i] for i in span if p["drivers"][i] == "tokens"))
    return StagePrices(vision, tokens, p["max_length"], p["pad_multiple"], p["fixed_length"])
