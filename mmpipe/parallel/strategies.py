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

from typing import Optional

import torch
import torch.distributed as dist

from mmpipe.parallel.ds_compat import check_version, fix_recv_buffer_dtype
from mmpipe.parallel.module import MMPipelineModule
from mmpipe.parallel.plain import plain_model
from mmpipe.parallel.runtime import PipelineRunner, keyed_dropout
from mmpipe.parallel.sample_rng import KEY_FIELDS
from mmpipe.parallel.step_loss import FirstPassMemo, StepLossCache, frozen_prefix

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


class PlainRunner:
    """P = 1: the plain model under DeepSpeed's engine; accumulation done by calling step()."""

    clock = None

    def __init__(self, engine, topo):
        self.engine, self.topo = engine, topo
        module, A, D = engine.module, topo.accumulation_steps, topo.data_parallel
        self.cache = None  # a step loss over more than one micro-batch: the feature cache
        run = module.executor  # how every layer runs (parallel.executor)
        self.keyed = keyed_dropout(module, run, dist.get_rank() if D > 1 else 0, A, everywhere=False)
        if module.family.step_loss and A * D > 1:
            loss_module = module.get_submodule(module.family.layer_names()[-1])
            self.cache = StepLossCache(module.family, loss_module, A, D, dist.get_rank() if D > 1 else 0)
            prefix = frozen_prefix(module.family.layer_names(), run.forward_only)
            if prefix and A > 1 and engine.zero_optimization_stage() < 3:  # ZeRO-3 traces the modules' order
                run.memo = FirstPassMemo(prefix)

    def _to_device(self, tensors):
        """The fields on the engine's device; the sample keys stay on the host, where dropout reads them."""
        n = len(self.engine.module.family.inputs)
        keys = range(n, n + len(KEY_FIELDS)) if self.keyed else ()
        return tuple(t if i in keys else t.to(self.engine.device, non_blocking=True) for i, t in enumerate(tensors))

    def _step_loss_step(self, data_iter, step: int) -> torch.Tensor:
        """The step's micro-batches forward-only for their features, the batch loss, then each
        micro-batch trained on its surrogate (``mmpipe.parallel.step_loss``). With one micro-batch
        per rank, no pass is repeated: its features, with autograd, are gathered (detached) and its
        surrogate backpropagated."""
        run, cache = self.engine.module.executor, self.cache
        batches = [next(data_iter)[0] for _ in range(self.topo.accumulation_steps)]
        run.features = True
        if len(batches) == 1:  # data parallel, one micro-batch per rank: one pass, as open_clip's
            try:  # the live features give the step's loss and the gathered features their negatives
                if run.replay is not None:
                    run.replay.start(step)
                out = self.engine(*self._to_device(batches[0]))
                cache.fill([out])
                self.engine.backward(cache.surrogate(out))
                self.engine.step()
            finally:
                run.features = False
            return cache.loss
        try:
            if run.replay is not None:
                run.replay.start(step)
            if run.memo is not None:
                run.memo.start(recording=True)
            with torch.no_grad():
                cache.fill([self.engine(*self._to_device(inputs)) for inputs in batches])
            if run.replay is not None:
                run.replay.start(step)
            if run.memo is not None:
                run.memo.start(recording=False)
            for inputs in batches:
                self.engine.backward(cache.surrogate(self.engine(*self._to_device(inputs))))
                self.engine.step()
        finally:
            run.features = False
            if run.memo is not None:
                run.memo.clear()
        return cache.loss

    def train_step(self, data_iter, step: int = 0, trace: bool = False) -> torch.Tensor:
        if self.cache is not None:
            return self._step_loss_step(data_iter, step)
        if self.engine.module.executor.replay is not None:
            self.engine.module.executor.replay.start(step)
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
        return mean

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
