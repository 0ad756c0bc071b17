"""Grouped gradient clipping that is exact across pipeline stages and data-parallel / ZeRO partitions.

Clipping contract: DeepSpeed's ``gradient_clipping`` is always 0 in the resolved config (see
``config.deepspeed``). ``GradClipper`` hooks the innermost torch optimizer (``register_step_pre_hook``),
where DeepSpeed has already reduced, accumulated and unscaled the gradients: with fp32 ZeRO-0
those are the model's own parameters, replicated over data-parallel ranks; with ZeRO-1 and with
bf16 they are flat fp32 partitions spread over the data-parallel ranks, one per torch param group
(the groups keep their ``name`` key). The hook sums squares per named group, all-reduces one small
vector over exactly the ranks that hold distinct pieces (the pipeline stages, plus the
data-parallel ranks when partitioned), clips each group to its own ``max_grad_norm`` (the same
arithmetic as ``torch.nn.utils.clip_grad_norm_``), then applies the optional global
``optim.max_grad_norm`` to the result, and scales the gradients once before the update. An fp16
overflow step never reaches the inner optimizer: it is skipped, not clipped."""
from __future__ import annotations

import math
import time
from typing import Optional

import torch
import torch.distributed as dist

from mmpipe.config.groups import Group
from mmpipe.parallel.ds_compat import (
    dynamic_loss_scale,
    expert_parallel_group,
    group_name,
    is_zero_optimizer,
    wrap_zero_step,
    zero_group_grads,
)


# --------------------------------------------------------------------------------------------
# clipping
# --------------------------------------------------------------------------------------------
def innermost_optimizer(opt):
    while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return opt


def _test_inject_nan(named_grads, step: int) -> None:
    """Test hook: ``MMPIPE_TEST_NAN_GRAD=STEP:RANK`` (``STEP-:RANK``: that step and every later one)
    puts a NaN into one gradient of that rank before the norms are taken."""
    import os
    spec = os.environ.get("MMPIPE_TEST_NAN_GRAD")
    if not spec:
        return
    at, rank = spec.split(":")
    me = dist.get_rank() if dist.is_initialized() else 0
    hit = step >= int(at[:-1]) if at.endswith("-") else step == int(at)
    if hit and me == int(rank):
        for _, gs, *_ in named_grads:
            if gs:
                gs[0].view(-1)[0] = float("nan")
                return


