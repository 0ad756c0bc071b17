"""The runtime seam: where DeepSpeed's engine is made (``initialize``, the one call of
``deepspeed.initialize``), the two step drivers (``PlainRunner``: P = 1, accumulation by calling ``step()``;
``PipelineRunner``), which run a step loss's two passes alike (``two_passes``), where a pipeline stage is given
the run's order (``install_schedule``: the
stage's stream from ``parallel.schedules``, installed as the engine's schedule, handed to the stage clock,
and the stage's executor told what the order implies; an order that splits the backward gets its two
instructions and the stage's linear layers their split backward, ``parallel.zero_bubble``), and the runner that
drives a pipeline's step (``PipelineRunner``: the stream's training part by ``train_batch``; a step loss's
features pass first by ``eval_batch``, which runs the same order)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist

from mmpipe.parallel.ds_compat import (
    eval_batch_in_train_mode,
    loss_per_buffer,
    one_backward,
    reset_total_loss,
    set_train_schedule,
    split_backward,
)
from mmpipe.parallel.executor import keyed_dropout
from mmpipe.parallel.layers import PipeLayer
from mmpipe.parallel.sample_rng import KEY_FIELDS
from mmpipe.parallel.schedules import forward_only
from mmpipe.parallel.stage_clock import StageClock
from mmpipe.parallel.step_loss import FirstPassMemo, StepLossCache, frozen_prefix
from mmpipe.parallel.zero_bubble import WeightGradStore, install


def initialize(**kwargs):
    """``deepspeed.initialize(**kwargs)``: (engine, optimizer, data loader, scheduler)."""
    import deepspeed
    return deepspeed.initialize(**kwargs)


def install_schedule(engine, plan, micro_batches: int, step_loss: bool) -> tuple:
    """Stage ``engine.stage_id``'s stream under ``plan.order`` (a step loss's features pass first, which
    DeepSpeed's ``eval_batch`` runs in the same order); its training part becomes
    the engine's schedule. The executor reads the stream: a stage that runs no backward leaves its outputs
    untied to its inputs (``executor.anchor``), a stage that receives activations but sends no gradient back
    (the first that trains after ``frozen_first``'s forward-only stages) takes its inputs as constants. An order
    that splits the backward (``B``, ``W``): the stage's trainable linear layers defer their weight gradients into
    a ``WeightGradStore`` and the engine learns the two instructions. Returns (the whole stream, the store or
    None)."""
    P, s = engine.num_stages, engine.stage_id
    train = plan.order.stream(P, micro_batches, s)
    set_train_schedule(engine, train)
    one_backward(engine)  # (before split_backward: a B pass walks its stage once too)
    loss_per_buffer(engine)
    store = None
    if any(a.kind == "BackwardWeightPass" for a in train):
        store = WeightGradStore()
        install(engine.module, store)
        split_backward(engine, store)
    whole = plan.order.stream(P, micro_batches, s, step_loss=step_loss)
    executor = engine.module.executor
    if forward_only(train):  # no gradient ever comes back: outputs need no tie to the inputs
        executor.anchor = False
    if any(a.kind == "RecvActivation" for a in train) and not any(a.kind == "SendGrad" for a in train):
        executor.detach = plan.layers[plan.parts[s]]  # received inputs whose gradient nobody takes
    return whole, store


class PipelineRunner:
    """P >= 2: DeepSpeed's pipeline engine runs the plan's schedule (``parallel.schedules``, installed by
    ``runtime.install_schedule``) over the accumulation steps."""

    def __init__(self, engine, topo, plan, stage_timing: bool = True):
        self.engine, self.topo = engine, topo
        self.stream, self.split = install_schedule(engine, plan, topo.accumulation_steps,
                                                   engine.module.family.step_loss)
        self.clock = None
        if stage_timing:  # (after the order's instructions: it times each of them)
            self.clock = StageClock(engine)
            self.clock.stream = self.stream
        self.cache = self.replay = self.memo = None
        family, run = engine.module.family, engine.module.executor  # how this stage's layers run
        self.keyed = keyed_dropout(engine.module, run, engine.grid.get_data_parallel_rank(), topo.accumulation_steps,
                                   everywhere=True)
        self.replay = run.replay
        if family.step_loss:  # every layer hands out features; the last stage's loss is the surrogate
            run.features = True
            names = [m.name for m in engine.module.modules() if isinstance(m, PipeLayer)]
            prefix = frozen_prefix(names, run.forward_only)
            if prefix and engine.is_first_stage():  # a frozen prefix runs once per step (FirstPassMemo)
                self.memo = run.memo = FirstPassMemo(prefix)
            if engine.is_last_stage():
                last = next(m for m in engine.module.modules() if isinstance(m, PipeLayer) and m.name == run.last)
                self.cache = StepLossCache(family, last.part, topo.accumulation_steps, topo.data_parallel,
                                           engine.grid.get_data_parallel_rank(),
                                           engine.grid.get_data_parallel_group())
                run.surrogate = self.cache.surrogate

    def train_step(self, data_iter, step: int = 0, trace: bool = False) -> torch.Tensor:
        if self.clock is not None:
            self.clock.begin_step(step, trace)
        if self.engine.module.family.step_loss:
            loss = self._step_loss_step(data_iter, step)
        else:
            if self.replay is not None:
                self.replay.start(step)
            with self._split_step():
                loss = self.engine.train_batch(data_iter).detach()
        if self.clock is not None:
            self.timings = self.clock.end_step()
        return loss

    def _step_loss_step(self, data_iter, step: int) -> torch.Tensor:
        """Pass 1: the step's micro-batches forward-only through every stage (DeepSpeed's inference
        schedule, training mode) for the last layer's features; the last stage's batch loss; pass 2:
        the run's order over the same micro-batches, the last stage backpropagating surrogates."""
        engine = self.engine
        batches = ([next(data_iter) for _ in range(self.topo.accumulation_steps)] if data_iter is not None
                   else None)
        reset_total_loss(engine)

        def features():
            with eval_batch_in_train_mode(engine), _monitors_off(engine):
                out = engine.eval_batch(iter(batches) if batches is not None else None, compute_loss=False,
                                        reduce_output=None, bcast_loss=False,
                                        num_micro_batches=self.topo.accumulation_steps)
            return list(out) if out is not None else None  # (the last stage's features; None elsewhere)

        def train():
            with self._split_step():
                return engine.train_batch(iter(batches) if batches is not None else None).detach()

        return two_passes(self.replay, self.memo, self.cache, step, features, train)

    def _split_step(self):
        """A training pass of a split-backward order: the linear layers defer their weight gradients (for the whole
        pass: a checkpointed layer recomputes its forward inside ``B``)."""
        return self.split.step() if self.split is not None else contextlib.nullcontext()

    def eval_outputs(self, batches, n_micro: int) -> Optional[list]:
        reset_total_loss(self.engine)
        module = self.engine.module
        stats = module.family.eval_stats
        loss_fn = module.loss_fn
        if stats is not None:  # the last stage reduces each micro-batch against its labels
            module.loss_fn = lambda outputs, labels: stats(outputs, *labels)
        try:
            with _monitors_off(self.engine):
                out = self.engine.eval_batch(iter(batches) if batches is not None else None,
                                             compute_loss=stats is not None, reduce_output=None, bcast_loss=False,
                                             num_micro_batches=n_micro)
        finally:
            module.loss_fn = loss_fn
        if not self.engine.is_last_stage():
            return None
        return list(out)


