"""Local transformers directories: read configs and weights, map names between mmpipe and HF.

Nothing here touches a hub: every call passes ``local_files_only=True`` or opens files directly.
Weights are read lazily per tensor (safetensors ``safe_open``), so a pipeline stage reads only the
tensors of the parts it builds.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from mmpipe.config.hub import not_found
from mmpipe.errors import ConfigError

# mmpipe parameter-name prefix -> transformers prefix (first match wins), per source layout
CLIP_VISION_RULES = [("vision.embed.", "vision_model."), ("vision.blocks.", "vision_model.encoder.layers."),
                     ("vision.head.", "vision_model.")]
CLIP_TEXT_RULES = [("text.embed.", "text_model."), ("text.blocks.", "text_model.encoder.layers."),
                   ("text.head.", "text_model.")]
BERT_RULES = [("text.embed.", ""), ("text.blocks.", "encoder.layer."), ("text.head.", "")]
CLIP_TOP_RULES = [("visual_projection.", "visual_projection."), ("text_projection.", "text_projection."),
                  ("loss.logit_scale", "logit_scale")]
RESNET_RULES = [("vision.embed.", "")] + [(f"vision.blocks.{i}.", f"layer{i + 1}.") for i in range(4)]


def translate(name: str, rules, strict: bool = False) -> Optional[str]:
    """``name`` under the first rule whose prefix it has; None (``strict``: ``KeyError``) when none has."""
    for mine, theirs in rules:
        if name.startswith(mine):
            return theirs + name[len(mine):]
    if strict:
        raise KeyError(f"no transformers name for {name}")
    return None


def check_dir(path: str, key: str) -> str:
    if not os.path.isdir(path):
        if os.path.exists(path):
            raise ConfigError(f"{key}: {path} is a file: give a transformers save_pretrained directory (or a hub id)")
        raise ConfigError(not_found(path, key, "save_pretrained directory"))
    return path


def load_hf_config(path: str, key: str):
    from transformers import AutoConfig
    check_dir(path, key)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{key}: {path} has no config.json (expected a transformers save_pretrained directory)")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any parse problem becomes one line
        raise ConfigError(f"{key}: cannot read {path}/config.json: {str(e).splitlines()[0]}") from None


def check_fields_agree(cfg, fields, hf_config, section: str, key: str) -> None:
    """Architecture fields set next to a pretrained directory must match its config.json."""
    for f in fields:
        mine, theirs = getattr(cfg, f), getattr(hf_config, f, None)
        if mine != theirs:
            raise ConfigError(f"{section}.{f}={mine} disagrees with {key} ({f}={theirs} in its config.json); "
                              f"unset {section}.{f} or use a matching directory")


def load_preprocessor_stats(path: Optional[str]):
    """(mean, std) from a preprocessor_config.json next to the weights, if any."""
    if not path:
        return None
    f = os.path.join(path, "preprocessor_config.json")
    if not os.path.isfile(f):
        return None
    with open(f) as fh:
        d = json.load(fh)
    if "image_mean" in d and "image_std" in d:
        return tuple(d["image_mean"]), tuple(d["image_std"])
    return None


class WeightSource:
    """Lazy reader over model.safetensors / sharded safetensors / pytorch_model.bin in a directory
    (the files are opened on first use, so a model built without its pretrained weights, such as an
    ``mmpipe export`` directory, never needs them)."""

    def __init__(self, path: str, key: str):
        self.path = check_dir(path, key)
        self.key = key
        self._index: Optional[dict] = None
        self._handles = {}
        self._torch_sd = None

    def _files(self) -> dict:
        if self._index is not None:
            return self._index
        path = self.path
        st_index = os.path.join(path, "model.safetensors.index.json")
        st = os.path.join(path, "model.safetensors")
        if os.path.isfile(st_index):
            with open(st_index) as fh:
                wm = json.load(fh)["weight_map"]
            self._index = {k: os.path.join(path, v) for k, v in wm.items()}
        elif os.path.isfile(st):
            from safetensors import safe_open
            with safe_open(st, "pt") as fh:
                self._index = {k: st for k in fh.keys()}
        else:
            for name in ("pytorch_model.bin", "model.pt", "model.pth"):
                f = os.path.join(path, name)
                if os.path.isfile(f):
                    self._torch_sd = torch.load(f, map_location="cpu", weights_only=True)
                    self._index = {k: f for k in self._torch_sd}
                    break
            else:
                raise ConfigError(f"{self.key}: {path} holds no model.safetensors or pytorch_model.bin")
        return self._index

    def __contains__(self, name: str) -> bool:
        return name in self._files()

    def keys(self):
        return self._files().keys()

    def get(self, name: str) -> torch.Tensor:
        f = self._files()[name]
        if self._torch_sd is not None:
            return self._torch_sd[name]
        if f not in self._handles:
            from safetensors import safe_open
            self._handles[f] = safe_open(f, "pt")
        return self._handles[f].get_tensor(name)


def load_part_weights(module: torch.nn.Module, part_name: str, source: WeightSource, rules,
                      optional: tuple = ()) -> None:
    """Fill ``module`` (the part called ``part_name``) from ``source`` using the name ``rules``.
    Weights under an ``optional`` prefix that the source lacks keep the module's own (seeded) values."""
    sd = {}
    fresh = []
    for k, v in module.state_dict().items():
        full = f"{part_name}.{k}" if k else part_name
        hf = translate(full, rules)
        if hf is None or hf not in source:
            # tolerate a "bert." / "model." wrapper prefix in the saved names
            alt = next((p + hf for p in ("bert.", "model.") if hf is not None and p + hf in source), None)
            if alt is None and full.startswith(optional):
                sd[k] = v
                fresh.append(hf)
                continue
            if alt is None:
                raise ConfigError(f"{source.key}: {source.path} has no weight '{hf}' for {full} "
                                  "(is this the right architecture?)")
            hf = alt
        t = source.get(hf)
        if t.shape != v.shape and t.numel() == v.numel() == 1:
            t = t.reshape(v.shape)  # scalar stored 0-dim by transformers (logit_scale)
        if t.shape != v.shape:
            raise ConfigError(f"{source.key}: weight '{hf}' in {source.path} has shape {tuple(t.shape)}, "
                              f"the model expects {tuple(v.shape)} for {full}")
        sd[k] = t
    if fresh:
        import warnings
        warnings.warn(f"{source.key}: {source.path} has no {', '.join(fresh)}: initialised fresh (train them)",
                      stacklevel=2)
    module.load_state_dict(sd, strict=True)


def image_processor(size: int, mean, std):
    """The processor an export writes: shortest edge ``size`` with antialiased bilinear, centre crop,
    normalise - what mmpipe's loader (``data.decode.load_image``) does, so on a fully decoded image
    (a VLM's; a CLIP run's below twice the size, where no JPEG draft decode is used) it gives
    training's pixels exactly with transformers' torchvision backend, within one grey level with its
    PIL backend."""
    from PIL import Image
    from transformers import CLIPImageProcessor
    return CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size},
                              resample=Image.Resampling.BILINEAR, image_mean=list(mean), image_std=list(std),
                              do_convert_rgb=True)
