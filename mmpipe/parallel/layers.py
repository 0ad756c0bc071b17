"""A family's layers as DeepSpeed pipeline layers, with one activation contract: a tuple of
tensors (floating-point first, integer last; see the family's model module for its tuples).

Each ``PipeLayer`` holds exactly one layer of the plain model (``Family.layers()``), so its state
dict is that layer's under ``part.`` and checkpoints map back to the plain model's names without a
table of special cases.
"""
from __future__ import annotations

import torch
from torch import nn


class PipeLayer(nn.Module):
    """One part of the plain model, adapted to the tuple contract. Built per stage via LayerSpec."""

    def __init__(self, family, name: str, forward_only: bool = False):
        super().__init__()
        self.name = name
        self.part = family.build_layer(name)
        layer = family.layer(name)
        self._role = layer.step
        self._eval_role = layer.eval_step or layer.step  # eval_batch puts the module in eval mode
        # frozen, and nothing upstream in its branch trains: run without autograd
        self.forward_only = forward_only
        self.features = False  # a step loss: the last layer hands out its features in training too
        self.replay = None  # a step loss with dropout: ``parallel.step_loss.Replay`` reseeds each forward
        self.surrogate = None  # a step loss's last layer: features -> the loss to backpropagate (with autograd)
        self.memo = None  # a step loss's frozen prefix: ``parallel.step_loss.FirstPassMemo``
        self.checkpointing = False  # parallel.activation_checkpointing: recompute the forward in backward

    def forward(self, acts):
        memo = self.memo if self.training else None
        if memo is not None and not memo.recording:  # the training pass: the prefix ran in the first pass
            return self._as_forward_only(memo.take(), acts) if self.name == memo.last else acts
        run = self._checkpointed if self.checkpointing and not self.forward_only else self._forward
        if self.replay is not None and self.training:
            with self.replay.rng(self.name):
                out = run(acts)
        else:
            out = run(acts)
        # inside the module's forward, as the loss layer's own loss is: DeepSpeed's bf16 pipeline
        # drops the gradient of a parameter used only in ``loss_fn`` (logit_scale)
        if self.surrogate is not None and torch.is_grad_enabled():
            return self.surrogate(out)
        if memo is not None and self.name == memo.last:
            memo.record(out)
        return out

    def _checkpointed(self, acts):
        if not (self.training and torch.is_grad_enabled()):
            return self._forward(acts)
        return checkpoint(self._forward, acts)

    def _forward(self, acts):
        if not (self.forward_only and torch.is_grad_enabled()):
            return self._step(acts)
        with torch.no_grad():
            out = self._step(acts)
        return self._as_forward_only(out, acts)

    @staticmethod
    def _as_forward_only(out, acts):
        """A forward-only layer's outputs (computed without autograd), as the pipeline needs them."""
        # DeepSpeed runs backward on every float tensor a stage sends, and sends a gradient back
        # for every float tensor a stage received. Outputs are tied to the float inputs that
        # want a gradient by a zero-weight scalar: backward through it is a sum and a zero fill,
        # not the layer's backward, and a stage that starts inside a frozen tower still hands its
        # (zero) input gradient back. Without such inputs, outputs become leaves that accept (and
        # drop) their gradient, so an all-frozen first stage still runs.
        anchors = [t for t in acts if wants_grad(t)]
        tie = sum(a.reshape(-1)[:1].sum() for a in anchors) * 0.0 if anchors else None
        single = torch.is_tensor(out)  # a last layer may return one tensor, not a tuple
        res = []
        for t in ((out,) if single else out):
            if torch.is_tensor(t) and t.is_floating_point() and not t.requires_grad:
                if tie is not None:
                    t = t + tie.to(t.dtype)
                else:
                    t.requires_grad_(True)
                    t._mmpipe_sink = True  # a gradient sink, not a path back to a stage input
            res.append(t)
        return res[0] if single else tuple(res)

    def _step(self, acts):
        return (self._eval_role if self.features or not self.training else self._role)(self.part, acts)

    def extra_repr(self) -> str:
        return self.name


def checkpoint(fn, *args):
    """``fn(*args)`` keeping only its inputs for backward, where it runs again (torch's non-reentrant
    activation checkpoint; the random-number state is restored for the recompute, so dropout draws
    the same masks)."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint
    return torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)


def set_activation_checkpointing(module: nn.Module, on: bool = True) -> int:
    """Turn activation checkpointing on for every layer of a pipeline module or plain model that
    trains (forward-only layers never); returns how many layers it applies to."""
    layers = [m for m in module.modules() if isinstance(m, PipeLayer)]
    if layers:
        for layer in layers:
            layer.checkpointing = on
        return sum(not la.forward_only for la in layers)
    module.checkpointing = on  # a plain model (families.base.PlainModel)
    return len([n for n in module.family.layer_names() if n not in module.forward_only])


def wants_grad(t) -> bool:
    """A float tensor whose gradient someone needs: not a forward-only layer's gradient sink."""
    return (torch.is_tensor(t) and t.is_floating_point() and t.requires_grad
            and not getattr(t, "_mmpipe_sink", False))


def plain_state_key(layer_name: str, key: str) -> str:
    """PipeLayer state-dict key -> the plain model's state-dict key (part name is the prefix)."""
    if not key.startswith("part."):
        raise KeyError(f"unexpected pipeline layer key {key!r} in {layer_name}")
    return f"{layer_name}.{key[len('part.'):]}"


def run_sequential(layers, acts):
    """Apply pipeline layers in one process (used by tests and the profiler)."""
    for layer in layers:
        acts = layer(acts)
    return acts
