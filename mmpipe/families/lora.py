"""LoRA adapters on a family's layers, with peft (``optim.train_type: lora``).

Each layer that holds a trained group's parameters gets peft's ``LoraLayer`` on its target modules
(``optim.target_modules``; ``all-linear`` = every ``nn.Linear`` but an output head, a layer that is
itself a Linear included: CLIP's projections, as peft's all-linear on a ``CLIPModel``), injected after
its base weights are built and loaded, under a seed derived from (seed, layer name): the adapters'
initial values are the same in one process and on any pipeline stage, as the base weights are.
Every base weight is frozen (no gradient, no optimizer state); the adapters train in their layer's
group. CLIP's temperature (``logit_scale``) stays frozen, as under peft's all-linear on a ``CLIPModel``. Plain parameter names then read ``...q_proj.base_layer.weight`` (the frozen weight) and
``...q_proj.lora_A.default.weight`` / ``lora_B`` (peft's names); ``merged`` folds the adapters back
into plain weights (export, generation), ``adapter_state`` keeps only them."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from mmpipe.config.groups import assign_groups
from mmpipe.errors import ConfigError

ADAPTER = "default"  # peft's adapter name
_ADAPTER_RE = re.compile(r"\.lora_(A|B)\.")
HEAD_NAMES = ("lm_head",)  # never adapted by all-linear (peft and ms-swift leave the output layer alone)


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: int
    dropout: float
    target_modules: tuple
    layers: frozenset  # the layers that get adapters (those holding a trained group's parameters)
    target_parameters: tuple = ()  # peft's parameter LoRA (a MoE's fused experts: one low-rank update per expert)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def canonical(self) -> dict:
        """The spec as plain, ordered values (a key that is the same in every process: a frozenset's order, and
        so its ``repr``, changes with the interpreter's string-hash seed)."""
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                "target_modules": sorted(self.target_modules) if not isinstance(self.target_modules, str)
                else self.target_modules, "layers": sorted(self.layers),
                **({"target_parameters": sorted(self.target_parameters)} if self.target_parameters else {})}


def is_adapter(name: str) -> bool:
    return bool(_ADAPTER_RE.search(name))


def base_name(name: str) -> str:
    """A plain weight's name without peft's wrappers (``q_proj.base_layer.weight`` -> ``q_proj.weight``; a parameter
    LoRA nests one per targeted parameter: ``experts.base_layer.base_layer.down_proj`` -> ``experts.down_proj``)."""
    while ".base_layer." in name:
        name = name.replace(".base_layer.", ".")
    return name


def matches(name: str, targets_: tuple) -> bool:
    """A parameter name matched by peft's ``target_parameters`` (the name, or a suffix after a dot)."""
    return any(name == t or name.endswith("." + t) for t in targets_)


def expert_delta(a: torch.Tensor, b: torch.Tensor, experts: int, scaling: float) -> torch.Tensor:
    """peft's ``ParamWrapper`` update of a fused experts tensor [E, out, in] (transformers' layout, not transposed):
    ``lora_A`` [r E, in] and ``lora_B`` [out, r E], one rank-r product per expert."""
    A = a.float().reshape(experts, -1, a.shape[-1])
    B = b.float().reshape(b.shape[0], -1, experts)
    return torch.einsum("o r e, e r i -> e o i", B, A) * scaling


def parameter_adapter(name: str, spec: "LoraSpec") -> bool:
    """Whether an adapter (``...experts.base_layer.lora_A.default.weight``) is a parameter LoRA's (peft's
    ``target_parameters``) rather than a Linear's: its unwrapped module holds a targeted parameter's name."""
    stem = base_name(name.split(".lora_")[0] + ".")[:-1]
    while stem.endswith(".base_layer"):
        stem = stem[:-len(".base_layer")]
    return any(matches(f"{stem}.{t.rpartition('.')[2]}", spec.target_parameters) for t in spec.target_parameters)


def peft_targets(spec: "LoraSpec", adapters) -> dict:
    """``LoraConfig``'s targets for a transformers model holding ``adapters`` (peft's names there): the modules of
    the Linear adapters, and the spec's ``target_parameters`` where a parameter LoRA is among them."""
    modules = sorted({n.split(".lora_")[0] for n in adapters if not parameter_adapter(n, spec)})
    params = any(parameter_adapter(n, spec) for n in adapters)
    return {"target_modules": modules or None, "target_parameters": list(spec.target_parameters) if params else None}


