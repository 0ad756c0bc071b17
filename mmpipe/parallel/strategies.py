"""Parallel strategies, applied to a family's layers from outside the model.

- ``DataParallel`` (P = 1; ZeRO 0-3): the plain model composed of the family's layers under
  DeepSpeed's engine; accumulation by calling ``step()`` once per micro-batch.
- ``Pipeline`` (P >= 2, x data parallel; ZeRO 0-1): the same layers as a DeepSpeed
  ``PipelineModule`` cut at the plan's boundaries; DeepSpeed's 1F1B schedule runs the step.

Both build their module from a ``Family`` and a ``Plan``, and give the trainer a runner with one
interface: ``train_step(data_iter, step, trace) -> loss`` and ``eval_outputs(batches, n)`` (the
last layer's eval-mode outputs per micro-batch on the rank that holds them, else None). Batches
are ``(inputs, labels)`` tuples: the family's first-stage fields and its last-stage fields.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from mmpipe.parallel.ds_compat import (
    check_version,
    fix_recv_buffer_dtype,
    reset_total_loss,
)
from mmpipe.parallel.module import MMPipelineModule
from mmpipe.parallel.stage_clock import StageClock

LABEL_PLACEHOLDER = torch.zeros(1)  # DeepSpeed's last stage reads "labels"; a family without labels gets this


class DataParallel:
    """P = 1: one process or data parallel, ZeRO 0-3."""

    def __init__(self, family, plan, topo, forward_only: frozenset = frozenset()):
        self.family, self.plan, self.topo, self.forward_only = family, plan, topo, forward_only

    def build_module(self, **_):
        return self.family.plain_model(self.forward_only)

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
        return PipelineRunner(engine, self.topo, stage_timing)


def strategy_for(topo):
    return Pipeline if topo.pipeline_stages > 1 else DataParallel


class PlainRunner:
    """P = 1: the plain model under DeepSpeed's engine; accumulation done by calling step()."""

    clock = None

    def __init__(self, engine, topo):
        self.engine, self.topo = engine, topo

    def _to_device(self, tensors):
        return tuple(t.to(self.engine.device, non_blocking=True) for t in tensors)

    def train_step(self, data_iter, step: int = 0, trace: bool = False) -> float:
        losses = []
        for _ in range(self.topo.accumulation_steps):
            inputs, labels = next(data_iter)
            labels = labels if isinstance(labels, tuple) else ()
            loss = self.engine(*self._to_device(inputs + labels))
            self.engine.backward(loss)
            self.engine.step()
            losses.append(loss.detach().float())
        mean = torch.stack(losses).mean()
        if self.topo.data_parallel > 1:
            dist.all_reduce(mean)
            mean /= self.topo.data_parallel
        return float(mean)

    @torch.no_grad()
    def eval_outputs(self, batches, n_micro: int) -> Optional[list]:
        module = self.engine.module
        stats = module.family.eval_stats
        module.eval()
        out = []
        for inputs, labels in batches:
            o = module.eval_outputs(*self._to_device(inputs))
            out.append(stats(o, *self._to_device(labels)) if stats is not None else o)
        module.train()
        return out


class PipelineRunner:
    """P >= 2: DeepSpeed's pipeline engine runs the 1F1B schedule over the accumulation steps."""

    def __init__(self, engine, topo, stage_timing: bool = True):
        self.engine, self.topo = engine, topo
        self.clock = None
        if stage_timing:
            self.clock = StageClock(engine)

    def train_step(self, data_iter, step: int = 0, trace: bool = False) -> float:
        if self.clock is None:
            return float(self.engine.train_batch(data_iter))
        self.clock.begin_step(step, trace)
        loss = float(self.engine.train_batch(data_iter))
        self.timings = self.clock.end_step()
        return loss

    def eval_outputs(self, batches, n_micro: int) -> Optional[list]:
        reset_total_loss(self.engine)
        module = self.engine.module
        stats = module.family.eval_stats
        loss_fn = module.loss_fn
        if stats is not None:  # the last stage reduces each micro-batch against its labels
            module.loss_fn = lambda outputs, labels: stats(outputs, *labels)
        # DeepSpeed's monitors (tensorboard/csv blocks) make eval_batch log a mean eval loss from rank
        # 0, which has no outputs here (and fails on them): mmpipe logs its own eval metrics
        monitor = getattr(self.engine, "monitor", None)
        enabled = monitor.enabled if monitor is not None else False
        try:
            if monitor is not None:
                monitor.enabled = False
            out = self.engine.eval_batch(iter(batches) if batches is not None else None,
                                         compute_loss=stats is not None, reduce_output=None, bcast_loss=False,
                                         num_micro_batches=n_micro)
        finally:
            module.loss_fn = loss_fn
            if monitor is not None:
                monitor.enabled = enabled
        if not self.engine.is_last_stage():
            return None
        return list(out)
