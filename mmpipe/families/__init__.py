"""Model families. Each is one package (``clip/``, ``vlm/``, or a plugin's module) that registers
its ``Family`` class under a ``model.type`` name; ``base.py`` is the modality-agnostic interface,
``image_text.py`` the image-caption data defaults, ``chat/`` what every chat family shares,
``towers/`` the reusable encoders. The registry
itself lives in ``mmpipe.config.registry`` (config resolution needs it); its public names are
re-exported here for plugins."""
from mmpipe.config.registry import family_names, get_family, register_family
from mmpipe.config.resolve import build_family, resolve_family

__all__ = ["build_family", "family_names", "get_family", "register_family", "resolve_family"]