def parameter_wrappers(state: dict, targets_: tuple) -> dict:
    """{plain parameter name: the module path whose ``lora_A`` / ``lora_B`` adapt it}, from a state dict: peft wraps
    a module once per targeted parameter, each wrapper around the previous (the first parameter it meets innermost);
    each wrapper's factors have its parameter's shape ([E, out, in]: ``lora_B`` out rows, ``lora_A`` in columns),
    which names the parameter (registration order, innermost first, where two have one shape)."""
    names = [base_name(k) for k in state if not is_adapter(k)]
    by_module: dict = {}
    for n in names:
        if matches(n, targets_):
            module, _, param = n.rpartition(".")
            by_module.setdefault(module, []).append(param)
    plain = {base_name(k): v for k, v in state.items() if not is_adapter(k)}
    out = {}
    for module, params in by_module.items():
        left = list(params)
        for depth in range(len(params)):
            stem = module + ".base_layer" * depth
            a, b = state.get(f"{stem}.lora_A.{ADAPTER}.weight"), state.get(f"{stem}.lora_B.{ADAPTER}.weight")
            if a is None or b is None:
                break
            fits = [p for p in left if tuple(plain[f"{module}.{p}"].shape[1:]) == (b.shape[0], a.shape[1])]
            if not fits:
                break
            p = fits[-1]  # (the outermost wrapper adapts the last-registered parameter)
            out[f"{module}.{p}"] = stem
            left.remove(p)
    return out


def targets(module: nn.Module, target_modules, root: str = "") -> list:
    """The names (within ``module``) of the submodules that get adapters; ``""`` for a module that is
    itself a target Linear (CLIP's projections: the layer *is* the Linear, as peft's all-linear adapts
    ``visual_projection`` on a ``CLIPModel``); ``root``: the layer's own name, matched for ``""``."""
    names = []
    for n, sub in module.named_modules():
        if not isinstance(sub, nn.Linear):
            continue
        full = f"{root}.{n}" if root and n else (n or root)
        leaf = full.rsplit(".", 1)[-1]
        if not full or leaf in HEAD_NAMES:  # the output head (tied to the embedding in small decoders) is never adapted
            continue
        if any(t == "all-linear" or full == t or full.endswith("." + t) for t in target_modules):
            names.append(n)
    return names


def require_peft() -> None:
    """peft importable, or one line (checked before a run writes anything)."""
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ConfigError("optim.train_type=lora needs peft, which mmpipe's install requires: "
                          "pip install -e . (or pip install peft)") from None


def inject(module: nn.Module, spec: LoraSpec, seed_context, root: str = "") -> nn.Module:
    """Add adapters to ``module``'s targets (initialised under ``seed_context``), freeze its base
    weights; returns the module, wrapped by peft's ``LoraLayer`` when it is itself a target Linear."""
    require_peft()
    from peft import LoraConfig, inject_adapter_in_model
    names = targets(module, spec.target_modules, root)
    params = [n for n, _ in module.named_parameters() if matches(n, spec.target_parameters)]
    if names or params:
        holder = nn.Module()
        holder.add_module("layer", module)  # peft replaces modules inside a parent, the layer's root too
        cfg = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, bias="none",
                         target_modules=[f"layer.{n}" if n else "layer" for n in names] or None,
                         target_parameters=list(spec.target_parameters) if params else None)
        with seed_context:
            inject_adapter_in_model(cfg, holder, adapter_name=ADAPTER)
        module = holder.layer
    for n, p in module.named_parameters():
        p.requires_grad_(is_adapter("." + n))
    return module


