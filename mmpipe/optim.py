"""Parameter groups, the learning-rate schedule, and gradient-norm measurement/clipping that is
correct across pipeline stages and data-parallel / ZeRO partitions.

Clipping contract: DeepSpeed's ``gradient_clipping`` is always 0 in the resolved config;
``GradClipper`` hooks the innermost torch optimizer (``register_step_pre_hook``), where DeepSpeed
has already reduced, accumulated and unscaled the gradients (fp32 ZeRO-0: the model's own
parameters, replicated over data-parallel ranks; ZeRO-1 and bf16: flat fp32 partitions spread
over data-parallel ranks). It sums squares per parameter group, all-reduces once over exactly the
ranks that hold distinct pieces (pipeline stages, plus data-parallel ranks when partitioned),
records the norms and scales the gradients before the update. An fp16 overflow step never reaches
the inner optimizer, so it is skipped, not clipped.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

NO_DECAY_HINTS = ("bias", "norm", "embedding", "logit_scale", "class_embedding", "bn", "ln_")
GROUP_NAMES = ("decay", "no_decay")


def wants_decay(name: str, param: torch.nn.Parameter) -> bool:
    lname = name.lower()
    return param.ndim >= 2 and not any(h in lname for h in NO_DECAY_HINTS)


def param_groups(named_params, optim_cfg) -> list[dict]:
    """AdamW groups: weight decay on matrices only (open_clip's rule). Empty groups are dropped."""
    groups = {"decay": [], "no_decay": []}
    for name, p in named_params:
        if not p.requires_grad:
            continue
        groups["decay" if wants_decay(name, p) else "no_decay"].append(p)
    out = []
    for gname in GROUP_NAMES:
        if groups[gname]:
            out.append({"name": gname, "params": groups[gname],
                        "weight_decay": optim_cfg.weight_decay if gname == "decay" else 0.0})
    return out


def lr_lambda(optim_cfg, total_steps: int):
    warm = optim_cfg.warmup_steps

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if optim_cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total_steps - warm))
        return optim_cfg.min_lr_ratio + (1 - optim_cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def innermost_optimizer(opt):
    while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return opt


class GradClipper:
    """Measures the global (and per-group) gradient norm at the optimizer step; clips if asked."""

    def __init__(self, engine, max_norm: Optional[float], group_names=GROUP_NAMES):
        self.engine = engine
        self.max_norm = max_norm
        self.group_names = list(group_names)
        self.inner = innermost_optimizer(engine.optimizer)
        self.partitioned = self.inner is not engine.optimizer
        grid = getattr(engine, "grid", None)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            self.reduce_group, self.needs_reduce = None, False
        elif self.partitioned:
            self.reduce_group, self.needs_reduce = None, True  # every rank holds a distinct piece
        elif grid is not None and grid.pipe_parallel_size > 1:
            self.reduce_group, self.needs_reduce = grid.get_pipe_parallel_group(), True
        else:
            self.reduce_group, self.needs_reduce = None, False  # replicated over data-parallel ranks
        self.last_norm: Optional[float] = None
        self.last_group_norms: dict[str, float] = {}
        self.last_coef: float = 1.0
        self._handle = self.inner.register_step_pre_hook(self._hook)

    def _hook(self, optimizer, args, kwargs):
        groups = optimizer.param_groups
        sq = torch.zeros(len(self.group_names), dtype=torch.float64)
        grads_by_group = []
        for i, g in enumerate(groups):
            name = g.get("name", self.group_names[min(i, len(self.group_names) - 1)])
            slot = self.group_names.index(name) if name in self.group_names else len(self.group_names) - 1
            grads = [p.grad for p in g["params"] if p.grad is not None]
            grads_by_group.append(grads)
            if grads:
                norms = torch._foreach_norm(grads, 2.0)
                sq[slot] += float(sum(n.double() ** 2 for n in norms))
        if self.needs_reduce:
            dev = self._device(grads_by_group)
            t = sq.to(dev)
            dist.all_reduce(t, group=self.reduce_group)
            sq = t.cpu()
        self.last_group_norms = {n: float(math.sqrt(v)) for n, v in zip(self.group_names, sq.tolist())}
        total = float(math.sqrt(sq.sum().item()))
        self.last_norm = total
        self.last_coef = 1.0
        if self.max_norm is not None and math.isfinite(total) and total > self.max_norm:
            self.last_coef = self.max_norm / (total + 1e-6)
            for grads in grads_by_group:
                if grads:
                    torch._foreach_mul_(grads, self.last_coef)
        return None

    def _device(self, grads_by_group):
        for grads in grads_by_group:
            for g in grads:
                return g.device
        return self.engine.device

    def remove(self):
        self._handle.remove()
