"""transformers formats of the CLIP family <-> its plain state dict (``from_hf`` / ``to_hf``):

- CLIP ViT + CLIP text -> ``CLIPModel`` (``CLIPConfig``)
- CLIP ViT + BERT pooled by its pooler -> ``VisionTextDualEncoderModel`` (a ``CLIPVisionModel``
  and a ``BertModel``; transformers pools the text through ``BertModel.pooler``)

Other tower combinations have no transformers class that computes the same features; ``format_of``
says why, and ``mmpipe export`` writes them in mmpipe's own format."""
from __future__ import annotations

from typing import Optional

import torch

from mmpipe.errors import ConfigError
from mmpipe.families.base import HFAdapter
from mmpipe.families.towers import hf

# transformers 5 names CLIPVisionModel's weights without its inner ``vision_model.`` (4.x: nested)
VTDE_RULES = [("vision.embed.", "vision_model."),
              ("vision.blocks.", "vision_model.encoder.layers."),
              ("vision.head.", "vision_model."),
              ("text.embed.", "text_model."), ("text.blocks.", "text_model.encoder.layer."),
              ("text.head.", "text_model.")]


def format_of(family) -> tuple[Optional[str], str]:
    """(transformers class name or None, why) for this family's towers."""
    v, t = family.vision, family.text
    if family.cfg.loss == "sigmoid":
        return None, ("CLIPModel and VisionTextDualEncoderModel have no logit_bias for the sigmoid loss; the "
                      "checkpoint keeps it (transformers' SiglipModel has SigLIP's own towers)")
    if v.arch == "clip_vit" and t.arch == "clip_text":
        return "CLIPModel", "CLIP ViT + CLIP text"
    if v.arch == "clip_vit" and t.arch == "bert":
        if t.pooling == "pooler":
            return "VisionTextDualEncoderModel", "CLIP ViT + BERT with its pooler"
        return None, (f"VisionTextDualEncoderModel pools BERT through its pooler (dense + tanh over [CLS]) but this "
                      f"model pools {t.pooling}; train with model.text.pooling=pooler for a transformers export")
    return None, (f"transformers has no dual encoder with a {v.arch} image tower (a {v.arch} + {t.arch} model); "
                  "CLIPModel and VisionTextDualEncoderModel need model.vision.arch=clip_vit")


class ClipHF(HFAdapter):
    def __init__(self, family):
        self.family = family
        self.kind, why = format_of(family)
        if self.kind is None:
            raise ConfigError(f"no transformers format: {why}")
        if self.kind == "CLIPModel":
            self.rules = hf.CLIP_VISION_RULES + hf.CLIP_TEXT_RULES + hf.CLIP_TOP_RULES
        else:
            self.rules = VTDE_RULES + hf.CLIP_TOP_RULES

    def _plain_keys(self) -> list:
        keys = []
        for name in self.family.layer_names():
            with torch.device("meta"):
                module = self.family.build_unseeded(name)
            keys += [f"{name}.{k}" for k in module.state_dict()]
        return keys

    def to_hf(self, state: dict) -> dict:
        """Plain state dict -> the transformers model's state dict (``logit_scale`` back to 0-dim)."""
        out = {}
        for k, v in state.items():
            theirs = hf.translate(k, self.rules)
            if theirs is None:
                raise KeyError(f"no transformers name for {k}")
            out[theirs] = v.reshape(()) if theirs == "logit_scale" else v
        return out

    def from_hf(self, hf_state: dict) -> dict:
        """The transformers model's state dict -> plain state dict (every plain weight must be present)."""
        out = {}
        for k in self._plain_keys():
            theirs = hf.translate(k, self.rules)
            if theirs not in hf_state:
                raise ConfigError(f"transformers state dict has no {theirs} for {k}")
            v = hf_state[theirs]
            out[k] = v.reshape(1) if k == "loss.logit_scale" else v
        return out

    def hf_config(self):
        f = self.family
        if self.kind == "CLIPModel":
            from transformers import CLIPConfig
            return CLIPConfig(text_config=f.text.hf_config.to_dict(), vision_config=f.vision.hf_config.to_dict(),
                              projection_dim=f.projection_dim, logit_scale_init_value=f.logit_scale_init)
        from transformers import VisionTextDualEncoderConfig
        return VisionTextDualEncoderConfig.from_vision_text_configs(
            f.vision.hf_config, f.text.hf_config, projection_dim=f.projection_dim,
            logit_scale_init_value=f.logit_scale_init)

    def hf_model(self, state: dict):
        """The transformers model holding ``state`` (eval mode)."""
        import transformers
        model = getattr(transformers, self.kind)(self.hf_config())
        theirs = self.to_hf(state)
        if self.kind != "CLIPModel" and "vision_model.vision_model.embeddings.class_embedding" in model.state_dict():
            theirs = {("vision_model." + k if k.startswith("vision_model.") else k): v for k, v in theirs.items()}
        missing, unexpected = model.load_state_dict(theirs, strict=False)
        # buffers transformers rebuilds itself (position ids) may be absent from a plain state dict
        missing = [k for k in missing if not k.endswith(("position_ids", "token_type_ids"))]
        if missing or unexpected:
            raise ConfigError(f"{self.kind}: weights do not match (missing {missing[:3]}, unexpected {unexpected[:3]})")
        return model.eval()
