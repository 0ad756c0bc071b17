"""Bytes of tensor memory alive, counted as it happens, and their peak: ``LiveBytes``.

A ``TorchDispatchMode`` sees every tensor an operation creates; each new storage is counted (once,
however many views share it) under the current category until Python frees it (a weak reference's
callback). Tensors made before the mode (weights, optimizer state) are registered with ``add``. Meta tensors
count their size too: a model built on the meta device is measured without being allocated.
This is what an accelerator's allocator statistics (``max_memory_allocated``) give, without an
accelerator: the CPU has no allocator counter. torch's ``MemTracker`` (``torch.distributed._tools``)
does the same with per-module statistics whose module hooks keep a pipeline stage's received
inputs alive until the step ends; this counter adds no hooks.
"""
from __future__ import annotations

import weakref
from collections import defaultdict
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Counts live tensor storages by category; ``peak`` and ``at_peak`` (the categories then).
    Inside an optimizer's ``step`` new storages count as ``optimizer`` (its lazily made state)."""

    def __init__(self, category: str = "dynamic"):
        super().__init__()
        self.category = category
        self.live: dict = {}  # storage key -> (bytes, category, weak reference)
        self.now: dict = defaultdict(int)
        self.total = self.peak = 0
        self.at_peak: dict = {}
        self._hooks = []

    def add(self, t, category: str | None = None) -> None:
        if not torch.is_tensor(t):
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live:
            return
        n, cat = st.nbytes(), category or self.category
        self.live[key] = (n, cat, weakref.ref(st, partial(self._free, key)))
        self.now[cat] += n
        self.total += n
        if self.total > self.peak:
            self.peak, self.at_peak = self.total, dict(self.now)

    def _free(self, key, _ref) -> None:
        n, cat, _ = self.live.pop(key, (0, None, None))
        if cat is not None:
            self.now[cat] -= n
            self.total -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self.add(t)
        return out

    def __enter__(self):
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        out = super().__enter__()
        self._outside = self.category  # restored on exit, even if a step raised between its hooks

        def pre(*_):
            self.category = "optimizer"

        def post(*_):
            self.category = self._outside
        self._hooks = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
        return out

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.category = getattr(self, "_outside", self.category)
        return super().__exit__(*exc)

    def reset_peak(self) -> None:
        self.peak, self.at_peak = self.total, dict(self.now)
