"""CLIP-style dual encoder (``model.type: clip``): the family's layers, loss and plain model.

The model is a sequence of named layers in two segments::

    vision: vision.embed, vision.blocks.0 .. vision.blocks.N-1, vision.head, visual_projection
    text:   text.embed,   text.blocks.0   .. text.blocks.M-1,   text.head,   text_projection, loss

Activation contract (floating-point tensors first, integer tensors last; every float tensor that
crosses a stage boundary is used downstream, so it gets a gradient back)::

    data            (pixel_values uint8|float, input_ids int64, attention_mask int64)
    vision          (image_hidden,                 input_ids, attention_mask)
    text            (image_features, text_hidden,  input_ids, attention_mask)
    features        (image_features, text_features)
    loss            scalar (step) | cat(image_features, text_features) (eval_step)
"""
from __future__ import annotations

import torch
from torch import nn

from mmpipe.families.clip.losses import ClipLoss, SigmoidLoss, l2_normalize  # noqa: F401 (the loss layer's modules)


# ---- layer steps on the activation tuple ---------------------------------------------------------
def vision_embed_step(part, acts):
    pixels, ids, mask = acts
    return part(pixels), ids, mask


def vision_step(part, acts):
    h, ids, mask = acts
    return part(h), ids, mask


def text_embed_step(part, acts):
    img, ids, mask = acts
    return img, part(ids), ids, mask


def text_block_step(part, acts):
    img, h, ids, mask = acts
    return img, part(h, mask), ids, mask


def text_head_step(part, acts):
    img, h, ids, mask = acts
    return img, part(h, ids, mask)


def text_projection_step(part, acts):
    img, t = acts
    return img, part(t)


def loss_step(part, acts):
    img, t = acts
    return part(img, t)


def features_step(part, acts):
    img, t = acts
    return torch.cat([img.float(), t.float()], dim=-1)  # eval: the features, split by the evaluator


class DualEncoder:
    """The plain single-process CLIP model's API (``ClipFamily.plain_api``, mixed into
    ``parallel.plain.PlainModel``): ``forward`` returns the scalar contrastive loss;
    ``encode_image`` / ``encode_text`` as in open_clip."""

    def encode_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        layers = [la for la in self._layers if la.segment == "vision"]
        img, _, _ = self.run_layers((pixel_values, None, None), layers)
        return img

    def encode_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        layers = [la for la in self._layers if la.segment == "text" and la.name != "loss"]
        _, txt = self.run_layers((None, input_ids, attention_mask), layers)
        return txt

    @property
    def logit_scale(self) -> nn.Parameter:
        return self.loss.logit_scale