def merged(state: dict, spec: Optional[LoraSpec]) -> dict:
    """Plain weights with every adapter folded in: W + (B @ A) * alpha / r, under the base names."""
    if spec is None and not any(is_adapter(k) for k in state):
        return state
    if spec is None:
        raise ValueError("LoRA weights without a LoRA spec")
    out = {}
    wrapped = parameter_wrappers(state, spec.target_parameters)
    for k, v in state.items():
        if is_adapter(k):
            continue
        if base_name(k) in wrapped:  # a parameter LoRA (a MoE's fused experts)
            stem = wrapped[base_name(k)]
            a, b = state.get(f"{stem}.lora_A.{ADAPTER}.weight"), state.get(f"{stem}.lora_B.{ADAPTER}.weight")
            if a is not None and b is not None:
                v = (v.float() + expert_delta(a, b, v.shape[0], spec.scaling)).to(v.dtype)
        elif ".base_layer." in k and k.endswith(".weight"):
            stem = k[:-len(".base_layer.weight")]
            a, b = state.get(f"{stem}.lora_A.{ADAPTER}.weight"), state.get(f"{stem}.lora_B.{ADAPTER}.weight")
            if a is not None and b is not None:
                v = (v.float() + (b.float() @ a.float()) * spec.scaling).to(v.dtype)
        out[base_name(k)] = v
    return out


def adapter_state(state: dict) -> dict:
    return {k: v for k, v in state.items() if is_adapter(k)}


def spec_from(optim_cfg, family, groups) -> Optional[LoraSpec]:
    """The run's LoRA spec (``optim.train_type: lora``), or None: adapters go on the layers that hold
    a parameter of a group that is not frozen."""
    if getattr(optim_cfg, "train_type", "full") != "lora":
        return None
    part_params = family.meta_params()
    assignment = assign_groups([n for names in part_params.values() for n in names], groups)
    trained = {g.name for g in groups if not g.frozen}
    layers = frozenset(part for part, names in part_params.items() if any(assignment[n] in trained for n in names))
    tm = optim_cfg.target_modules
    tm = (tm,) if isinstance(tm, str) else tuple(tm)
    if not tm:
        raise ConfigError("optim.target_modules is empty: give module names, or all-linear")
    if any(t.rsplit(".", 1)[-1] in HEAD_NAMES for t in tm):
        raise ConfigError(f"optim.target_modules={list(tm)}: the output head ({', '.join(HEAD_NAMES)}) takes no "
                          "adapter in mmpipe (it may be tied to the embedding); leave it out")
    tp = tuple(getattr(optim_cfg, "target_parameters", None) or ())
    bare = [t for t in tp if "." not in t]
    if bare:
        raise ConfigError(f"optim.target_parameters: {bare[0]} names a parameter without its module: give it as "
                          f"peft does, e.g. mlp.experts.{bare[0]} (a bare name would match Linear layers' paths too)")
    if tp and float(optim_cfg.lora_dropout) > 0:
        raise ConfigError(f"optim.target_parameters={list(tp)} with optim.lora_dropout={optim_cfg.lora_dropout}: peft's "
                          "parameter LoRA has no dropout (the update is folded into the weight); set lora_dropout 0")
    spec = LoraSpec(optim_cfg.lora_rank, optim_cfg.lora_alpha, float(optim_cfg.lora_dropout), tm, layers, tp)
    with torch.device("meta"):
        built = {name: family.build_unseeded(name) for name in sorted(layers)} if tp else {}
        hit = sum(len(targets(built.get(name) or family.build_unseeded(name), tm, name)) for name in sorted(layers))
    hits = [(n, p) for m in built.values() for n, p in m.named_parameters() if matches(n, tp)]
    if tp and not hits:
        raise ConfigError(f"optim.target_parameters={list(tp)} matches no parameter of the trained layers: name a "
                          "MoE's fused experts, e.g. mlp.experts.gate_up_proj")
    flat = sorted({n for n, p in hits if p.dim() != 3})
    if flat:
        raise ConfigError(f"optim.target_parameters={list(tp)} matches {flat[0]}, which is not a fused experts tensor "
                          "([experts, out, in]): parameter LoRA here is for a MoE's routed experts (mlp.experts."
                          "gate_up_proj, mlp.experts.down_proj); adapt other weights with optim.target_modules")
    if not hit:
        raise ConfigError(f"optim.target_modules={list(tm)} matches no linear layer of the trained layers "
                          f"({', '.join(sorted(layers)[:4])}...): name modules such as q_proj, or use all-linear")
    return spec
