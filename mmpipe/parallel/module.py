"""DeepSpeed ``PipelineModule`` built from a family's layers, with explicit stage boundaries.

DeepSpeed's ``partition_method`` cannot take explicit boundaries, so ``MMPipelineModule`` takes
the plan's ``parts`` (P+1 layer indices; the planner computes DeepSpeed's own methods ``uniform``,
``parameters`` and ``type:REGEX`` with DeepSpeed's functions) and sets this rank's bounds itself.
"""
from __future__ import annotations

from deepspeed.pipe import LayerSpec, PipelineModule

from mmpipe.parallel.ds_compat import pipe_layer_count, set_stage_bounds, stage_global_ranks, stage_layers
from mmpipe.parallel.executor import LayerExecutor
from mmpipe.parallel.layers import PipeLayer, plain_state_key
from mmpipe.parallel.plan import stage_lists


class MMPipelineModule(PipelineModule):
    """The family's layers as DeepSpeed pipeline layers, cut at the plan's boundaries (``parts``:
    P+1 layer indices). A family with label fields gets ``loss_fn`` (outputs, labels) -> loss on
    the last stage; a family whose last layer computes the loss has none."""

    def __init__(self, family, num_stages: int, parts: list, topology=None, forward_only: frozenset = frozenset(),
                 **kwargs):
        self.layer_names = family.layer_names()
        self.mm_parts = [int(x) for x in parts]
        # one run policy for this stage's layers (parallel.executor): the runner sets it up
        self.executor = LayerExecutor(forward_only, last=self.layer_names[-1], anchor=True)
        layers = [LayerSpec(PipeLayer, family, name, executor=self.executor) for name in self.layer_names]
        loss_fn = LabelLoss(family) if family.labels else None
        super().__init__(layers=layers, num_stages=None if topology else num_stages, topology=topology,
                         loss_fn=loss_fn, partition_method="uniform", **kwargs)
        self.family = family
        self.mm_ties = self._tie(family.tied_weights())

    def _tie(self, pairs) -> list:
        """Tied parameters (``Family.tied_weights``): one parameter when both layers are on this
        stage; across stages, a copy on each, made equal at start (broadcast from the first) and
        kept equal by summing their gradients before the optimizer step (DeepSpeed's
        ``ReduceTiedGrads`` reads ``get_tied_weights_and_groups``), the later copy marked
        ``ds_pipe_replicated`` so gradient norms count it once. Returns [(param, group)] of this rank."""
        import torch.distributed as dist
        mine = dict(self.plain_named_parameters())
        out = []
        for a, b in pairs:
            sa, sb = (self.stage_owner(self.layer_names.index(self._layer_of(n))) for n in (a, b))
            if sa == sb:
                if a in mine:
                    owner, last = plain_to_pipe(self, b)
                    setattr(owner, last, mine[a])
                continue
            for first, second in zip(stage_global_ranks(self, sa), stage_global_ranks(self, sb)):  # per replica
                ranks = sorted({first, second})
                group = dist.new_group(ranks=ranks)
                if dist.get_rank() not in ranks:  # (PipelineModule's global_rank)
                    continue
                p = mine[a] if a in mine else mine[b]
                dist.broadcast(p.data, src=first, group=group)
                if b in mine:
                    p.ds_pipe_replicated = True
                out.append((p, group))
        return out

    def _layer_of(self, plain_name: str) -> str:
        return max((n for n in self.layer_names if plain_name.startswith(n + ".")), key=len)

    def get_tied_weights_and_groups(self):
        return super().get_tied_weights_and_groups() + [(p, g) for p, g in self.mm_ties if p.requires_grad]

    def allreduce_tied_weight_gradients(self):
        import torch.distributed as dist
        super().allreduce_tied_weight_gradients()
        for p, g in self.mm_ties:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=g)

    def _partition_layers(self, method="uniform"):
        if len(self.mm_parts) != self.num_stages + 1 or self.mm_parts[-1] != pipe_layer_count(self):
            raise ValueError(f"parts {self.mm_parts} do not describe {self.num_stages} stages of "
                             f"{pipe_layer_count(self)} layers")
        set_stage_bounds(self, self.mm_parts)

    def plain_named_parameters(self):
        """This stage's parameters under the plain model's names (for groups and freezing); a
        tied parameter held twice on this stage once, under its first name."""
        seen = set()
        for layer in stage_layers(self):
            if isinstance(layer, PipeLayer):
                for k, p in layer.named_parameters():
                    if id(p) not in seen:
                        seen.add(id(p))
                        yield plain_state_key(layer.name, k), p

    def stage_layer_names(self) -> list[list[str]]:
        return stage_lists(self.layer_names, self.parts)


def plain_to_pipe(module: "MMPipelineModule", plain_name: str) -> tuple:
    """(owning submodule, attribute) of a plain parameter name on this stage."""
    layer = module._layer_of(plain_name)
    for f in stage_layers(module):
        if isinstance(f, PipeLayer) and f.name == layer:
            *path, last = plain_name[len(layer) + 1:].split(".")
            return f.part.get_submodule(".".join(path)), last
    raise KeyError(plain_name)


class LabelLoss:
    """DeepSpeed's ``loss_fn(outputs, labels)`` on the last stage: the family's loss."""

    def __init__(self, family):
        self.family = family

    def __call__(self, outputs, labels):
        return self.family.loss(outputs, *labels)
