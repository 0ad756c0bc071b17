"""The one path from a config to its family: ``resolve_family`` fills the ``model:`` fields left to
the tokenizer (the family's ``resolve``; the config itself is never changed) and builds the family
with the run's seed and, for ``optim.train_type: lora``, its adapters. A training run, ``mmpipe
plan`` / the benches (``planning.offline.resolve_for_plan``) and ``mmpipe.build_model`` all come
through here."""
from __future__ import annotations

from typing import Optional

from mmpipe.config.registry import get_family
from mmpipe.config.schema import replace


def resolve_family(config, tokenizer=None, seed: Optional[int] = None) -> tuple:
    """(config with the tokenizer's fields resolved, family) of a run config or its ``model``
    section; without ``tokenizer`` the config's fields are taken as they are."""
    model_cfg = getattr(config, "model", config)
    cls = get_family(model_cfg.type)
    if tokenizer is not None:
        model_cfg = cls.resolve(model_cfg, tokenizer, config.data)
        config = replace(config, model=model_cfg)
    if seed is None:
        seed = config.train.seed if hasattr(config, "train") else 0
    family = cls(model_cfg, seed)
    if hasattr(config, "optim"):  # a run config: its train_type decides whether layers carry LoRA adapters
        family.use_lora(config.optim)
    return config, family


def build_family(config, seed: Optional[int] = None):
    """The family of a run config (or its ``model`` section) whose fields are already resolved."""
    return resolve_family(config, None, seed)[1]
