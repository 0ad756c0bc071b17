"""Image towers, as named parts: ``embed`` -> ``blocks.0..N-1`` -> ``head`` (pooled features).

``clip_vit``: transformers' CLIP vision transformer sub-modules (names match ``CLIPVisionModel``).
``resnet``: torchvision ResNet stages. The embed part accepts uint8 images and normalises them on
the device (so the loader ships uint8), or already-normalised floats (transformers convention).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from mmpipe.errors import ConfigError, one_line
from mmpipe.families.towers import hf
from mmpipe.families.towers.common import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    init_transformer_part,
    normalize_pixels,
    param_dtype,
)

_HF_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "image_size",
              "patch_size")


class ClipVisionEmbed(nn.Module):
    def __init__(self, hf_cfg, mean, std):
        super().__init__()
        from transformers.models.clip.modeling_clip import CLIPVisionEmbeddings
        self.embeddings = CLIPVisionEmbeddings(hf_cfg)
        self.pre_layrnorm = nn.LayerNorm(hf_cfg.hidden_size, eps=hf_cfg.layer_norm_eps)
        self.mean, self.std = tuple(mean), tuple(std)

    def forward(self, pixel_values):
        x = normalize_pixels(pixel_values, self.mean, self.std, param_dtype(self))
        return self.pre_layrnorm(self.embeddings(x))


def _clip_block_cls():
    from transformers.models.clip.modeling_clip import CLIPEncoderLayer

    class ClipVisionBlock(CLIPEncoderLayer):
        def forward(self, hidden_states):  # noqa: D401 - bidirectional, no mask
            return super().forward(hidden_states, attention_mask=None)

    return ClipVisionBlock


class ClipVisionHead(nn.Module):
    def __init__(self, hf_cfg):
        super().__init__()
        self.post_layernorm = nn.LayerNorm(hf_cfg.hidden_size, eps=hf_cfg.layer_norm_eps)

    def forward(self, hidden_states):
        return self.post_layernorm(hidden_states[:, 0, :])


class ResNetEmbed(nn.Module):
    def __init__(self, net, mean, std):
        super().__init__()
        self.conv1, self.bn1, self.relu, self.maxpool = net.conv1, net.bn1, net.relu, net.maxpool
        self.mean, self.std = tuple(mean), tuple(std)

    def forward(self, pixel_values):
        x = normalize_pixels(pixel_values, self.mean, self.std, param_dtype(self))
        return self.maxpool(self.relu(self.bn1(self.conv1(x))))


class ResNetHead(nn.Module):
    def forward(self, x):
        return torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)


class VisionSpec:
    """Resolved image-tower definition: how many parts, how to build each, where weights come from."""

    def __init__(self, cfg, clip_pretrained: Optional[str] = None):
        self.cfg = cfg
        self.arch = cfg.arch
        self.weights_dir = cfg.pretrained or clip_pretrained
        set_fields = [f for f in _HF_FIELDS if getattr(cfg, f) is not None]
        if self.arch == "clip_vit":
            if self.weights_dir:
                key = "model.vision.pretrained" if cfg.pretrained else "model.pretrained"
                c = hf.load_hf_config(self.weights_dir, key)
                c = getattr(c, "vision_config", c)
                hf.check_fields_agree(cfg, set_fields, c, "model.vision", key)
            else:
                from transformers import CLIPVisionConfig
                try:
                    c = CLIPVisionConfig(**{f: getattr(cfg, f) for f in set_fields})
                except Exception as e:  # noqa: BLE001
                    raise ConfigError(f"model.vision: {one_line(e, last=True)}") from None
            c._attn_implementation = "sdpa"
            self.hf_config = c
            self.num_blocks = c.num_hidden_layers
            self.width = c.hidden_size
            self.image_size = c.image_size
            stats = hf.load_preprocessor_stats(self.weights_dir)
            self.mean, self.std = stats or (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)
            self.rules = hf.CLIP_VISION_RULES
        else:  # resnet
            bad = [f for f in set_fields if f != "image_size"]
            if bad:
                raise ConfigError(f"model.vision: {', '.join(bad)} do not apply to arch=resnet (use variant)")
            self.hf_config = None
            self.num_blocks = 4
            self.width = 2048 if cfg.variant == "resnet50" else 512
            self.image_size = cfg.image_size or 224
            stats = hf.load_preprocessor_stats(cfg.pretrained)
            self.mean, self.std = stats or (IMAGENET_MEAN, IMAGENET_STD)
            self.rules = hf.RESNET_RULES
        self._weights = None

    def part_names(self) -> list[str]:
        return ["embed"] + [f"blocks.{i}" for i in range(self.num_blocks)] + ["head"]

    def build_part(self, name: str) -> nn.Module:
        if self.arch == "clip_vit":
            if name == "embed":
                m = ClipVisionEmbed(self.hf_config, self.mean, self.std)
            elif name == "head":
                m = ClipVisionHead(self.hf_config)
            else:
                m = _clip_block_cls()(self.hf_config)
            init_transformer_part(m)
            return m
        import torchvision
        net = getattr(torchvision.models, self.cfg.variant)(weights=None)
        if name == "embed":
            return ResNetEmbed(net, self.mean, self.std)
        if name == "head":
            return ResNetHead()
        return getattr(net, f"layer{int(name.split('.')[1]) + 1}")

    def weight_source(self):
        if self.weights_dir and self._weights is None:
            self._weights = hf.WeightSource(self.weights_dir, "model.vision.pretrained" if self.cfg.pretrained
                                            else "model.pretrained")
        return self._weights



