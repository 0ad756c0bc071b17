"""Parallel strategies, applied to a family's layers from outside the model.

- ``DataParallel`` (P = 1; ZeRO 0-3): the plain model composed of the family's layers under
  DeepSpeed's engine; accumulation by calling ``step()`` once per micro-batch.
- ``Pipeline`` (P >= 2, x data parallel; ZeRO 0-1): the same layers as a DeepSpeed
  ``PipelineModule`` cut at the plan's boundaries; the plan's schedule (1F1B by default) runs the step
  (``runtime.PipelineRunner``).

Both build their module from a ``Family`` and a ``Plan``, and give the trainer a runner with one
interface: ``train_step(data_iter, step, trace) -> loss`` (a 0-dim tensor on the device: the trainer reads it
with the step's one gather, no host read of its own) and ``eval_outputs(batches, n)`` (the
last layer's eval-mode outputs per micro-batch on the rank that holds them, else None). Batches
are ``(inputs, labels)`` tuples: the family's first-stage fields and its last-stage fields.
"""
from __future__ import annotations


import torch

from mmpipe.parallel.ds_compat import check_version, fix_recv_buffer_dtype
from mmpipe.parallel.module import MMPipelineModule
from mmpipe.parallel.plain import plain_model
from mmpipe.parallel.runtime import PipelineRunner, PlainRunner

LABEL_PLACEHOLDER = torch.zeros(1)  # DeepSpeed's last stage reads "labels"; a family without labels gets this


class DataParallel:
    """P = 1: one process or data parallel, ZeRO 0-3."""

    def __init__(self, family, plan, topo, forward_only: frozenset = frozenset()):
        self.family, self.plan, self.topo, self.forward_only = family, plan, topo, forward_only

    def build_module(self, **_):
        return plain_model(self.family, self.forward_only)

    @staticmethod
    def named_parameters(module):
        return module.named_parameters()

    def runner(self, engine, stage_timing: bool = True) -> "PlainRunner":
        return PlainRunner(engine, self.topo)


class Pipeline:
    """P >= 2: DeepSpeed's pipeline engine over the family's layers at the plan's boundaries."""

    def __init__(self, family, plan, topo, forward_only: frozenset = frozenset()):
        self.family, self.plan, self.topo, self.forward_only = family, plan, topo, forward_only

    def build_module(self, dynamic_shape: bool = False):
        # captions padded per micro-batch change the activations' shapes: the engine then sends tensor
        # shapes with every activation (DeepSpeed's dynamic_shape)
        return MMPipelineModule(self.family, self.topo.pipeline_stages, self.plan.parts,
                                forward_only=self.forward_only, dynamic_shape=dynamic_shape)

    @staticmethod
    def named_parameters(module):
        return module.plain_named_parameters()

    def runner(self, engine, stage_timing: bool = True) -> "PipelineRunner":
        check_version()
        fix_recv_buffer_dtype(engine)
        return PipelineRunner(engine, self.topo, self.plan, stage_timing)


def strategy_for(topo):
    return Pipeline if topo.pipeline_stages > 1 else DataParallel
