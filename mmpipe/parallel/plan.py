"""The ``Plan`` contract between planning and the runtime: layers, segments, stage boundaries
(``parts``: P+1 layer indices, DeepSpeed's convention), placement, the pipeline schedule, micro-batches and
predictions,
with one JSON schema (the run's ``plan.json`` and ``mmpipe plan``'s are the same)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

from mmpipe.parallel.schedules import Order, default_order


@dataclass
class Plan:
    """Where every layer runs. ``parts``: P+1 layer indices (stage s holds layers
    ``parts[s]:parts[s+1]``); ``predicted``: simulated step per placement considered (measured
    costs only); ``chosen``/``why``: for ``auto``, which placement won and by how much."""
    layers: list
    segments: list
    parts: list
    placement: str
    micro_batches: int
    micro_batch_size: Optional[int] = None
    costs: str = "parameters"  # what the boundaries were computed from: profile, parameters, plan file, checkpoint
    chosen: Optional[str] = None
    why: Optional[str] = None
    predicted: Optional[dict] = field(default=None)
    prices: Optional[dict] = field(default=None)  # data.balance=cost: ``mmpipe.planning.prices.layer_prices``
    order: Order = field(default_factory=default_order)  # the pipeline order (``parallel.schedules``)
    schedules: Optional[dict] = field(default=None)  # the chosen cut's predicted step seconds per schedule weighed
    weighed: Optional[list] = field(default=None)  # every (cut, schedule) pair weighed: predicted step, fullest stage

    @property
    def schedule(self) -> str:
        return self.order.name

    @property
    def frozen_stages(self) -> int:
        return self.order.frozen

    @property
    def num_stages(self) -> int:
        return len(self.parts) - 1

    @property
    def stages(self) -> list:
        return stage_lists(self.layers, self.parts)

    def to_json(self) -> dict:
        doc = asdict(self)
        order = doc.pop("order")  # written as the schedule's name and its leading frozen stages
        return {"schema": SCHEMA, **doc, "schedule": order["name"], "frozen_stages": order["frozen"],
                "stages": self.stages}

    def write(self, path: str) -> None:
        with open(path, "w") as fh:
            json.dump(self.to_json(), fh, indent=2)

    @classmethod
    def from_json(cls, doc: dict) -> "Plan":
        """A plan.json of any schema."""
        known = {f for f in cls.__dataclass_fields__} - {"order"}
        return cls(**{k: v for k, v in doc.items() if k in known}, order=order_of_json(doc))


def order_of_json(doc: dict) -> Order:
    """The order a plan.json records (a schema-2 plan, or one that names none, ran 1F1B: the default order)."""
    return Order(doc["schedule"], int(doc.get("frozen_stages", 0))) if "schedule" in doc else default_order()


def stage_lists(names: Sequence[str], parts: Sequence[int]) -> list[list[str]]:
    return [list(names[parts[s]:parts[s + 1]]) for s in range(len(parts) - 1)]


def parts_from_lists(names: Sequence[str], lists: Sequence[Sequence[str]]) -> list[int]:
    """Inverse of ``stage_lists``: validates that the lists cover ``names`` in order."""
    flat = [n for stage in lists for n in stage]
    if flat != list(names):
        raise ValueError("stage lists must cover every layer exactly once, in model order")
    parts = [0]
    for stage in lists:
        if not stage:
            raise ValueError("every stage needs at least one layer")
        parts.append(parts[-1] + len(stage))
    return parts


SCHEMA = 4  # 4: ``weighed`` (every cut and schedule the planner predicted)
