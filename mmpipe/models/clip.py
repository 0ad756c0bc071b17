"""CLIP-style dual encoder as a plain ``nn.Module`` (no parallelism in here).

The model is a sequence of named parts::

    vision.embed, vision.blocks.0 .. vision.blocks.N-1, vision.head, visual_projection,
    text.embed,   text.blocks.0   .. text.blocks.M-1,   text.head,   text_projection, loss

``ModelSpec.build_part(name)`` builds one part (seeded from (seed, name), then filled from a
local pretrained directory if configured). ``DualEncoder`` builds all of them; a pipeline stage
builds only its own (see ``mmpipe.pipeline``). Either way a part's initial weights are the same.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from mmpipe.config import ModelConfig, RunConfig
from mmpipe.errors import ConfigError
from mmpipe.models import hf
from mmpipe.models.common import part_seed
from mmpipe.models.text import TextSpec
from mmpipe.models.vision import VisionSpec


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    # same arithmetic as transformers' CLIPModel (x / sqrt(sum(x^2)))
    return x / torch.pow(torch.sum(torch.pow(x, 2), dim=-1, keepdim=True), 0.5)


class ClipLoss(nn.Module):
    """Symmetric InfoNCE over one micro-batch with a learnable temperature (``logit_scale``).

    Negatives are the other pairs of the same micro-batch; the reported loss of a step is the mean
    over its micro-batches. This keeps the loss identical in every layout (P, DP, accumulation).
    """

    def __init__(self, logit_scale_init: float):
        super().__init__()
        # shape (1,), not 0-dim: DeepSpeed's parameter broadcast cannot view a 0-dim tensor as bytes.
        # transformers' 0-dim ``logit_scale`` is reshaped on load (models/hf.py).
        self.logit_scale = nn.Parameter(torch.tensor([float(logit_scale_init)]))

    def logits_per_text(self, image_features, text_features):
        img = l2_normalize(image_features.float())
        txt = l2_normalize(text_features.float())
        scale = self.logit_scale.float().exp().clamp(max=100.0).squeeze()
        return torch.matmul(txt, img.t()) * scale

    def forward(self, image_features, text_features):
        logits = self.logits_per_text(image_features, text_features)
        target = torch.arange(logits.shape[0], device=logits.device)
        return (nn.functional.cross_entropy(logits, target) + nn.functional.cross_entropy(logits.t(), target)) / 2.0


class ModelSpec:
    """Resolved model definition shared by the plain model and the pipeline layers."""

    IMAGE, TEXT = "image", "text"

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        self.cfg = cfg
        self.seed = seed
        clip_dir = cfg.pretrained
        if clip_dir:
            top = hf.load_hf_config(clip_dir, "model.pretrained")
            if not hasattr(top, "vision_config"):
                from mmpipe.errors import ConfigError
                raise ConfigError(f"model.pretrained: {clip_dir} is not a CLIPModel directory "
                                  "(use model.vision.pretrained / model.text.pretrained for single towers)")
            self.projection_dim = top.projection_dim
            self.logit_scale_init = top.logit_scale_init_value
        else:
            self.projection_dim = cfg.projection_dim
            self.logit_scale_init = cfg.logit_scale_init
        self.vision = VisionSpec(cfg.vision, clip_dir)
        self.text = TextSpec(cfg.text, clip_dir, eos_token_id=getattr(cfg.text, "eos_token_id", None))
        self._top_weights = hf.WeightSource(clip_dir, "model.pretrained") if clip_dir else None

    # ---- structure -------------------------------------------------------------------------
    def part_names(self) -> list[str]:
        return ([f"vision.{n}" for n in self.vision.part_names()] + ["visual_projection"]
                + [f"text.{n}" for n in self.text.part_names()] + ["text_projection", "loss"])

    def branch(self, name: str) -> str:
        return self.IMAGE if name.startswith("vision.") or name == "visual_projection" else self.TEXT

    # ---- building --------------------------------------------------------------------------
    def _build_unseeded(self, name: str) -> nn.Module:
        if name.startswith("vision."):
            return self.vision.build_part(name[len("vision."):])
        if name.startswith("text."):
            return self.text.build_part(name[len("text."):])
        if name == "visual_projection":
            m = nn.Linear(self.vision.width, self.projection_dim, bias=False)
        elif name == "text_projection":
            m = nn.Linear(self.text.width, self.projection_dim, bias=False)
        elif name == "loss":
            return ClipLoss(self.logit_scale_init)
        else:
            raise KeyError(name)
        nn.init.normal_(m.weight, std=m.in_features ** -0.5)
        return m

    def build_part(self, name: str) -> nn.Module:
        with part_seed(self.seed, name):
            module = self._build_unseeded(name)
        source, rules = self._weights_for(name)
        if source is not None:
            hf.load_part_weights(module, name, source, rules)
        return module

    def _weights_for(self, name: str):
        if name.startswith("vision."):
            return self.vision.weight_source(), self.vision.rules
        if name.startswith("text."):
            return self.text.weight_source(), self.text.rules
        return self._top_weights, hf.CLIP_TOP_RULES


class Tower(nn.Module):
    def __init__(self, embed: nn.Module, blocks: list, head: nn.Module):
        super().__init__()
        self.embed = embed
        self.blocks = nn.ModuleList(blocks)
        self.head = head


class DualEncoder(nn.Module):
    """Plain single-process CLIP-style model: ``forward`` returns the scalar contrastive loss."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        parts = {n: spec.build_part(n) for n in spec.part_names()}
        self.vision = Tower(parts["vision.embed"], [parts[f"vision.blocks.{i}"] for i in range(spec.vision.num_blocks)],
                            parts["vision.head"])
        self.visual_projection = parts["visual_projection"]
        self.text = Tower(parts["text.embed"], [parts[f"text.blocks.{i}"] for i in range(spec.text.num_blocks)],
                          parts["text.head"])
        self.text_projection = parts["text_projection"]
        self.loss = parts["loss"]
        # parts that may run without autograd (frozen, with nothing trainable upstream in their
        # branch); set by the trainer after freezing, empty by default
        self.forward_only: frozenset = frozenset()

    def _run(self, name: str, module: nn.Module, *args):
        if name in self.forward_only and torch.is_grad_enabled():
            with torch.no_grad():
                return module(*args)
        return module(*args)

    def encode_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        h = self._run("vision.embed", self.vision.embed, pixel_values)
        for i, block in enumerate(self.vision.blocks):
            h = self._run(f"vision.blocks.{i}", block, h)
        h = self._run("vision.head", self.vision.head, h)
        return self._run("visual_projection", self.visual_projection, h)

    def encode_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self._run("text.embed", self.text.embed, input_ids)
        for i, block in enumerate(self.text.blocks):
            h = self._run(f"text.blocks.{i}", block, h, attention_mask)
        h = self._run("text.head", self.text.head, h, input_ids, attention_mask)
        return self._run("text_projection", self.text_projection, h)

    def forward(self, pixel_values, input_ids, attention_mask):
        return self.loss(self.encode_image(pixel_values), self.encode_text(input_ids, attention_mask))

    @property
    def logit_scale(self) -> nn.Parameter:
        return self.loss.logit_scale


