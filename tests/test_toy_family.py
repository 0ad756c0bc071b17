"""A third model family registered from this file alone: the proof that a family plugs in.

Two linear "towers" (pooled pixels -> hidden; mean token embedding added to it) and a linear head
regress each image's mean colour (a label computed in the loader's collate and handed to the last
stage, not through the stages) with an MSE loss. Runs import this module through
``MMPIPE_PLUGINS=test_toy_family``; the shared parity and resume tests (``family`` fixture in
conftest) then apply to it unchanged, and the tests below check what is specific to it."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest
import torch
from torch import nn

from mmpipe.config.fields import Section, option, thawed_copy
from mmpipe.config.registry import register_family
from mmpipe.data.loader import Collate
from mmpipe.families.base import Layer
from mmpipe.families.image_text import ImageTextFamily

FAMILY_CONFIG = """\
model:
  type: toy
  hidden: 16
  image_size: 32
data:
  max_length: 16
  num_workers: 0
  tokenizer_vocab_size: 300
parallel:
  micro_batch_size: 4
train:
  batch_size: 16
optim:
  lr: 0.01
  warmup_steps: 0
log:
  progress: false
"""


@dataclass
class ToyConfig(Section):
    type: str = option("toy", "toy family: two linear towers regressing the mean colour")
    hidden: int = option(16, "width of both towers")
    pool: int = option(4, "pixels are average-pooled to pool x pool before the image tower")
    image_size: int = option(32, "input resolution")
    vocab_size: Optional[int] = option(None, "unset = the tokenizer's size")


class ImageTower(nn.Module):
    def __init__(self, pool: int, hidden: int):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(pool)
        self.proj = nn.Linear(3 * pool * pool, hidden)

    def forward(self, pixels):
        return torch.tanh(self.proj(self.pool(pixels.float() / 255.0).flatten(1)))


class TextTower(nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)

    def forward(self, h, ids, mask):
        m = mask.unsqueeze(-1).to(h.dtype)
        return h + (self.embedding(ids) * m).sum(1) / m.sum(1).clamp(min=1)


def image_step(part, acts):
    pixels, ids, mask = acts
    return part(pixels), ids, mask


def text_step(part, acts):
    h, ids, mask = acts
    return (part(h, ids, mask),)


def head_step(part, acts):
    (h,) = acts
    return part(h)


class ToyCollate(Collate):
    """The image/text batch plus ``target``: each image's mean colour in [0, 1] (the label)."""

    def __call__(self, items):
        batch = super().__call__(items)
        batch["target"] = batch["pixel_values"].float().mean((2, 3)) / 255.0
        return batch


@register_family
class ToyFamily(ImageTextFamily):
    name = "toy"
    config_class = ToyConfig
    labels = ("target",)
    default_groups = {"image": [r"^image\."], "text": [r"^text\.", r"^head\."]}

    @classmethod
    def image_size(cls, model_cfg) -> int:
        return model_cfg.image_size

    @classmethod
    def resolve(cls, model_cfg, tokenizer, data_cfg):
        out = thawed_copy(model_cfg)
        if out.vocab_size is None:
            out.vocab_size = len(tokenizer)
        return out

    def layers(self):
        return [Layer("image.tower", "image", image_step), Layer("text.tower", "text", text_step, takes=("image",)),
                Layer("head", "text", head_step)]

    def build_unseeded(self, name):
        c = self.cfg
        if name == "image.tower":
            return ImageTower(c.pool, c.hidden)
        if name == "text.tower":
            return TextTower(c.vocab_size, c.hidden)
        return nn.Linear(c.hidden, 3)

    def loss(self, outputs, target):
        return nn.functional.mse_loss(outputs.float(), target.float())

    def evaluate(self, outputs, labels, samples):
        pred = torch.cat([o.float() for o in outputs])[:len(samples)]
        target = torch.cat([lab[0].float() for lab in labels])[:len(samples)]
        return {"n": len(samples), "mse": float(nn.functional.mse_loss(pred, target))}

    def collate(self, tokenizer, data_cfg):
        return ToyCollate(tokenizer, data_cfg.max_length, data_cfg.padding, data_cfg.pad_multiple)

    def example_batch(self, m, max_length, device, packed=False):
        g = torch.Generator().manual_seed(0)
        s = self.cfg.image_size
        ids = torch.randint(0, self.cfg.vocab_size, (m, max_length), generator=g)
        return {"pixel_values": torch.randint(0, 256, (m, 3, s, s), dtype=torch.uint8, generator=g).to(device),
                "input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device),
                "target": torch.rand(m, 3, generator=g).to(device)}


