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
from mmpipe.families.products import CLIP_BLOCK, Matmul, block_products
from mmpipe.families.towers import hf
from mmpipe.families.towers.common import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    init_transformer_part,
    normalize_pixels,
    param_dtype,
    use_attention,
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


def vit_products(c, part: str, images: int) -> list:
    """The products of a CLIP ViT part (``embed``, ``blocks.i``, ``head``) on ``images`` images:
    the patch embedding (a convolution with stride = kernel: one product over the patches) and
    the blocks over patches + CLS; the head (a norm of CLS) has none."""
    patches = (c.image_size // c.patch_size) ** 2
    if part == "embed":
        return [Matmul(images * patches, c.num_channels * c.patch_size ** 2, c.hidden_size,
                       "embeddings.patch_embedding", 0)]
    if part == "head":
        return []
    seq = patches + 1
    return block_products(images * seq, images, seq, CLIP_BLOCK, c.hidden_size, c.intermediate_size,
                          c.num_attention_heads)


def conv_products(convs: list, size: int, images: int, depth: int = 2) -> tuple:
    """The products of ``(path, nn.Conv2d)`` applied in order to ``images`` square maps of side
    ``size`` (a convolution: output positions x (in channels x kernel) x out channels); returns
    (products, output side)."""
    out = []
    for path, conv in convs:
        (kh, kw), (s, _), (p, _), (d, _) = conv.kernel_size, conv.stride, conv.padding, conv.dilation
        size = (size + 2 * p - d * (kh - 1) - 1) // s + 1
        out.append(Matmul(images * size * size, conv.in_channels // conv.groups * kh * kw, conv.out_channels, path,
                          depth))
        depth = 2
    return out, size


def resnet_products(spec, part: str, images: int) -> list:
    """The convolutions of a torchvision ResNet part (built on the meta device): the stem; in a
    stage, each residual block's main path and its downsample (both from the block's input)."""
    if part == "head":
        return []
    with torch.device("meta"):
        module = spec.build_part(part)
    if part == "embed":
        return conv_products([("conv1", module.conv1)], spec.image_size, images, 0)[0]
    side = (spec.image_size - 1) // 2 + 1  # the stem: a stride-2 convolution, then a stride-2 max pool
    side = (side - 1) // 2 + 1
    for _ in range(1, int(part.split(".")[1])):  # stages 2-4 halve the side
        side = (side - 1) // 2 + 1
    out = []
    for i, block in enumerate(module):
        main = [(f"{i}.{n}", getattr(block, n)) for n in ("conv1", "conv2", "conv3") if hasattr(block, n)]
        prods, after = conv_products(main, side, images, 0 if i == 0 else 2)
        if block.downsample is not None:
            prods += conv_products([(f"{i}.downsample.0", block.downsample[0])], side, images, 0 if i == 0 else 2)[0]
        out, side = out + prods, after
    return out


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
            use_attention(c)
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

    def matmuls(self, part: str, images: int) -> list:
        """The products of ``part`` on ``images`` images (``Family.matmuls``)."""
        if self.arch == "clip_vit":
            return vit_products(self.hf_config, part, images)
        return resnet_products(self, part, images)

    def weight_source(self):
        if self.weights_dir and self._weights is None:
            self._weights = hf.WeightSource(self.weights_dir, "model.vision.pretrained" if self.cfg.pretrained
                                            else "model.pretrained")
        return self._weights