def build_model(config, seed: int | None = None) -> DualEncoder:
    """Build the plain model from a ``RunConfig`` (or its ``ModelConfig``)."""
    model_cfg = getattr(config, "model", config)
    if seed is None:
        seed = config.train.seed if hasattr(config, "train") else 0
    return DualEncoder(ModelSpec(model_cfg, seed))


__all__ = ["ClipLoss", "DualEncoder", "ModelSpec", "build_model", "l2_normalize"]


def vision_image_size(cfg) -> int:
    """The image tower's input size (from a pretrained config if there is one), without building
    the text spec (which needs the tokenizer)."""
    return VisionSpec(cfg.vision, cfg.pretrained).image_size


# ---- text-tower fields a run config may leave to its tokenizer -------------------------------------
def pretrained_text_dir(cfg: RunConfig) -> tuple[Optional[str], Optional[str]]:
    """(config key, directory) the text tower's weights come from, or (None, None)."""
    if cfg.model.text.pretrained:
        return "model.text.pretrained", cfg.model.text.pretrained
    if cfg.model.pretrained:
        return "model.pretrained", cfg.model.pretrained
    return None, None


def fill_text_fields(cfg: RunConfig, num_tokens: int, eos: int) -> None:
    """Text-tower fields a config may leave to the tokenizer. With pretrained text weights the
    tokenizer must fit their vocabulary, and pooling reads the EOS of the tokenizer actually used."""
    t = cfg.model.text
    key, weights_dir = pretrained_text_dir(cfg)
    if weights_dir:
        from mmpipe.models import hf
        c = hf.load_hf_config(weights_dir, key)
        c = getattr(c, "text_config", c)
        if num_tokens > c.vocab_size:
            raise ConfigError(f"the tokenizer has {num_tokens} tokens but the text weights in {key}={weights_dir} "
                              f"embed {c.vocab_size}: it is not their tokenizer; set data.tokenizer to the one they "
                              "were trained with")
    else:
        if t.vocab_size is None:
            t.vocab_size = num_tokens
        elif t.vocab_size < num_tokens:
            raise ConfigError(f"model.text.vocab_size={t.vocab_size} is smaller than the tokenizer's {num_tokens} tokens")
        if t.max_position_embeddings is None:
            t.max_position_embeddings = max(cfg.data.max_length, 16)
    if t.eos_token_id is None:
        t.eos_token_id = eos
