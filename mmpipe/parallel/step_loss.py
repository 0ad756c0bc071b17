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
    """The last stage's cache of one step's features and the surrogate of each micro-batch."""

    def __init__(self, family, loss_module: nn.Module, accumulation: int, data_parallel: int, dp_rank: int,
                 group=None):
        self.family, self.module = family, loss_module
        self.A, self.D, self.dp_rank, self.group = accumulation, data_parallel, dp_rank, group
        self.features = self.loss = None
        self.rows = self.k = 0

    def fill(self, outputs: list) -> None:
        """This rank's last-layer outputs of the step (one per micro-batch, in order), gathered over
        the data-parallel group; the loss of the whole batch and its gradient for every feature."""
        local = torch.cat([o.detach().float() for o in outputs])
        self.rows = outputs[0].shape[0]
        if self.D > 1:
            parts = [torch.empty_like(local) for _ in range(self.D)]
            dist.all_gather(parts, local, group=self.group)
            local = torch.cat(parts)
        self.features = local
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        gather = contextlib.nullcontext()
        if any(is_zero3_param(p) for p in self.module.parameters()):  # ZeRO-3 partitions them: whole for the loss
            import deepspeed                                          # (computed in blocks, not through forward)
            gather = deepspeed.zero.GatheredParameters(list(self.module.parameters()))
        with gather:
            loss, self.grad, param_grads = self.family.batch_loss_grads(self.module, local, self.params)
        self.param_grads = [torch.zeros_like(p, dtype=torch.float32) if g is None else g.detach().float()
                            for p, g in zip(self.params, param_grads)]
        self.loss = loss.detach().float()
        self.k = 0

    def surrogate(self, outputs: torch.Tensor) -> torch.Tensor:
        """The loss to backpropagate for the next micro-batch (forward order) from its live features:
        n <live, cached gradient> (n = A x D), plus A L(cached features) on the rank's first
        micro-batch, for the loss module's own parameters; its value is L."""
        start = (self.dp_rank * self.A + self.k) * self.rows
        first = self.k == 0
        self.k += 1
        s = self.A * self.D * (outputs.float() * self.grad[start:start + self.rows]).sum()
        if first and self.params and not any(is_zero3_param(p) for p in self.params):
            # A dL/dp through <p, A dL/dp>: no B x B graph kept until this micro-batch's backward
            s = s + self.A * sum((p.float() * g).sum() for p, g in zip(self.params, self.param_grads))
        elif first and self.params:  # ZeRO-3 partitions p: the loss module's forward gathers it
            s = s + self.A * self.family.batch_loss(self.module, self.features)
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
