"""The model flattened into pipeline layers with one activation contract: a tuple of tensors.

Contract (floating-point tensors first, integer tensors last; every float tensor that crosses a
stage boundary is used downstream, so it gets a gradient back):

    data            (pixel_values uint8|float, input_ids int64, attention_mask int64)
    image phase     (image_hidden,                 input_ids, attention_mask)
    text phase      (image_features, text_hidden,  input_ids, attention_mask)
    features        (image_features, text_features)
    loss            scalar (training) | cat(image_features, text_features) (eval)

Each ``PipeLayer`` holds exactly one part of the plain model (``ModelSpec.part_names()``), so
its state dict is that part's state dict under ``part.`` and checkpoints map back to the plain
model's names without a table of special cases.
"""
from __future__ import annotations

import torch
from torch import nn


def _vision_embed(part, acts):
    pixels, ids, mask = acts
    return part(pixels), ids, mask


def _vision(part, acts):
    h, ids, mask = acts
    return part(h), ids, mask


def _text_embed(part, acts):
    img, ids, mask = acts
    return img, part(ids), ids, mask


def _text_block(part, acts):
    img, h, ids, mask = acts
    return img, part(h, mask), ids, mask


def _text_head(part, acts):
    img, h, ids, mask = acts
    return img, part(h, ids, mask)


def _text_projection(part, acts):
    img, t = acts
    return img, part(t)


def _loss(part, acts):
    img, t = acts
    if part.training:
        return part(img, t)
    return torch.cat([img.float(), t.float()], dim=-1)  # eval: features out, split by the caller


def role_of(name: str):
    if name == "vision.embed":
        return _vision_embed
    if name.startswith("vision.") or name == "visual_projection":
        return _vision
    if name == "text.embed":
        return _text_embed
    if name.startswith("text.blocks."):
        return _text_block
    if name == "text.head":
        return _text_head
    if name == "text_projection":
        return _text_projection
    if name == "loss":
        return _loss
    raise KeyError(f"no pipeline role for part {name!r}")


class PipeLayer(nn.Module):
    """One part of the plain model, adapted to the tuple contract. Built per stage via LayerSpec."""

    def __init__(self, spec, name: str, forward_only: bool = False):
        super().__init__()
        self.name = name
        self.part = spec.build_part(name)
        self._role = role_of(name)
        # frozen, and nothing upstream in its branch trains: run without autograd
        self.forward_only = forward_only

    def forward(self, acts):
        if not (self.forward_only and torch.is_grad_enabled()):
            return self._role(self.part, acts)
        with torch.no_grad():
            out = self._role(self.part, acts)
        # DeepSpeed runs backward on every float tensor a stage sends, and sends a gradient back
        # for every float tensor a stage received. Outputs are tied to the float inputs that
        # want a gradient by a zero-weight scalar: backward through it is a sum and a zero fill,
        # not the layer's backward, and a stage that starts inside a frozen tower still hands its
        # (zero) input gradient back. Without such inputs, outputs become leaves that accept (and
        # drop) their gradient, so an all-frozen first stage still runs.
        anchors = [t for t in acts if wants_grad(t)]
        tie = sum(a.reshape(-1)[:1].sum() for a in anchors) * 0.0 if anchors else None
        res = []
        for t in out:
            if t.is_floating_point() and not t.requires_grad:
                if tie is not None:
                    t = t + tie.to(t.dtype)
                else:
                    t.requires_grad_(True)
                    t._mmpipe_sink = True  # a gradient sink, not a path back to a stage input
            res.append(t)
        return tuple(res)

    def extra_repr(self) -> str:
        return self.name


def wants_grad(t) -> bool:
    """A float tensor whose gradient someone needs: not a forward-only layer's gradient sink."""
    return (torch.is_tensor(t) and t.is_floating_point() and t.requires_grad
            and not getattr(t, "_mmpipe_sink", False))


def plain_state_key(layer_name: str, key: str) -> str:
    """PipeLayer state-dict key -> plain ``DualEncoder`` state-dict key (part name is the prefix)."""
    if not key.startswith("part."):
        raise KeyError(f"unexpected pipeline layer key {key!r} in {layer_name}")
    return f"{layer_name}.{key[len('part.'):]}"


def run_sequential(layers, acts):
    """Apply pipeline layers in one process (used by tests and the profiler)."""
    for layer in layers:
        acts = layer(acts)
    return acts