def clip_coef(norm: float, limit: Optional[float]) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s coefficient: min(1, limit / (norm + 1e-6))."""
    if limit is None or not math.isfinite(limit) or not math.isfinite(norm):
        return 1.0
    return min(1.0, limit / (norm + 1e-6))


def sum_of_squares(grads) -> torch.Tensor:
    """Sum of the squared elements of ``grads`` as a float64 scalar tensor on their device (no host
    read: the caller reads every group's at once), with norms taken in fp32 whatever the gradients'
    dtype: a loss-scaled fp16 ZeRO partition's norm can pass fp16's 65504 with every element finite."""
    return torch.stack(torch._foreach_norm(list(grads), 2.0, dtype=torch.float32)).double().pow(2).sum()


class GradClipper:
    """Per-group and global gradient norms at the optimizer step, clipped to the configured limits.

    Where the hook sits depends on how DeepSpeed wrapped the optimizer:
    - client optimizer (fp32, ZeRO-0), ``FP16_Optimizer``, ``BF16_Optimizer``: they call the inner
      torch optimizer's ``step()`` once with every group's (unscaled) gradient in place, so a
      step pre-hook on the inner optimizer sees them all;
    - ``DeepSpeedZeroOptimizer`` (ZeRO-1/2 without bf16) steps the inner optimizer once *per group*
      and builds each group's gradient just before it, so mmpipe wraps its ``step()`` instead and
      reads the reduced partitions (``averaged_gradients``) of all groups first;
    - ZeRO-2/3 (P = 1 only): the reduced gradients live in DeepSpeed's buckets, so DeepSpeed clips
      globally (``gradient_clipping`` = ``optim.max_grad_norm``, see ``ds_config``; its coefficient
      is 1 / max(1, (norm + 1e-6) / limit), the same as ours) and mmpipe installs no hook, only
      reports DeepSpeed's pre-clip global norm (``engine.get_global_grad_norm()``). Per-group limits
      are refused there (``train.run``).
    """

    def __init__(self, engine, groups: list[Group], max_norm: Optional[float]):
        self.engine = engine
        self.max_norm = max_norm
        self.groups = [g for g in groups if not g.frozen]
        self.inner = innermost_optimizer(engine.optimizer)
        self.partitioned = self.inner is not engine.optimizer and not type(engine.optimizer).__name__.startswith("FP16")
        grid = getattr(engine, "grid", None)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            self.reduce = None  # one process
        elif self.partitioned:
            self.reduce = (None,)  # the whole world: every rank holds a distinct piece
        elif grid is not None and grid.pipe_parallel_size > 1:
            self.reduce = (grid.get_pipe_parallel_group(),)  # the stages
        else:
            self.reduce = None  # replicated over data-parallel ranks
        self.last_norm: Optional[float] = None
        self.last_coef: float = 1.0
        self.group_norms: dict = {}
        self.group_coefs: dict = {}
        self.seconds = 0.0  # time computing norms and scaling this step (benchmarks)
        self.wait_seconds = 0.0  # time in the norm all-reduce, including waiting for other stages
        self._zero = None
        self.skip = False  # this step's gradients are not finite (on some rank): no optimizer step anywhere
        self.computed = False  # the norms were taken this step (not on a step DeepSpeed's loss scaler skipped)
        self.step_no = 0  # the trainer's step (test hook, log.grads)
        self.before_clip = None  # called with the step before the norms are taken (log.grads: train.grad_dump)
        stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else 0
        self.deepspeed_clips = stage >= 2
        if self.deepspeed_clips:  # per-group limits are refused before this (train.Trainer.validate)
            self.ds_limit = float(engine.gradient_clipping() or 0.0) or None
            # its step has the reduced partitions until it clips and steps: log.grads reads them there
            wrap_zero_step(engine.optimizer, lambda: self.before_clip(self.step_no) if self.before_clip else None)
            return
        # the norms are always computed (one small all-reduce): a non-finite one skips the step
        if is_zero_optimizer(engine.optimizer):
            self._zero = engine.optimizer
            wrap_zero_step(self._zero, self._zero_pre_step)
        self._wrap_inner_step()

    @property
    def names(self) -> list:
        return [g.name for g in self.groups]

    @property
    def limits(self) -> dict:
        return {g.name: g.max_grad_norm for g in self.groups}

    def _wrap_inner_step(self) -> None:
        """The inner torch optimizer's ``step`` runs only when the step's gradients are finite
        (every DeepSpeed wrapper calls it; skipping it leaves weights, moments and Adam's step count
        as they were, and DeepSpeed's copies to bf16/partitioned weights then copy unchanged values)."""
        inner, original = self.inner, self.inner.step

        def step(*args, **kwargs):
            if self._zero is None:  # the gradients of every group are in place now
                self._hook(inner, args, kwargs)
            if self.skip:
                return None
            return original(*args, **kwargs)

        step._wrapped_by_lr_sched = True  # (torch's LR scheduler checks that its own wrapper is still there)
        inner.step = step

    # -- where the gradients are -----------------------------------------------------------------
    def _hook(self, optimizer, args, kwargs):
        named = [(group_name(g), [p.grad for p in g["params"] if p.grad is not None], g.get("replica", False),
                  g.get("moe", False)) for g in optimizer.param_groups]
        self._clip(named, scale=1.0)
        return None

    def _zero_pre_step(self):
        zo = self._zero
        named = [(group_name(group), zero_group_grads(zo, i), group.get("replica", False), group.get("moe", False))
                 for i, group in enumerate(zo.optimizer.param_groups)]
        self._clip(named, scale=float(getattr(zo, "loss_scale", 1.0) or 1.0))

    # -- the arithmetic --------------------------------------------------------------------------
    def _clip(self, named_grads, scale: float) -> None:
        """``named_grads``: (group name, gradients, replica, expert) per optimizer group; a replica group (a
        tied parameter's later copy) is scaled with its group but not counted in its norm; an expert group's
        replicated slices (ZeRO-0) are counted on every rank of the expert-parallel group, summed over it. A
        non-finite norm (reduced over the ranks that hold different gradients, so every rank sees
        it) sets ``skip``: the optimizer step is left out on every rank."""
        t0 = time.perf_counter()
        if self.before_clip is not None:
            self.before_clip(self.step_no)
        _test_inject_nan(named_grads, self.step_no)
        grads: dict = {}
        counted: dict = {}
        experts: dict = {}
        # expert parallelism: replicated (ZeRO-0) expert slices differ over the expert-parallel group (each rank its
        # experts): their squares are summed over it before the stages'
        ep_group = None if self.partitioned else expert_parallel_group(self.engine)
        by_expert = ep_group is not None
        for name, gs, replica, expert in named_grads:
            if name not in self.names or not gs:
                continue
            grads.setdefault(name, []).extend(gs)
            if not replica:
                (experts if expert and by_expert else counted).setdefault(name, []).extend(gs)
        dev = next((x.device for gs in grads.values() for x in gs), self.engine.device)

        def squares(of: dict) -> torch.Tensor:
            return torch.stack([sum_of_squares(of[n]) if n in of else torch.zeros((), dtype=torch.float64, device=dev)
                                for n in self.names]) if self.names else torch.zeros(1, dtype=torch.float64, device=dev)

        # every group's sum of squares on the device, read by the host once per step (after the all-reduce)
        sq = squares(counted)
        if by_expert:  # (every rank of a stage's expert group holds expert slices, or none does)
            sq_experts = squares(experts)
            dist.all_reduce(sq_experts, group=ep_group)
            sq = sq + sq_experts
        if self.reduce is not None:
            t1 = time.perf_counter()
            dist.all_reduce(sq, group=self.reduce[0])
            values = sq.tolist()
            # the all-reduce also absorbs the wait for the slowest stage (pipeline skew that would
            # otherwise show at the next step's first receive): counted apart from the compute
            self.wait_seconds += time.perf_counter() - t1
            t0 += time.perf_counter() - t1
        else:
            values = sq.tolist()
        norms = {n: math.sqrt(v) / scale if math.isfinite(v) else float("nan")
                 for n, v in zip(self.names, values)}  # of unscaled gradients
        coefs = {n: clip_coef(norms[n], self.limits[n]) for n in self.names}
        total = math.sqrt(sum(v * v for v in norms.values()))
        clipped_total = math.sqrt(sum((norms[n] * coefs[n]) ** 2 for n in self.names))
        global_coef = clip_coef(clipped_total, self.max_norm)
        self.skip = not math.isfinite(total)
        for n, gs in ([] if self.skip else grads.items()):
            c = coefs[n] * global_coef
            if c != 1.0:
                torch._foreach_mul_(gs, c)
        self.group_norms, self.group_coefs = norms, coefs
        self.last_norm, self.last_coef = total, global_coef
        self.computed = True
        self.seconds += time.perf_counter() - t0

    def record(self) -> dict:
        """Metrics for this step: global pre-clip norm and coefficient, and each group's."""
        if self.deepspeed_clips:  # DeepSpeed's global norm over all partitions (None if it computed none)
            norm = self.engine.get_global_grad_norm()
            self.last_norm = None if norm is None else float(norm)
            self.last_coef = 1.0 if self.last_norm is None else clip_coef(self.last_norm, self.ds_limit)
        # fp16: DeepSpeed's loss scaler skips an overflowing step itself; it counts the same
        ds_skipped = int(getattr(self.engine, "skipped_steps", 0) or 0)
        overflow, self._ds_skipped = ds_skipped > getattr(self, "_ds_skipped", 0), ds_skipped
        # a step DeepSpeed's loss scaler skipped before the norms were taken has none (not the last step's)
        fresh = self.deepspeed_clips or self.computed
        out = {"grad_norm": self.last_norm if fresh else None, "clip_coef": self.last_coef if fresh else None,
               "clip_time": self.seconds, "clip_wait": self.wait_seconds, "skipped": bool(self.skip or overflow)}
        scale = dynamic_loss_scale(self.engine.optimizer)
        if scale is not None:
            out["loss_scale"] = scale  # after this step's update (lowered on an overflow)
        self.skip = self.computed = False
        for n in self.names:
            out[f"grad_norm.{n}"] = self.group_norms.get(n) if fresh else None
            out[f"clip_coef.{n}"] = self.group_coefs.get(n) if fresh else None
        self.seconds = self.wait_seconds = 0.0
        return out
