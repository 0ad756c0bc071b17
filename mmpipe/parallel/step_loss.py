"""A loss over the whole step (``Family.step_loss``: CLIP's contrastive loss over the global batch),
run by both strategies as a feature cache (GradCache; open_clip's ``--accum-freq``):

1. a forward-only pass over the step's micro-batches, in training mode, gives the last layer's
   features (its ``eval_step`` output, one row per sample); layers with dropout reseed per
   (step, micro-batch, layer) in both passes, so the second pass replays the first's random numbers;
2. the last stage all-gathers them over its data-parallel group and computes the loss of the whole
   batch once (``Family.batch_loss``): the number reported;
3. from the same batch loss, its gradient with respect to every feature (one backward through the
   B x B loss, as GradCache does);
4. the ordinary pass (1F1B in a pipeline, one micro-batch at a time at P = 1) recomputes each
   micro-batch's features with autograd and backpropagates a surrogate: n <features, their cached
   gradient>, n = A x D (DeepSpeed divides each micro-batch's loss by the A accumulation steps and
   averages over the D data-parallel ranks), plus, on each rank's first micro-batch only, A <p, dL/dp>
   for the loss module's own parameters p (``logit_scale``; dL/dp from step 3), so that they get the
   batch loss's gradient exactly once. The surrogate's value is the batch loss. The B x B loss is
   thus computed once a step (its value and every gradient in one backward), not once per
   micro-batch, and nothing of it is kept past ``fill`` (its transient: ``planning.memory``).

Cost: one extra forward of every stage, the features of the global batch on the last stage, and
one all-gather of them; activations are held for one micro-batch at a time, as without it. A frozen
prefix (the leading layers that run without autograd: a locked image tower) is not run twice: the
first pass records its last layer's output per micro-batch and the second takes it
(``FirstPassMemo``), so lock-image tuning pays its frozen tower's forward once per step.
"""
from __future__ import annotations

import contextlib
import hashlib

import torch
import torch.distributed as dist
from torch import nn

from mmpipe.parallel.ds_compat import is_zero3_param
from mmpipe.parallel.sample_rng import KeyedDropout, mix


