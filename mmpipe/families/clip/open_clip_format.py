"""The CLIP family (CLIP ViT + CLIP text) in open_clip's format: its model config (for
``open_clip.add_model_config``) and its state dict, so that open_clip's ``CLIP`` computes the same
features from the same weights (``mmpipe bench peers --family clip`` trains both from one start).

open_clip's ``CLIP`` is OpenAI's layout: fused ``in_proj`` attention weights, projections as
(width, embed) matrices applied as ``x @ proj``, the text tower at the top level. Its text tower has
no padding mask: with a causal mask and EOS pooling the padding after the EOS changes nothing."""
from __future__ import annotations

import re

import torch

from mmpipe.errors import ConfigError
from mmpipe.families.towers import hf

_BLOCK = {"layer_norm1.": "ln_1.", "layer_norm2.": "ln_2.", "mlp.fc1.": "mlp.c_fc.", "mlp.fc2.": "mlp.c_proj.",
          "self_attn.out_proj.": "attn.out_proj."}
_TOP = {"vision_model.embeddings.class_embedding": "visual.class_embedding",
        "vision_model.embeddings.patch_embedding.weight": "visual.conv1.weight",
        "vision_model.embeddings.position_embedding.weight": "visual.positional_embedding",
        "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
        "text_model.embeddings.position_embedding.weight": "positional_embedding",
        "logit_scale": "logit_scale", "logit_bias": "logit_bias"}
_NORMS = {"vision_model.pre_layrnorm.": "visual.ln_pre.", "vision_model.post_layernorm.": "visual.ln_post.",
          "text_model.final_layer_norm.": "ln_final."}
_LAYER = re.compile(r"^(vision|text)_model\.encoder\.layers\.(\d+)\.(.*)$")


def open_clip_config(family) -> dict:
    """open_clip's model config of this family's architecture (CLIP ViT + CLIP text, QuickGELU)."""
    v, t = family.vision, family.text
    if v.arch != "clip_vit" or t.arch != "clip_text":
        raise ConfigError(f"open_clip's CLIP is a CLIP ViT + CLIP text model; this one is {v.arch} + {t.arch}")
    vc, tc = v.hf_config, t.hf_config
    acts = {vc.hidden_act, tc.hidden_act}
    if acts - {"quick_gelu", "gelu"} or len(acts) > 1:
        raise ConfigError(f"open_clip's CLIP has one activation, quick_gelu or gelu, for both towers: {sorted(acts)}")
    if t.pooling != "eos":
        raise ConfigError(f"open_clip pools the CLIP text tower at its EOS token; this one pools {t.pooling}")
    return {"embed_dim": family.projection_dim, "quick_gelu": vc.hidden_act == "quick_gelu",
            "vision_cfg": {"image_size": vc.image_size, "patch_size": vc.patch_size, "layers": vc.num_hidden_layers,
                           "width": vc.hidden_size, "head_width": vc.hidden_size // vc.num_attention_heads,
                           "mlp_ratio": vc.intermediate_size / vc.hidden_size},
            "text_cfg": {"context_length": tc.max_position_embeddings, "vocab_size": tc.vocab_size,
                         "width": tc.hidden_size, "heads": tc.num_attention_heads, "layers": tc.num_hidden_layers,
                         "mlp_ratio": tc.intermediate_size / tc.hidden_size, "pool_type": "eos",
                         "eos_id": int(t.eos_token_id)}}


def to_open_clip(hf_state: dict) -> dict:
    """transformers ``CLIPModel`` state dict -> open_clip ``CLIP`` state dict."""
    out, qkv = {}, {}
    for k, v in hf_state.items():
        if k.endswith("position_ids"):
            continue
        if k in _TOP:
            out[_TOP[k]] = v
        elif k in ("visual_projection.weight", "text_projection.weight"):
            out["visual.proj" if k.startswith("visual") else "text_projection"] = v.t().contiguous()
        elif any(k.startswith(p) for p in _NORMS):
            p = next(p for p in _NORMS if k.startswith(p))
            out[_NORMS[p] + k[len(p):]] = v
        elif m := _LAYER.match(k):
            tower, i, rest = m.groups()
            prefix = ("visual.transformer" if tower == "vision" else "transformer") + f".resblocks.{i}."
            proj = re.match(r"self_attn\.([qkv])_proj\.(weight|bias)$", rest)
            if proj:
                qkv.setdefault((prefix, proj.group(2)), {})[proj.group(1)] = v
                continue
            ours = next((o for o in _BLOCK if rest.startswith(o)), None)
            if ours is None:
                raise KeyError(f"no open_clip name for {k}")
            out[prefix + _BLOCK[ours] + rest[len(ours):]] = v
        else:
            raise KeyError(f"no open_clip name for {k}")
    for (prefix, kind), parts in qkv.items():
        out[f"{prefix}attn.in_proj_{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return out


def open_clip_state(family, state: dict) -> dict:
    """mmpipe's plain state dict of a CLIP ViT + CLIP text model, softmax or sigmoid loss (whose
    ``logit_bias`` CLIPModel lacks) -> open_clip's ``CLIP`` state dict (0-dim scale and bias)."""
    rules = hf.CLIP_VISION_RULES + hf.CLIP_TEXT_RULES + hf.CLIP_TOP_RULES + [("loss.logit_bias", "logit_bias")]
    theirs = {}
    for k, v in state.items():
        name = hf.translate(k, rules)
        if name is None:
            raise KeyError(f"no transformers name for {k}")
        theirs[name] = v.reshape(()) if name in ("logit_scale", "logit_bias") else v
    return to_open_clip(theirs)
