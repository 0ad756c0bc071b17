"""A family's layers as DeepSpeed pipeline layers, with one activation contract: a tuple of
tensors (floating-point first, integer last; see the family's model module for its tuples).

Each ``PipeLayer`` holds exactly one layer of the plain model (``Family.layers()``), so its state
dict is that layer's under ``part.`` and checkpoints map back to the plain model's names without a
table of special cases.
"""
from __future__ import annotations

from torch import nn

from mmpipe.parallel.executor import LayerExecutor


class PipeLayer(nn.Module):
    """One part of the plain model, adapted to the tuple contract. Built per stage via LayerSpec;
    how it runs (forward-only, checkpointing, replay, memo, features, surrogate) is its
    ``executor``'s decision, shared by the stage's layers (``parallel.executor``)."""

    def __init__(self, family, name: str, forward_only: bool = False, executor: LayerExecutor = None):
        super().__init__()
        self.name = name
        self.part = family.build_layer(name)
        self.layer = family.layer(name)
        self.executor = executor or LayerExecutor(frozenset({name}) if forward_only else frozenset(),
                                                  last=family.layer_names()[-1], anchor=True)

    @property
    def forward_only(self) -> bool:
        """Frozen, and nothing upstream in its branch trains: runs without autograd."""
        return self.name in self.executor.forward_only

    def forward(self, acts):
        return self.executor.run(self.layer, self.part, acts, self.training, evaluating=not self.training)

    def extra_repr(self) -> str:
        return self.name


def set_activation_checkpointing(module: nn.Module, on: bool = True) -> int:
    """Turn activation checkpointing on for every layer of a pipeline module or plain model that
    trains (forward-only layers never); returns how many layers it applies to."""
    layers = [m for m in module.modules() if isinstance(m, PipeLayer)]
    if layers:
        for layer in layers:
            layer.executor.checkpointing = on
        return sum(not la.forward_only for la in layers)
    module.executor.checkpointing = on  # a plain model (parallel.plain.PlainModel)
    return module.executor.trained(module.family.layer_names())


def plain_state_key(layer_name: str, key: str) -> str:
    """PipeLayer state-dict key -> the plain model's state-dict key (part name is the prefix)."""
    if not key.startswith("part."):
        raise KeyError(f"unexpected pipeline layer key {key!r} in {layer_name}")
    return f"{layer_name}.{key[len('part.'):]}"


def run_sequential(layers, acts):
    """Apply pipeline layers in one process (used by tests and the profiler)."""
    for layer in layers:
        acts = layer(acts)
    return acts
