"""The model-family registry (``model.type`` -> ``Family`` class).

Built-in families are imported on first use by module name (as transformers' auto classes do), so
config resolution needs no import of the families layer; others register themselves when their
module is imported: name it in ``MMPIPE_PLUGINS`` (comma-separated modules, imported by every
process of a run) or expose it as a ``mmpipe.families`` entry point of an installed package."""
from __future__ import annotations

import importlib
import os

from mmpipe.errors import ConfigError

BUILTIN = {"clip": "mmpipe.families.clip", "vlm": "mmpipe.families.vlm", "qwen2_5_vl": "mmpipe.families.qwen_vl",
           "siglip": "mmpipe.families.siglip", "qwen3_5": "mmpipe.families.qwen_vl.qwen3_5",
           "qwen3_vl": "mmpipe.families.qwen_vl.qwen3_vl", "qwen3_5_moe": "mmpipe.families.qwen_vl.qwen3_5_moe",
           "qwen3_vl_moe": "mmpipe.families.qwen_vl.qwen3_vl_moe"}
_REGISTRY: dict = {}
_plugins_loaded = [False]


def register_family(cls):
    """Class decorator: make ``cls`` (a ``mmpipe.families.base.Family``) the family ``cls.name``."""
    _REGISTRY[cls.name] = cls
    return cls


def _load_plugins() -> None:
    if _plugins_loaded[0]:
        return
    _plugins_loaded[0] = True
    for mod in filter(None, (m.strip() for m in os.environ.get("MMPIPE_PLUGINS", "").split(","))):
        try:
            importlib.import_module(mod)
        except ImportError as e:
            raise ConfigError(f"MMPIPE_PLUGINS: cannot import {mod!r} ({e}); put its directory on PYTHONPATH or "
                              "remove it from MMPIPE_PLUGINS") from None
    from importlib.metadata import entry_points
    for ep in entry_points(group="mmpipe.families"):
        if ep.name not in _REGISTRY:
            ep.load()


def family_names() -> list:
    _load_plugins()
    return sorted(set(BUILTIN) | set(_REGISTRY))


def get_family(name: str, where: str = "config"):
    """The family class registered as ``name`` (one line naming the known ones otherwise)."""
    if name not in _REGISTRY and name in BUILTIN:
        importlib.import_module(BUILTIN[name])
    if name not in _REGISTRY:
        _load_plugins()
    if name not in _REGISTRY:
        raise ConfigError(f"{where}: model.type={name!r} is not a registered model family (known: "
                          f"{', '.join(family_names())}); a plugin family must be imported first: list its module "
                          "in MMPIPE_PLUGINS")
    return _REGISTRY[name]
