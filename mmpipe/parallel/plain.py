"""The single-process model: a family's layers under their plain names, run by the same
``LayerExecutor`` as the pipeline layers (P = 1 under DeepSpeed's engine, the profiler's reference,
``mmpipe.build_model``)."""
from __future__ import annotations

from torch import nn

from mmpipe.parallel.executor import LayerExecutor
from mmpipe.parallel.sample_rng import KEY_FIELDS


class PlainModel(nn.Module):
    """The family's layers under their plain names: ``forward(*inputs, *labels)`` is the scalar loss
    (in either mode), ``eval_outputs(*inputs)`` what the family's evaluator scores; by the same
    layer steps the pipeline runs. Parameters the family ties (``tied_weights``) are one, as in
    transformers. A family's ``plain_api`` (a mixin: CLIP's ``encode_image`` / ``encode_text``) is
    mixed in by ``plain_model``."""

    def __init__(self, family, forward_only: frozenset = frozenset()):
        super().__init__()
        self.family = family
        self._layers = family.layers()
        for layer in self._layers:
            attach(self, layer.name, family.build_layer(layer.name))
        for a, b in family.tied_weights():
            *path, last = b.split(".")
            setattr(self.get_submodule(".".join(path)), last, self.get_parameter(a))
        self._module_of = {layer.name: self.get_submodule(layer.name) for layer in self._layers}  # looked up once
        self.executor = LayerExecutor(forward_only, last=self._layers[-1].name)

    @property
    def forward_only(self) -> frozenset:
        """Layers that run without autograd (frozen, nothing trainable upstream)."""
        return self.executor.forward_only

    def run_layers(self, acts: tuple, layers=None, evaluating: bool = False) -> tuple:
        for layer in layers or self._layers:
            acts = self.executor.run(layer, self._module_of[layer.name], acts, self.training, evaluating)
        return acts

    def _n_inputs(self) -> int:
        """The family's first-stage fields, and the sample keys after them in a keyed run (``sample_rng``)."""
        return len(self.family.inputs) + (len(KEY_FIELDS) if self.executor.keyed else 0)

    def forward(self, *fields):
        n = self._n_inputs()
        out = self.run_layers(tuple(fields[:n]))
        if self.family.labels and not self.executor.features:
            return self.family.loss(out, *fields[n:])
        return out

    def eval_outputs(self, *inputs):
        return self.run_layers(tuple(inputs[:self._n_inputs()]), evaluating=True)


_WITH_API: dict = {}


def plain_model(family, forward_only: frozenset = frozenset()) -> PlainModel:
    """The family's single-process model (its ``plain_api`` mixed in, when it has one)."""
    api = family.plain_api
    if api is None:
        return PlainModel(family, forward_only)
    if api not in _WITH_API:
        _WITH_API[api] = type(api.__name__, (api, PlainModel), {"__module__": api.__module__,
                                                               "__doc__": api.__doc__})
    return _WITH_API[api](family, forward_only)


def attach(root: nn.Module, dotted: str, module: nn.Module) -> None:
    """Register ``module`` under the dotted name, creating plain containers on the way."""
    *path, last = dotted.split(".")
    node = root
    for part in path:
        if part not in node._modules:
            node.add_module(part, nn.Module())
        node = node._modules[part]
    node.add_module(last, module)
