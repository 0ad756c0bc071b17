"""``mmpipe export --run DIR [--step N] --out DIR [--dtype fp32|bf16]``: a run's checkpoint (any
layout, no DeepSpeed engine) as a transformers directory: safetensors weights, config, the run's
tokenizer and an image processor whose preprocessing is the run's (square resize + centre crop to
the tower's size, the tower's mean/std).

- CLIP ViT + CLIP text -> ``CLIPModel`` + ``CLIPProcessor``
- VLM -> ``LlavaForConditionalGeneration`` + ``LlavaProcessor`` (the run's chat template)
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from mmpipe.errors import ConfigError


def run_tokenizer(cfg, family_cls, run_dir: str):
    """The tokenizer a run trained with: ``data.tokenizer``, the pretrained weights' own, or the one
    mmpipe trained into the run directory; with the family's special tokens."""
    from mmpipe.data.tokenizer import has_tokenizer, load_tokenizer
    key, weights = family_cls.tokenizer_weights(cfg.model)
    if cfg.data.tokenizer:
        tok = load_tokenizer(cfg.data.tokenizer)
    elif cfg.data.cache:
        tok = load_tokenizer(os.path.join(cfg.data.cache, "tokenizer"), "data.cache tokenizer")
    elif weights and has_tokenizer(weights):
        tok = load_tokenizer(weights, f"{key} tokenizer")
    else:
        tok = load_tokenizer(os.path.join(run_dir, "tokenizer"), "tokenizer in the run directory")
    return family_cls.prepare_tokenizer(tok)


def image_processor(size: int, mean, std):
    from transformers import CLIPImageProcessor
    return CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size},
                              image_mean=list(mean), image_std=list(std), do_convert_rgb=True)


def export(run_dir: str, out: str, step: Optional[int] = None, dtype: str = "fp32") -> str:
    import mmpipe
    from mmpipe.config import family_of
    from mmpipe.families import build_family
    cfg_path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"--run {run_dir}: no config.yaml (not an mmpipe run directory)")
    if dtype not in ("fp32", "bf16"):
        raise ConfigError(f"--dtype {dtype}: give fp32 or bf16")
    cfg = mmpipe.load_config(cfg_path)
    state = mmpipe.load_weights(run_dir, step)  # one line when there is no checkpoint
    family = build_family(cfg.model, cfg.train.seed)
    tok = run_tokenizer(cfg, family_of(cfg), run_dir)
    model, processor = family.hf_export(state, tok)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    return out