def two_passes(replay, memo, cache, step: int, features, train):
    """A step loss's two passes, for every runner: each micro-batch's features without autograd (``features()``;
    the same dropout as the training pass, ``replay``; a frozen prefix recorded, ``memo``), the batch loss over all
    of them (``cache.fill``, where this rank computes it), then ``train()`` with the frozen prefix's outputs taken
    from the first pass; returns what ``train`` returns."""
    if replay is not None:
        replay.start(step)
    if memo is not None:
        memo.start(recording=True)
    out = features()
    if cache is not None:
        cache.fill(out)
    if replay is not None:
        replay.start(step)
    if memo is not None:
        memo.start(recording=False)
    try:
        return train()
    finally:
        if memo is not None:
            memo.clear()


@contextlib.contextmanager
def _monitors_off(engine):
    """DeepSpeed's monitors (tensorboard/csv blocks) make ``eval_batch`` log a mean eval loss from
    rank 0, which may hold no outputs (and fails on them): mmpipe logs its own metrics."""
    monitor = getattr(engine, "monitor", None)
    enabled = monitor.enabled if monitor is not None else False
    try:
        if monitor is not None:
            monitor.enabled = False
        yield
    finally:
        if monitor is not None:
            monitor.enabled = enabled


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

        def features():
            with torch.no_grad():
                return [self.engine(*self._to_device(inputs)) for inputs in batches]

        def train():
            for inputs in batches:
                self.engine.backward(cache.surrogate(self.engine(*self._to_device(inputs))))
                self.engine.step()
            return cache.loss

        try:
            return two_passes(run.replay, run.memo, cache, step, features, train)
        finally:
            run.features = False

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