# ---- what is specific to the toy family (the shared parity/resume tests cover the rest) -----------
def test_the_toy_family_resolves_through_the_registry(tmp_path):
    import mmpipe
    cfg_file = tmp_path / "toy.yaml"
    cfg_file.write_text(FAMILY_CONFIG)
    cfg = mmpipe.load_config(str(cfg_file), ["model.vocab_size=40"])
    assert isinstance(cfg.model, ToyConfig) and list(cfg.optim.groups) == ["image", "text"]
    model = mmpipe.build_model(cfg)
    assert sorted(model.state_dict()) == ["head.bias", "head.weight", "image.tower.proj.bias",
                                          "image.tower.proj.weight", "text.tower.embedding.weight"]
    fam = model.family
    assert fam.segment_graph() == {"image": ["text"], "text": []}
    b = fam.example_batch(4, 8, "cpu")
    loss = model(b["pixel_values"], b["input_ids"], b["attention_mask"], b["target"])
    assert loss.ndim == 0 and loss > 0
    loss.backward()
    assert model.image.tower.proj.weight.grad.abs().sum() > 0  # the image tower trains through the merge


def test_toy_family_trains_at_p1_and_p2_with_parity(family_runs_of):
    """The toy family at P = 1 and P = 2 (its label reaches the last stage from the loader): same
    losses and weights; the loss falls; the eval is the family's own (val MSE)."""
    from mmpipe.train.checkpoint_weights import load_model_weights
    from mmpipe.train.metrics import read_metrics
    runs = family_runs_of("toy")
    sets = ["train.steps=12", "train.eval_every=6"]
    p1, _ = runs.get("toy_p1_12", 1, ["parallel.pipeline_stages=1"] + sets, "python")
    p2, _ = runs.get("toy_p2_12", 2, ["parallel.pipeline_stages=2"] + sets)
    a, b = read_metrics(os.path.join(p1, "metrics.jsonl")), read_metrics(os.path.join(p2, "metrics.jsonl"))
    la, lb = [r["loss"] for r in a], [r["loss"] for r in b]
    assert len(la) == len(lb) == 12
    np.testing.assert_allclose(lb, la, rtol=1e-4)
    assert np.mean(la[-3:]) < 0.5 * np.mean(la[:3])  # it learns the mean colour
    wa, wb = load_model_weights(os.path.join(p1, "checkpoints")), load_model_weights(os.path.join(p2, "checkpoints"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k].float(), wa[k].float(), rtol=1e-4, atol=1e-6)
    ea, eb = read_metrics(os.path.join(p1, "metrics.jsonl"), "eval"), read_metrics(os.path.join(p2, "metrics.jsonl"), "eval")
    assert [e["step"] for e in ea] == [6, 12] and ea[-1]["mse"] < ea[0]["mse"] + 1e-6
    assert [e["mse"] for e in eb] == pytest.approx([e["mse"] for e in ea], rel=1e-4)
    with open(os.path.join(p2, "plan.json")) as fh:
        plan = json.load(fh)
    assert plan["segments"] == ["image", "text", "text"] and plan["stages"] == [["image.tower"], ["text.tower", "head"]]



def test_forward_only_follows_every_path_from_a_trainable_layer(tmp_path):
    """A frozen layer runs without autograd only when no trainable layer reaches it, through its own
    segment or a merge (``takes``); a forward-only last layer that returns one tensor still runs."""
    import mmpipe
    from mmpipe.config.groups import frozen_layout, resolve_groups
    from mmpipe.parallel.layers import PipeLayer
    cfg_file = tmp_path / "toy.yaml"
    cfg_file.write_text(FAMILY_CONFIG)

    def forward_only(*sets):
        cfg = mmpipe.load_config(str(cfg_file), ["model.vocab_size=40", *sets])
        fam = mmpipe.build_model(cfg).family
        return frozen_layout(fam, resolve_groups(cfg.optim, ToyFamily))[2], fam

    fo, _ = forward_only("optim.groups.text.freeze=true")  # the image tower trains: text and head need autograd
    assert fo == frozenset()
    fo, fam = forward_only("optim.groups.image.freeze=true")
    assert fo == {"image.tower"}
    head = PipeLayer(fam, "head", forward_only=True)
    h = torch.randn(2, 16, requires_grad=True)
    out = head((h,))
    assert torch.is_tensor(out) and out.shape == (2, 3)
