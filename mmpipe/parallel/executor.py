"""The one place that decides how a family's layer runs, for the single-process model and for the
pipeline layers alike.

A ``LayerExecutor`` holds a model's run policy and applies it to one ``families.base.Layer`` at a
time (duck-typed: ``name``, ``step``, ``eval_step``):

- **forward-only**: a frozen layer with nothing trainable upstream runs without autograd. In a
  pipeline stage (``anchor``) its float outputs stay tied to the float inputs that want a gradient
  (DeepSpeed sends back a gradient for every float tensor a stage received);
- **activation checkpointing**: a trained layer keeps only its inputs and recomputes in backward;
- **dropout replay** (``replay``): each layer's random numbers come from (seed, step, layer,
  micro-batch), so a step loss's two passes and every layout draw the same masks; with ``keyed``
  (a stochastic model's runs) the micro-batch's inputs end in its sample keys (``sample_rng``), which
  every layer passes on, and each sample's dropout is drawn from its own key (regrouping and packing
  keep its masks);
- **the features pass** (``features``): the step loss's layers hand out their ``eval_step`` outputs;
- **the frozen-prefix memo** (``memo``): the training pass of a step loss takes the prefix's outputs
  recorded by the forward-only pass instead of recomputing them;
- **the surrogate** (``surrogate``): the last layer of a pipelined step loss returns the loss to
  backpropagate (inside the module's forward: DeepSpeed's bf16 pipeline drops the gradient of a
  parameter used only in ``loss_fn``).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from mmpipe.parallel.sample_rng import KEY_FIELDS, Layout
from mmpipe.parallel.step_loss import Replay, is_stochastic


class LayerExecutor:
    """A model's run policy (see the module docstring); ``last``: the model's last layer name."""

    def __init__(self, forward_only: frozenset = frozenset(), last: str = "", anchor: bool = False):
        self.forward_only = frozenset(forward_only)
        self.last = last
        self.anchor = anchor
        self.checkpointing = False
        self.features = False
        self.replay = None
        self.memo = None
        self.surrogate = None
        self.keyed = False  # acts end in the sample keys (``sample_rng.KEY_FIELDS``)
        self.axis_of: dict = {}  # layer -> "vision" | "tokens": which keys its dropout reads
        self.detach = ""  # a layer whose float inputs are constants (``frozen_first``: no gradient goes back)

    def run(self, layer, module, acts, training: bool, evaluating: bool = False):
        """``layer`` (its ``module``) on the activation tuple ``acts``."""
        if layer.name == self.detach:
            acts = tuple(t.detach() if torch.is_tensor(t) and t.is_floating_point() else t for t in acts)
        memo = self.memo if training and self.features and self.memo is not None else None
        if memo is not None and not memo.recording and layer.name in memo.names:
            # the training pass: the prefix ran in the first pass; its last layer hands out the record
            return self._as_forward_only(memo.take(), acts) if layer.name == memo.last else acts
        step = layer.eval_step if (evaluating or self.features) and layer.eval_step is not None else layer.step
        keys = ()
        if self.keyed:  # the sample keys ride at the end of the tuple: every layer passes them on
            acts, keys = acts[:-len(KEY_FIELDS)], acts[-len(KEY_FIELDS):]
            if training and self.replay is not None:
                step = self.replay.keyed(step, layer.name, Layout(*keys), self.axis_of.get(layer.name, "tokens"))
        with self.replay.rng(layer.name) if self.replay is not None and training else nullcontext():
            out = self._call(layer.name, step, module, acts, training)
        if keys and layer.name != self.last:
            out = tuple(out) + tuple(keys)
        if self.surrogate is not None and layer.name == self.last and torch.is_grad_enabled():
            return self.surrogate(out)
        if memo is not None and layer.name == memo.last:
            memo.record(out)
        return out

    def _call(self, name: str, step, module, acts, training: bool):
        if not torch.is_grad_enabled():
            return step(module, acts)
        if name in self.forward_only:
            with torch.no_grad():
                out = step(module, acts)
            return self._as_forward_only(out, acts)
        if self.checkpointing and training:
            return checkpoint(step, module, acts)
        return step(module, acts)

    def _as_forward_only(self, out, acts):
        """A forward-only layer's outputs (computed without autograd), as a pipeline stage needs them."""
        if not self.anchor:
            return out
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

    def trained(self, names) -> int:
        """How many of ``names`` train (activation checkpointing applies to them)."""
        return sum(n not in self.forward_only for n in names)


def checkpoint(fn, *args):
    """``fn(*args)`` keeping only its inputs for backward, where it runs again (torch's non-reentrant
    activation checkpoint; the random-number state is restored for the recompute, so dropout draws
    the same masks)."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint
    return torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)


def wants_grad(t) -> bool:
    """A float tensor whose gradient someone needs: not a forward-only layer's gradient sink."""
    return (torch.is_tensor(t) and t.is_floating_point() and t.requires_grad
            and not getattr(t, "_mmpipe_sink", False))


def keyed_dropout(module, executor, dp_rank: int, accumulation: int, everywhere: bool) -> bool:
    """Set up a model that draws dropout (a tower's, LoRA's; ``everywhere``: on any pipeline stage) to draw
    each sample's from its own key (``sample_rng``) and anything else from (seed, step, layer, the
    micro-batch's index in the step: rank ``dp_rank``'s first is ``dp_rank`` x ``accumulation``): the same
    numbers in every layout, grouping and packing. Returns whether the batches carry the sample keys."""
    mine = is_stochastic(module)
    if everywhere:  # a stage without dropout still passes the keys on: every stage decides alike
        flag = torch.tensor([float(mine)], device=_collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        mine = bool(flag.item())
    if not mine:
        return False
    family = module.family
    executor.replay = Replay(family.seed, offset=dp_rank * accumulation)
    executor.keyed = True
    executor.axis_of = {layer.name: family.cost_driver(layer.segment) for layer in family.layers()}
    return True


def _collective_device():
    from deepspeed.accelerator import get_accelerator
    return torch.device(get_accelerator().current_device_name())