class StepLossCache:
    """The last stage's cache of one step's features and the surrogate of each micro-batch.

    With D > 1 data-parallel ranks and a family whose loss splits into rows (``Family.local_step_loss``),
    rank r computes only its own samples' share of the loss (its rows of the global batch against all of
    it: rows x B pairs, not B x B) and that share's gradient for every feature and loss parameter; a
    reduce-scatter sums the feature gradients across ranks and hands each rank its own rows; the
    parameters' shares are summed by DeepSpeed's gradient all-reduce (each rank backpropagates
    <p, D x share>); the value reported is the shares' all-reduced sum: the global loss."""

    def __init__(self, family, loss_module: nn.Module, accumulation: int, data_parallel: int, dp_rank: int,
                 group=None):
        self.family, self.module = family, loss_module
        self.A, self.D, self.dp_rank, self.group = accumulation, data_parallel, dp_rank, group
        self.local = data_parallel > 1 and bool(family.local_step_loss)
        self.features = self.loss = self.cols = None
        self.rows = self.k = 0

    def own_rows(self, total: int) -> tuple:
        """This rank's rows of the gathered batch (its micro-batches, in order)."""
        n = total // self.D
        return self.dp_rank * n, (self.dp_rank + 1) * n

    def fill(self, outputs: list) -> None:
        """This rank's last-layer outputs of the step (one per micro-batch, in order), gathered over
        the data-parallel group; the loss of the whole batch and its gradient for every feature (or,
        ``local``, this rank's share of it and the summed gradient of its own features)."""
        local = torch.cat([o.detach().float() for o in outputs])
        self.rows = outputs[0].shape[0]
        if self.D > 1:
            parts = [torch.empty_like(local) for _ in range(self.D)]
            dist.all_gather(parts, local, group=self.group)
            local = torch.cat(parts)
            del parts
        self.features = local
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        gather = contextlib.nullcontext()
        if any(is_zero3_param(p) for p in self.module.parameters()):  # ZeRO-3 partitions them: whole for the loss
            import deepspeed                                          # (computed in blocks, not through forward)
            gather = deepspeed.zero.GatheredParameters(list(self.module.parameters()))
        with gather:
            if self.local:
                loss, grad, param_grads = self.family.batch_loss_grads(
                    self.module, local, self.params, rows=self.own_rows(local.shape[0]), combine=self._combine)
            else:
                loss, grad, param_grads = self.family.batch_loss_grads(self.module, local, self.params)
        self.param_grads = [torch.zeros_like(p, dtype=torch.float32) if g is None else g.detach().float()
                            for p, g in zip(self.params, param_grads)]
        loss = loss.detach().float()
        if self.local:  # the shares of every rank: summed, each rank keeping its own rows' gradient
            mine = torch.empty_like(grad[:grad.shape[0] // self.D])
            dist.reduce_scatter(mine, list(grad.contiguous().chunk(self.D)), group=self.group)
            grad = mine
            loss = loss.reshape(1)
            dist.all_reduce(loss, group=self.group)
            loss = loss[0]
        self.grad, self.loss = grad, loss
        self.k = 0

    def _combine(self, partial: torch.Tensor) -> torch.Tensor:
        """The softmax columns' log-sum-exp over every rank's rows from this rank's own: B numbers
        gathered, reduced in rank order (the same on every rank)."""
        parts = [torch.empty_like(partial) for _ in range(self.D)]
        dist.all_gather(parts, partial.contiguous(), group=self.group)
        self.cols = torch.logsumexp(torch.stack(parts), dim=0)
        return self.cols

    def surrogate(self, outputs: torch.Tensor) -> torch.Tensor:
        """The loss to backpropagate for the next micro-batch (forward order) from its live features:
        n <live, cached gradient> (n = A x D), plus, on the rank's first micro-batch, A <p, dL/dp> for
        the loss module's own parameters (``local``: A x D <p, this rank's share>, summed by the
        data-parallel all-reduce); its value is L."""
        start = ((0 if self.local else self.dp_rank * self.A) + self.k) * self.rows
        first = self.k == 0
        self.k += 1
        s = self.A * self.D * (outputs.float() * self.grad[start:start + self.rows]).sum()
        n = self.A * (self.D if self.local else 1)
        if first and self.params and not any(is_zero3_param(p) for p in self.params):
            # A dL/dp through <p, A dL/dp>: no B x B graph kept until this micro-batch's backward
            s = s + n * sum((p.float() * g).sum() for p, g in zip(self.params, self.param_grads))
        elif first and self.params:  # ZeRO-3 partitions p: the loss module's forward gathers it
            rows = self.own_rows(self.features.shape[0]) if self.local else None
            s = s + n * self.family.batch_loss(self.module, self.features, rows=rows, cols=self.cols)
        return s + (self.loss - s).detach()


class FirstPassMemo:
    """The outputs of a frozen prefix from a step's forward-only pass, for the pass that trains.

    ``names``: the leading layers of the model (of the first stage, in a pipeline) that run without
    autograd (``forward_only``: frozen, nothing trainable upstream). They compute the same outputs in
    both passes of a step (no weight changes between the passes, dropout replayed), so the first pass
    records the last one's output per micro-batch and the second pass skips them all and takes the
    record: what the first stage holds meanwhile is one boundary output per micro-batch."""

    def __init__(self, names: list):
        self.names, self.last = tuple(names), names[-1]
        self.recording, self.k, self.outputs = True, 0, []

    def start(self, recording: bool) -> None:
        """Begin a pass: the forward-only one records, the training one replays."""
        self.recording, self.k = recording, 0
        if recording:
            self.outputs = []

    def record(self, out) -> None:
        self.outputs.append(out)

    def clear(self) -> None:
        """After the training pass: the record is not kept through evaluation and checkpoints."""
        self.outputs = []

    def take(self):
        """The recorded output of the next micro-batch (forward order)."""
        if self.k >= len(self.outputs):
            raise RuntimeError(f"FirstPassMemo: micro-batch {self.k} of the training pass was not recorded by the "
                               f"forward-only pass ({len(self.outputs)} were)")
        out = self.outputs[self.k]
        self.k += 1
        return out


def frozen_prefix(names: list, forward_only) -> list:
    """The leading layers of ``names`` that run without autograd (``forward_only``)."""
    out = []
    for name in names:
        if name not in forward_only:
            break
        out.append(name)
    return out


def is_stochastic(module: nn.Module) -> bool:
    """Whether training-mode forwards draw random numbers (dropout modules, attention dropout)."""
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        for attr in ("dropout", "attention_dropout"):
            v = getattr(m, attr, None)
            if isinstance(v, float) and v > 0:
                return True
    return False


@contextlib.contextmanager
def replayed_rng(seed: int, step: int, name: str, micro_batch: int):
    """Random numbers of one layer's forward for one micro-batch, the same in every pass of the step."""
    key = hashlib.sha256(f"{seed}/{step}/{name}/{micro_batch}".encode()).digest()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(int.from_bytes(key[:8], "little") & ((1 << 63) - 1))
        yield


class Replay:
    """Per-layer counters of forwards within one pass; ``start(step)`` begins a pass. A keyed run's
    dropout is drawn per sample (``keyed``); what cannot be keyed draws from the micro-batch's slot."""

    def __init__(self, seed: int, offset: int = 0):
        """``offset``: the step's index of this rank's first micro-batch (data-parallel rank x
        accumulation), so a micro-batch draws the same numbers whichever rank runs it."""
        self.seed, self.step, self.calls, self.offset = seed, 0, {}, offset

    def start(self, step: int) -> None:
        self.step, self.calls = step, {}

    def rng(self, name: str):
        k = self.calls.get(name, 0)
        self.calls[name] = k + 1
        return replayed_rng(self.seed, self.step, name, k + self.offset)

    def keyed(self, step, name: str, layout, axis: str):
        """``step`` drawing its dropout per sample (``sample_rng.KeyedDropout``) from (seed, step, layer):
        the mode is entered inside the call, so an activation checkpoint's recompute draws alike."""
        base = mix(self.seed, self.step, int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little"))

        def run(module, acts):
            with KeyedDropout(base, layout, axis, name):
                return step(module, acts)
        return run
