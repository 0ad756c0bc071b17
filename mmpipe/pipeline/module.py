"""DeepSpeed ``PipelineModule`` built from a family's layers, with explicit stage boundaries.

DeepSpeed's ``partition_method`` cannot take explicit boundaries, so ``MMPipelineModule`` takes
the plan's ``parts`` (P+1 layer indices; the planner computes DeepSpeed's own methods ``uniform``,
``parameters`` and ``type:REGEX`` with DeepSpeed's functions) and sets this rank's bounds itself.
"""
from __future__ import annotations

from deepspeed.pipe import LayerSpec, PipelineModule

from mmpipe.pipeline.layers import PipeLayer, plain_state_key
from mmpipe.pipeline.partition import stage_lists


class MMPipelineModule(PipelineModule):
    """The family's layers as DeepSpeed pipeline layers, cut at the plan's boundaries (``parts``:
    P+1 layer indices). A family with label fields gets ``loss_fn`` (outputs, labels) -> loss on
    the last stage; a family whose last layer computes the loss has none."""

    def __init__(self, family, num_stages: int, parts: list, topology=None, forward_only: frozenset = frozenset(),
                 **kwargs):
        self.layer_names = family.layer_names()
        self.mm_parts = [int(x) for x in parts]
        layers = [LayerSpec(PipeLayer, family, name, name in forward_only) for name in self.layer_names]
        loss_fn = LabelLoss(family) if family.labels else None
        super().__init__(layers=layers, num_stages=None if topology else num_stages, topology=topology,
                         loss_fn=loss_fn, partition_method="uniform", **kwargs)

    def _partition_layers(self, method="uniform"):
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


class LabelLoss:
    """DeepSpeed's ``loss_fn(outputs, labels)`` on the last stage: the family's loss."""

    def __init__(self, family):
        self.family = family

    def __call__(self, outputs, labels):
        return self.family.loss(outputs, *labels)
