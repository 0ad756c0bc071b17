"""Measured memory per rank at its peak (``log.memory: true``): what the memory model
(``mmpipe.planning.memory``) predicts, counted live in a real run.

Every rank runs its training steps under ``LiveBytes`` (``mmpipe.parallel.live_bytes``): each
tensor storage an operation makes is counted until it is freed. What existed before the steps is
registered first: the module's weights (``weights``), the innermost optimizer's state and the
tensors DeepSpeed's optimizer wrapper holds (flat fp32 masters, gradient accumulators:
``optimizer``). Everything the steps make - activations, gradients, transfer buffers,
temporaries, a step loss's feature cache - is ``dynamic``; Adam's state made lazily in the first
step is ``optimizer``. The peak is the largest total the rank held at once, with that breakdown.
On an accelerator the allocator's own peak (``max_memory_allocated``) is recorded beside it.

It slows every tensor operation (Python runs at each): a measuring tool, off by default.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch

from mmpipe.parallel.live_bytes import LiveBytes


def held_tensors(obj: Any, depth: int = 4, seen: set | None = None) -> list:
    """Tensors an optimizer wrapper holds in its attributes (DeepSpeed's flat fp32 partitions,
    gradient accumulators, bit16 groups), found by walking lists, dicts and DeepSpeed/torch objects."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return []
    seen.add(id(obj))
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif type(obj).__module__.split(".")[0] in ("deepspeed", "torch") and hasattr(obj, "__dict__") \
            and not isinstance(obj, torch.nn.Module):
        items = list(vars(obj).values())
    else:
        return []
    return [t for it in items for t in held_tensors(it, depth - 1, seen)]


class MemoryMeter:
    """Counts a rank's tensors during its training steps (see the module doc)."""

    def __init__(self, module: torch.nn.Module, optimizer: Any, inner: Any):
        self.counter = LiveBytes()
        for p in module.parameters():
            self.counter.add(p, "weights")
        for b in module.buffers():
            self.counter.add(b, "weights")
        for t in held_tensors(getattr(inner, "state", {})) + held_tensors(optimizer):
            self.counter.add(t, "optimizer")
        for p in module.parameters():
            if p.grad is not None:
                self.counter.add(p.grad, "dynamic")
        self.device = next((p.device for p in module.parameters()), torch.device("cpu"))
        if self.device.type != "cpu":
            from deepspeed.accelerator import get_accelerator
            get_accelerator().reset_peak_memory_stats()

    def __enter__(self):
        self.counter.__enter__()
        return self

    def __exit__(self, *exc):
        self.counter.__exit__(*exc)

    def peak(self) -> dict:
        """{category: bytes} at the peak and ``total``; ``allocator``: the accelerator's own peak."""
        out = {k: int(self.counter.at_peak.get(k, 0)) for k in ("weights", "optimizer", "dynamic")}
        out["total"] = int(self.counter.peak)
        if self.device.type != "cpu":
            from deepspeed.accelerator import get_accelerator
            out["allocator"] = int(get_accelerator().max_memory_allocated())
        return out


def write_memory(run_dir: str, rank: int, stage: int, peak: dict) -> str:
    """``OUTPUT/memory/rank{r}.json``: the rank's stage and its measured peak by category."""
    path = os.path.join(run_dir, "memory", f"rank{rank}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        json.dump({"rank": rank, "stage": stage, "peak": peak}, fh, indent=1)
    return path


def read_memory(run_dir: str) -> list:
    """Every rank's record from ``write_memory``, by rank."""
    d = os.path.join(run_dir, "memory")
    recs = []
    for f in sorted(os.listdir(d)):
        if f.endswith(".json"):
            with open(os.path.join(d, f)) as fh:
                recs.append(json.load(fh))
    return sorted(recs, key=lambda r: r["rank"])
