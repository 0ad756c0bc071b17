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

from mmpipe.pipeline.layers import PipeLayer
from mmpipe.pipeline.partition import modality_partition, stage_lists

LAYERS_FILE = "mmpipe_layers.json"


def param_counts(spec) -> list[int]:
    """Trainable parameters per layer, counted on the meta device (no memory, no weights read)."""
    counts = []
    for name in spec.part_names():
        with torch.device("meta"):
            m = spec._build_unseeded(name)
        counts.append(sum(p.numel() for p in m.parameters() if p.requires_grad))
    return counts


def plan_parts(spec, num_stages: int, placement: str) -> Optional[list[int]]:
    """Explicit parts for mmpipe placements; None means "let DeepSpeed partition"."""
    names = spec.part_names()
    if placement == "modality":
        # cost model until the profiler exists: trainable parameters (plus one, so empty layers count)
        costs = [c + 1 for c in param_counts(spec)]
        return modality_partition(costs, [spec.branch(n) for n in names], num_stages)
    return None


class MMPipelineModule(PipelineModule):
    def __init__(self, spec, num_stages: int, placement: str = "modality", parts: Optional[list[int]] = None,
                 topology=None, **kwargs):
        self.layer_names = spec.part_names()
        self.mm_parts = parts if parts is not None else plan_parts(spec, num_stages, placement)
        method = placement if self.mm_parts is None else "uniform"
        layers = [LayerSpec(PipeLayer, spec, name) for name in self.layer_names]
        super().__init__(layers=layers, num_stages=None if topology else num_stages, topology=topology,
                         loss_fn=None, partition_method=method, **kwargs)

    def _partition_layers(self, method="uniform"):
        if self.mm_parts is None:
            return super()._partition_layers(method)
        if len(self.mm_parts) != self.num_stages + 1 or self.mm_parts[-1] != len(self._layer_specs):
            raise ValueError(f"parts {self.mm_parts} do not describe {self.num_stages} stages of "
                             f"{len(self._layer_specs)} layers")
        self.parts = list(self.mm_parts)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    def stage_layer_names(self) -> list[list[str]]:
        return stage_lists(self.layer_names, self.parts)

    def save_layer_names(self, ckpt_dir: str) -> None:
        os.makedirs(ckpt_dir, exist_ok=True)
        with open(os.path.join(ckpt_dir, LAYERS_FILE), "w") as fh:
            json.dump({"layers": self.layer_names, "parts": self.parts}, fh)


def fix_recv_buffer_dtype(engine) -> None:
    """Work around DeepSpeed reusing a pipe receive/grad buffer whose dtype is stale.

    ``PipelineEngine._allocate_or_extend_buffers`` keys buffers by position and only checks the
    element count, so with 3+ stages a buffer that last held int64 token ids can be handed back as
    the buffer for a float gradient (or the reverse). Reallocate when the dtype differs.
    """
    original = engine._allocate_or_extend_buffers

    def allocate(idx, shape, dtype):
        bufs = engine._grad_layer_buf
        if idx < len(bufs) and bufs[idx].dtype != dtype:
            bufs[idx] = engine._allocate_buffer(shape, dtype=dtype, num_buffers=1)[0]
        return original(idx, shape, dtype)

    engine._allocate_or_extend_buffers = allocate
