"""DeepSpeed ``PipelineModule`` built from the plain model's parts, with explicit stage boundaries.

DeepSpeed's ``partition_method`` cannot take explicit boundaries, so ``MMPipelineModule`` accepts
``parts`` (P+1 layer indices) and sets this rank's bounds itself; DeepSpeed's own methods
(``uniform``, ``parameters``, ``type:REGEX``) stay selectable by passing ``parts=None``.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
from deepspeed.pipe import LayerSpec, PipelineModule

from mmpipe.pipeline.layers import PipeLayer, plain_state_key
from mmpipe.pipeline.partition import min_max_partition, modality_partition, parts_from_lists, stage_lists

def meta_parts(spec) -> dict:
    """{part name: {plain parameter name: numel}}, built on the meta device (no memory, no I/O)."""
    out = {}
    for name in spec.part_names():
        with torch.device("meta"):
            m = spec._build_unseeded(name)
        out[name] = {f"{name}.{k}": p.numel() for k, p in m.named_parameters()}
    return out


def plan_parts(spec, num_stages: int, placement: str, plan_file: Optional[str] = None,
               frozen_params: frozenset = frozenset()) -> Optional[list[int]]:
    """Explicit parts for mmpipe placements; None means "let DeepSpeed partition".

    Cost model until the profiler exists: trainable parameters per layer, plus one so that
    parameter-free layers still count (frozen parameters cost no gradient or optimizer work)."""
    from mmpipe.errors import ConfigError
    names = spec.part_names()
    if num_stages > len(names):
        raise ConfigError(f"parallel.pipeline_stages={num_stages} is more than the model's {len(names)} layers "
                          f"({names[0]} .. {names[-1]}): use at most {len(names)} stages")
    if plan_file:
        return parts_from_plan_file(plan_file, names, num_stages)
    if placement.startswith("type:"):
        return type_partition(names, placement, num_stages)
    if placement not in ("modality", "balanced", "auto"):
        return None
    costs = [1 + sum(n for pname, n in params.items() if pname not in frozen_params)
             for params in meta_parts(spec).values()]
    if placement == "modality":
        return modality_partition(costs, [spec.branch(n) for n in names], num_stages)
    return min_max_partition(costs, num_stages)


def type_partition(names: list, placement: str, num_stages: int) -> list[int]:
    """``type:REGEX``: DeepSpeed's rule (balance the layers the regex matches) over mmpipe's layer
    names, as ``mmpipe plan`` shows it (DeepSpeed itself would match the class name, PipeLayer)."""
    import re

    from deepspeed.runtime import utils as ds_utils

    from mmpipe.errors import ConfigError
    try:
        rx = re.compile(placement.split(":", 1)[1], re.IGNORECASE)
    except re.error as e:
        raise ConfigError(f"parallel.placement={placement}: not a valid regex ({e})") from None
    weights = [1 if rx.search(n) else 0 for n in names]
    if sum(weights) < num_stages:
        raise ConfigError(f"parallel.placement={placement} matches {sum(weights)} layer(s), fewer than the "
                          f"{num_stages} stages (layers: {', '.join(names)}); use a regex that matches at least one "
                          "layer per stage, e.g. type:blocks")
    parts = [int(x) for x in ds_utils.partition_balanced(weights=weights, num_parts=num_stages)]
    if any(b <= a for a, b in zip(parts, parts[1:])):
        raise ConfigError(f"parallel.placement={placement} leaves a stage empty (boundaries {parts}); use a regex "
                          "that matches more layers, or placement balanced")
    return parts


def parts_from_plan_file(path: str, names: list, num_stages: int) -> list[int]:
    from mmpipe.errors import ConfigError
    if not os.path.isfile(path):
        raise ConfigError(f"parallel.plan: file not found: {path} (a plan.json from a run, or {{\"stages\": [[layer names]...]}})")
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"parallel.plan: {path} is not valid JSON ({e}); give a run's plan.json or "
                          "{\"stages\": [[layer names], ...]}") from None
    stages = doc.get("stages") if isinstance(doc, dict) else None
    if not isinstance(stages, list) or len(stages) != num_stages:
        raise ConfigError(f"parallel.plan: {path} must hold \"stages\": a list of {num_stages} lists of layer names")
    try:
        return parts_from_lists(names, stages)
    except ValueError as e:
        raise ConfigError(f"parallel.plan: {path}: {e} (layers: {', '.join(names)})") from None


class MMPipelineModule(PipelineModule):
    def __init__(self, spec, num_stages: int, placement: str = "modality", parts: Optional[list[int]] = None,
                 topology=None, forward_only: frozenset = frozenset(), **kwargs):
        self.layer_names = spec.part_names()
        self.mm_parts = parts if parts is not None else plan_parts(spec, num_stages, placement)
        method = placement if self.mm_parts is None else "uniform"
        layers = [LayerSpec(PipeLayer, spec, name, name in forward_only) for name in self.layer_names]
        super().__init__(layers=layers, num_stages=None if topology else num_stages, topology=topology,
                         loss_fn=None, partition_method=method, **kwargs)

    def _partition_layers(self, method="uniform"):
        if self.mm_parts is None:
            return super()._partition_layers(method)
        if len(self.mm_parts) != self.num_stages + 1 or self.mm_parts[-1] != len(self._layer_specs):
            raise ValueError(f"parts {self.mm_parts} do not describe {self.num_stages} stages of "
                             f"{len(self._layer_specs)} layers")
        from mmpipe.parallel.ds_compat import set_stage_bounds
        set_stage_bounds(self, self.mm_parts)

    def plain_named_parameters(self):
        """This stage's parameters under the plain model's names (for groups and freezing)."""
        for layer in self.forward_funcs:
            if isinstance(layer, PipeLayer):
                for k, p in layer.named_parameters():
                    yield plain_state_key(layer.name, k), p

    def stage_layer_names(self) -> list[list[str]]:
        return stage_lists(self.layer_names, self.parts)
