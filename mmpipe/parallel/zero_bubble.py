"""The backward split into its two halves, for zero-bubble pipeline orders (``schedules``: ``zb_h1``).

``B`` (``BackwardInputPass``) computes what the stage before waits for - the gradient of the stage's inputs - and
every gradient that is cheap or not a weight matrix; ``W`` (``BackwardWeightPass``) computes the weight gradients of
the stage's trainable ``nn.Linear`` layers later (peft's LoRA ``lora_A`` / ``lora_B`` are ``nn.Linear`` too: nearly
all a transformer's FLOPs). During ``B`` each such layer, in place of its weight gradient, queues what it needs: its
input and its output gradient (``WeightGradStore``, per micro-batch); ``W`` then computes ``g^T x`` per layer and hands
it to autograd's own accumulation of the weight (``_FeedWeightGrad``), so every hook DeepSpeed or torch put on the
parameter runs as in one backward, and the gradient is bit for bit the one backward gives.

Which layers defer: ``install`` gives each ``nn.Linear`` of a stage whose weight trains the class ``SplitLinear`` (the
same module, parameters and state-dict names); it takes the split path only while the store is ``active`` (a
training step), grad is on, and not under autocast or on the meta device; otherwise it is ``nn.Linear``. The weight
enters ``B``'s graph detached (its accumulation node would run in ``B`` without a gradient and fire its hooks), and a
layer with nothing else needing a gradient takes a 0-size anchor that does (a frozen base layer's LoRA ``lora_A`` on
a first stage).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class WeightGradStore:
    """A stage's queued weight-gradient inputs: micro-batch -> [(weight, layer input, output gradient)]."""

    def __init__(self):
        self.active = False  # a training step of a split-backward order is running
        self.current: Optional[list] = None  # the list the running ``B`` fills
        self.pending: dict = {}

    @contextlib.contextmanager
    def step(self):
        """A training step: the layers split their backward; every ``W`` is done by its end."""
        self.active = True
        try:
            yield
        finally:
            self.active = False
        if self.pending:
            left = sorted(self.pending)
            self.pending.clear()
            raise RuntimeError(f"the step ended with the weight gradients of micro-batches {left} never computed "
                               "(a split-backward order without their BackwardWeightPass)")

    @contextlib.contextmanager
    def backward_input(self, micro_batch: int):
        self.current = self.pending.setdefault(micro_batch, [])
        try:
            yield
        finally:
            self.current = None

    def queued_bytes(self, micro_batch: Optional[int] = None) -> int:
        """Bytes the queue holds (one micro-batch's, or all): each tensor's storage once."""
        seen, total = set(), 0
        for m, entries in self.pending.items():
            if micro_batch is not None and m != micro_batch:
                continue
            for _, x, g in entries:
                for t in (x, g):
                    key = (t.untyped_storage().data_ptr(), t.device)
                    if key not in seen:
                        seen.add(key)
                        total += t.untyped_storage().nbytes()
        return total

    def weight_gradients(self, micro_batch: int) -> None:
        """``W`` of ``micro_batch``: each queued layer's weight gradient into its accumulation (and its hooks)."""
        entries = self.pending.pop(micro_batch, [])
        if not entries:
            return
        with torch.enable_grad():
            outs = [_FeedWeightGrad.apply(w, x, g) for w, x, g in entries]
            torch.autograd.backward(outs, [o.new_zeros(0) for o in outs])


_ANCHOR: dict = {}  # device -> a 0-size tensor that requires grad


def _anchor(device) -> torch.Tensor:
    if device not in _ANCHOR:
        _ANCHOR[device] = torch.empty(0, device=device, requires_grad=True)
    return _ANCHOR[device]


class _LinearInputGrad(torch.autograd.Function):
    """``F.linear`` whose backward gives the input's (and the bias's) gradient and queues the weight's."""

    @staticmethod
    def forward(ctx, x, weight, bias, owner, anchor):
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.owner = bias is not None, owner
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        module = ctx.owner[0]
        gx = g.matmul(weight) if ctx.needs_input_grad[0] else None
        gb = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        store = module._mmpipe_weight_grads
        if store.current is None:
            raise RuntimeError("a split-backward layer ran its backward outside a BackwardInputPass")
        store.current.append((module.weight, x.detach(), g.detach()))
        return gx, None, gb, None, None


class _FeedWeightGrad(torch.autograd.Function):
    """``f(weight) -> nothing`` whose backward is the weight's gradient ``g^T x`` (as aten computes a linear
    layer's), so autograd accumulates it into the weight as a backward does."""

    @staticmethod
    def forward(ctx, weight, x, g):
        ctx.x, ctx.g = x, g
        return weight.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        x, g = ctx.x, ctx.g
        ctx.x = ctx.g = None
        return g.reshape(-1, g.shape[-1]).t().mm(x.reshape(-1, x.shape[-1])), None, None


class SplitLinear(nn.Linear):
    """``nn.Linear`` whose weight gradient waits for ``W`` while its store is active (see the module doc)."""

    def forward(self, x):
        store = self.__dict__.get("_mmpipe_weight_grads")
        if (store is None or not store.active or not torch.is_grad_enabled() or not self.weight.requires_grad
                or self.weight.device.type == "meta" or torch.is_autocast_enabled(x.device.type)):
            return F.linear(x, self.weight, self.bias)
        needs = x.requires_grad or (self.bias is not None and self.bias.requires_grad)
        return _LinearInputGrad.apply(x, self.weight.detach(), self.bias, [self],
                                      None if needs else _anchor(x.device))


def install(module: nn.Module, store: WeightGradStore) -> int:
    """Give every ``nn.Linear`` of ``module`` whose weight trains the split backward (``SplitLinear``, bound to
    ``store``); returns how many."""
    n = 0
    for m in module.modules():
        if type(m) is nn.Linear and m.weight.requires_grad:
            m.__class__ = SplitLinear
            m._mmpipe_weight_grads = store
            n += 1
    return n
