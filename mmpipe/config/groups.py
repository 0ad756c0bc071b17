"""Named parameter groups (per-branch lr, weight decay, gradient-norm limit, freezing), the parameter
assignment and freezing they imply, and the learning-rate schedule. Clipping by group: ``mmpipe.train.clipping``."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from mmpipe.config.schema import FREEZE_FLAGS, LR_FLAGS
from mmpipe.errors import ConfigError


# --------------------------------------------------------------------------------------------
# groups
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Group:
    name: str
    patterns: tuple
    lr: float
    weight_decay: float
    max_grad_norm: Optional[float]
    frozen: bool


def resolve_groups(optim_cfg, family) -> list[Group]:
    """The configured groups with ``optim.freeze`` and the family's freeze spellings (``optim.freeze_vit``...)
    applied."""
    shortcuts: dict = {}
    lora = getattr(optim_cfg, "train_type", "full") == "lora"
    for flag, group in family.freeze_shortcuts.items():
        v = getattr(optim_cfg, flag)
        if v is None:  # ms-swift's freeze_vit / freeze_aligner unset: frozen (no adapters) under LoRA only
            v = lora
        shortcuts[group] = shortcuts.get(group, False) or v
    for group in optim_cfg.freeze or ():
        if group not in optim_cfg.groups:
            raise ConfigError(f"optim.freeze: {group!r} is not a group (groups: {', '.join(optim_cfg.groups)}); "
                              "name a group of optim.groups")
        shortcuts[group] = True
    for flag in FREEZE_FLAGS:
        if getattr(optim_cfg, flag) and flag not in family.freeze_shortcuts:
            raise ConfigError(f"optim.{flag}: model.type={family.name} has no such shortcut (it has "
                              f"{', '.join(family.freeze_shortcuts) or 'none'}); freeze a group with "
                              "optim.groups.<name>.freeze=true")
    lrs = {}
    for flag in LR_FLAGS:
        v = getattr(optim_cfg, flag)
        if v is None:
            continue
        if flag not in family.lr_shortcuts:
            raise ConfigError(f"optim.{flag}: model.type={family.name} has no such shortcut; set "
                              "optim.groups.<name>.lr")
        group = family.lr_shortcuts[flag]
        if group not in optim_cfg.groups:
            raise ConfigError(f"optim.{flag} is set but there is no optim.groups.{group}")
        if optim_cfg.groups[group].lr is not None and optim_cfg.groups[group].lr != v:
            raise ConfigError(f"optim.{flag}={v} contradicts optim.groups.{group}.lr={optim_cfg.groups[group].lr}; "
                              "set one of them")
        lrs[group] = v
    out = []
    for name, g in optim_cfg.groups.items():
        frozen = bool(g.freeze or shortcuts.get(name, False))
        for p in g.patterns:
            try:
                re.compile(p)
            except re.error as e:
                raise ConfigError(f"optim.groups.{name}.patterns: {p!r} is not a valid regex ({e})") from None
        if not g.patterns:
            raise ConfigError(f"optim.groups.{name}: no patterns; give patterns or remove the group ({name}: null)")
        if g.max_grad_norm is not None and g.max_grad_norm <= 0:
            raise ConfigError(f"optim.groups.{name}.max_grad_norm must be > 0 (inf = no clip), got {g.max_grad_norm}")
        lr = lrs.get(name, optim_cfg.lr if g.lr is None else g.lr)
        out.append(Group(name, tuple(g.patterns), lr,
                         optim_cfg.weight_decay if g.weight_decay is None else g.weight_decay,
                         g.max_grad_norm, frozen))
    for flag, name in family.freeze_shortcuts.items():
        if getattr(optim_cfg, flag) and name not in optim_cfg.groups:
            raise ConfigError(f"optim.{flag} is set but there is no optim.groups.{name}")
    if out and all(g.frozen for g in out):
        raise ConfigError(f"optim: every parameter group is frozen ({', '.join(g.name for g in out)}): nothing would "
                          "train; unfreeze one (optim.freeze / the freeze_* flags)")
    return out


def assign_groups(names, groups: list[Group]) -> dict:
    """parameter name -> group name; every parameter must match exactly one group."""
    compiled = [(g.name, [re.compile(p) for p in g.patterns]) for g in groups]
    out = {}
    for n in names:
        hits = [gname for gname, pats in compiled if any(p.search(n) for p in pats)]
        if not hits:
            raise ConfigError(f"optim.groups: parameter '{n}' matches no group; add a pattern for it "
                              f"(groups: {', '.join(g.name for g in groups)})")
        if len(hits) > 1:
            raise ConfigError(f"optim.groups: parameter '{n}' matches both '{hits[0]}' and '{hits[1]}'; "
                              "make the patterns exclusive")
        out[n] = hits[0]
    return out


def freeze_key(optim_cfg, family, layer: str) -> str:
    """How to freeze what ``layer`` trains: its trained group's shortcut (``optim.freeze_aligner=true``), else the
    group by name (``optim.freeze=[merger]``); under LoRA, the adapters of that group."""
    groups = resolve_groups(optim_cfg, type(family))
    names = list(family.meta_params().get(layer) or ())
    owner = assign_groups(names, groups)
    by_name = {g.name: g for g in groups}
    group = next((owner[n] for n in names if not by_name[owner[n]].frozen), owner[names[0]] if names else "?")
    flag = next((f for f, g in family.freeze_shortcuts.items() if g == group), None)
    return f"its group {group}: optim.{flag}=true" if flag else f"its group {group}: optim.freeze=[{group}]"


def wants_decay(name: str, param: torch.Tensor) -> bool:
    """Decay matrices and conv kernels (a ViT's patch_embedding is a conv kernel); not biases,
    norms, embedding tables (every ``nn.Embedding``'s weight, marked by ``mark_embedding_tables``
    whatever its name - a decoder's ``embed_tokens`` and the head tied to it - and parameters named
    like token/position/class embeddings), logit_scale."""
    if getattr(param, "_mmpipe_embedding", False):
        return False
    if param.ndim >= 3:  # conv kernels
        return True
    return param.ndim == 2 and "embedding" not in name.lower()


def mark_embedding_tables(module: torch.nn.Module) -> int:
    """Mark every ``nn.Embedding`` weight of ``module`` as an embedding table (no weight decay, by type
    not by name); returns how many."""
    n = 0
    for m in module.modules():
        if isinstance(m, torch.nn.Embedding):
            m.weight._mmpipe_embedding = True
            n += 1
    return n


def _adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name  # (mmpipe.families.lora.is_adapter; config sits below families)


def check_frozen_lrs(optim_cfg, family, groups: list) -> None:
    """An lr given to a group that trains nothing (frozen, or LoRA's default for the ViT / aligner)
    would be ignored: one line (checked when a run starts; a saved run still loads)."""
    lora = getattr(optim_cfg, "train_type", "full") == "lora"
    for g in groups:
        if not g.frozen:
            continue
        flag = next((f for f in LR_FLAGS if getattr(optim_cfg, f) is not None and family.lr_shortcuts.get(f) == g.name),
                    None)
        given = f"optim.{flag}={getattr(optim_cfg, flag)}" if flag else None
        if given is None and g.name in optim_cfg.groups and optim_cfg.groups[g.name].lr is not None:
            given = f"optim.groups.{g.name}.lr={optim_cfg.groups[g.name].lr}"
        if given:
            why = ("LoRA's default for it (optim.freeze_vit / freeze_aligner unset)"
                   if lora and not optim_cfg.groups[g.name].freeze else "it is frozen")
            raise ConfigError(f"{given} is set but the {g.name} group trains nothing ({why}): set its freeze flag "
                              "to false to train it, or drop the lr")


def frozen_names(names, groups: list[Group], lora: bool = False) -> set:
    """Parameters that get no gradient: those of frozen groups, and under LoRA every base weight."""
    assignment = assign_groups(list(names), groups)
    frozen_groups = {g.name for g in groups if g.frozen}
    return {n for n, g in assignment.items() if g in frozen_groups or (lora and not _adapter(n))}


def apply_freeze(named_params, groups: list[Group], lora: bool = False) -> None:
    named_params = list(named_params)
    frozen = frozen_names([n for n, _ in named_params], groups, lora)
    for n, p in named_params:
        if n in frozen:
            p.requires_grad_(False)


def param_groups(named_params, groups: list[Group]) -> list[dict]:
    """torch param groups: per named group, a decayed and an undecayed part (both carry ``name``),
    and a part of its own for a tied parameter's copy on a later pipeline stage
    (``ds_pipe_replicated``, marked ``replica``: scaled with its group, counted once in norms, also
    where ZeRO flattens each group's gradients). Frozen parameters are left out entirely (no
    optimizer state). Stages hold different groups; nothing in DeepSpeed may depend on the group
    count matching across stages (see ds_config)."""
    named_params = list(named_params)
    assignment = assign_groups([n for n, _ in named_params], groups)
    by_name = {g.name: g for g in groups}
    buckets: dict = {}
    for n, p in named_params:
        g = by_name[assignment[n]]
        if g.frozen or not p.requires_grad:
            continue
        replica = bool(getattr(p, "ds_pipe_replicated", False))
        buckets.setdefault((g.name, wants_decay(n, p), replica), []).append(p)
    out = []
    for g in groups:
        for replica in (False, True):
            for decay in (True, False):
                params = buckets.get((g.name, decay, replica))
                if params:
                    out.append({"name": g.name, "params": params, "lr": g.lr,
                                "weight_decay": g.weight_decay if decay else 0.0, **({"replica": True} if replica else {})})
    return out


def forward_only_parts(part_params: dict, upstream: dict, groups: list[Group], lora: bool = False) -> set:
    """Layers that can run without autograd: all their parameters are frozen and so is every layer
    upstream of them (``Family.upstream``: nothing before them needs a gradient through them).
    ``part_params``: ordered {layer name: [parameter names]}."""
    frozen = frozen_names([n for names in part_params.values() for n in names], groups, lora)
    trainable = {part for part, names in part_params.items() if any(n not in frozen for n in names)}
    return {part for part in part_params if part not in trainable and not (upstream[part] & trainable)}


class FrozenLayout(NamedTuple):
    """What trains: ``part_params`` {layer: [its plain parameter names]}, ``frozen`` parameter names,
    ``forward_only`` layers (frozen, nothing trainable upstream: they run without autograd)."""
    part_params: dict
    frozen: frozenset
    forward_only: frozenset


def frozen_layout(family, groups: list[Group]) -> FrozenLayout:
    """For the whole model, checked on the meta device (every parameter must land in exactly one
    group): ({layer: [its plain parameter names]}, frozen parameter names, forward-only layers).
    Under LoRA (``family.lora``) the names include the adapters, and every base weight is frozen."""
    part_params = {part: list(params) for part, params in family.meta_params().items()}
    lora = family.lora is not None
    frozen = frozenset(frozen_names([n for names in part_params.values() for n in names], groups, lora))
    return FrozenLayout(part_params, frozen, frozenset(forward_only_parts(part_params, family.upstream(), groups, lora)))


# --------------------------------------------------------------------------------------------
# schedule
# --------------------------------------------------------------------------------------------
def lr_lambda(optim_cfg, total_steps: int):
    warm = optim_cfg.warmup_steps

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if optim_cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total_steps - warm))
        return optim_cfg.min_lr_ratio + (1 - optim_cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


