"""transformers ``CLIPModel`` <-> the CLIP family's plain state dict (``from_hf`` / ``to_hf``) and
the ``CLIPConfig`` of a model (towers clip_vit + clip_text)."""
from __future__ import annotations

import torch

from mmpipe.errors import ConfigError
from mmpipe.families.towers import hf


class ClipHF:
    def __init__(self, family):
        self.family = family
        f = family
        if f.vision.arch != "clip_vit" or f.text.arch != "clip_text":
            raise ConfigError(f"transformers' CLIPModel needs model.vision.arch=clip_vit and model.text.arch=clip_text "
                              f"(this model: {f.vision.arch} + {f.text.arch})")
        self.rules = hf.CLIP_VISION_RULES + hf.CLIP_TEXT_RULES + hf.CLIP_TOP_RULES

    def _plain_keys(self) -> list:
        keys = []
        for name in self.family.layer_names():
            with torch.device("meta"):
                module = self.family.build_unseeded(name)
            keys += [f"{name}.{k}" for k in module.state_dict()]
        return keys

    def to_hf(self, state: dict) -> dict:
        """Plain state dict -> ``CLIPModel`` state dict (``logit_scale`` back to 0-dim)."""
        out = {}
        for k, v in state.items():
            theirs = hf.translate(k, self.rules)
            if theirs is None:
                raise KeyError(f"no transformers name for {k}")
            out[theirs] = v.reshape(()) if theirs == "logit_scale" else v
        return out

    def from_hf(self, hf_state: dict) -> dict:
        """``CLIPModel`` state dict -> plain state dict (every plain weight must be present)."""
        out = {}
        for k in self._plain_keys():
            theirs = hf.translate(k, self.rules)
            if theirs not in hf_state:
                raise ConfigError(f"transformers state dict has no {theirs} for {k}")
            v = hf_state[theirs]
            out[k] = v.reshape(1) if k == "loss.logit_scale" else v
        return out

    def hf_config(self):
        from transformers import CLIPConfig
        f = self.family
        return CLIPConfig(text_config=f.text.hf_config.to_dict(), vision_config=f.vision.hf_config.to_dict(),
                          projection_dim=f.projection_dim, logit_scale_init_value=f.logit_scale_init)
