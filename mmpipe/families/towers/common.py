"""Small helpers shared by the towers: per-part seeding, init, masks, pixel normalisation, the attention
implementation."""
from __future__ import annotations

import contextlib
import zlib

import torch
from torch import nn

from mmpipe.config.fields import option
from mmpipe.errors import ConfigError
from mmpipe.families.towers import varlen

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# the attention implementation every tower and decoder built from a transformers config runs: torch's fused sdpa
# (flash / memory-efficient kernels on GPUs, its causal path for right-padded rows; mmpipe's keyed dropout routes
# an attention with dropout through the eager path itself). ``model.attention: varlen`` (the chat families) gives
# their decoders and native-resolution ViTs the span kernels of ``towers.varlen`` instead.
ATTENTION = "sdpa"
ATTENTION_CHOICES = ("sdpa", "varlen")


def attention_option():
    """The chat families' ``model.attention`` field."""
    return option("sdpa", "sdpa: torch's fused attention, a packed row's samples kept apart by a block-diagonal mask "
                  "(the reference); varlen: packed rows, and a native-resolution ViT's image / window spans, attended "
                  "by their span boundaries (cu_seqlens) - torch's varlen flash kernel on a CUDA GPU in bf16 (or "
                  "flash-attn's), one sdpa call per span elsewhere; no mask (ms-swift --attn_impl flash_attn)")


def use_attention(*configs, kind: str = ATTENTION, spans: bool = False) -> None:
    """Give transformers ``configs`` the run's attention implementation: ``sdpa``, or ``varlen``
    (``towers.varlen``; ``spans``: the configs of ViTs whose attention takes ``cu_seqlens``)."""
    if kind not in ATTENTION_CHOICES:
        raise ConfigError(f"model.attention={kind!r} is not one of {', '.join(ATTENTION_CHOICES)} (sdpa: packed rows "
                          "through a block-diagonal mask; varlen: by their span boundaries)")
    name = ATTENTION
    if kind == "varlen":
        for c in configs if not spans else ():  # (the Qwen ViTs' attention takes none whatever their config says)
            p = getattr(c, "attention_dropout", 0.0) or 0.0
            if p > 0:
                raise ConfigError(f"model.attention=varlen: the decoder's attention_dropout is {p} (model.pretrained's "
                                  "config.json); the varlen kernels take no attention dropout: set it to 0 there or use "
                                  "model.attention=sdpa")
        varlen.register()
        name = varlen.VARLEN_SPANS if spans else varlen.VARLEN
    for c in configs:
        c._attn_implementation = name


def transformers_facing(config):
    """A copy of a model's transformers ``config`` for transformers' own model classes (export, generation, the
    comparisons): sdpa wherever mmpipe's varlen functions were set (they are mmpipe's layers' choice; a
    flash-named one would send transformers' model looking for a flash-attention package)."""
    import copy
    out = copy.deepcopy(config)
    for c in (out, getattr(out, "vision_config", None), getattr(out, "text_config", None)):
        if c is not None and str(getattr(c, "_attn_implementation", "")).startswith("mmpipe_"):
            c._attn_implementation = ATTENTION
        if c is not None and str(getattr(c, "_experts_implementation", None) or "").startswith("mmpipe_"):
            c._experts_implementation = None  # (transformers' model picks its own default: grouped_mm)
    return out


@contextlib.contextmanager
def part_seed(seed: int, name: str):
    """Build a part under a seed derived from (seed, part name), leaving the global RNG untouched.

    This is what makes a part's initial weights identical whether the whole model is built in one
    process or each pipeline stage builds only its own parts.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))
        yield


def init_transformer_part(module: nn.Module, std: float = 0.02) -> None:
    """GPT/CLIP-style init for parts built from transformers sub-modules (their own ``post_init``
    does not run when a sub-module is built alone)."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        for pname, p in m.named_parameters(recurse=False):
            if pname == "class_embedding":
                nn.init.normal_(p, std=std)


def normalize_pixels(pixel_values: torch.Tensor, mean, std, dtype: torch.dtype) -> torch.Tensor:
    """uint8 (B,3,H,W) -> normalised ``dtype`` on the tensor's device; float input is taken as
    already normalised (the transformers convention) and only cast."""
    if pixel_values.dtype == torch.uint8:
        x = pixel_values.float().div_(255.0)
        m = torch.tensor(mean, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
        s = torch.tensor(std, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
        x = (x - m) / s
        return x.to(dtype)
    return pixel_values.to(dtype)


def padding_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B,T) 1/0 -> additive (B,1,1,T) mask for bidirectional attention."""
    m = attention_mask[:, None, None, :].to(torch.bool)
    out = torch.zeros(m.shape, dtype=dtype, device=attention_mask.device)
    return out.masked_fill_(~m, torch.finfo(dtype).min)


def causal_padding_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B,T) 1/0 -> additive (B,1,T,T) causal mask that also hides padding keys."""
    B, T = attention_mask.shape
    causal = torch.ones(T, T, dtype=torch.bool, device=attention_mask.device).tril_()
    allowed = causal[None, None] & attention_mask[:, None, None, :].to(torch.bool)
    out = torch.zeros((B, 1, T, T), dtype=dtype, device=attention_mask.device)
    return out.masked_fill_(~allowed, torch.finfo(dtype).min)


def param_dtype(module: nn.Module) -> torch.dtype:
    for p in module.parameters():
        return p.dtype
    return torch.float32
