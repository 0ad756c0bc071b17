"""Layout-free optimizer state: each pipeline stage's fp32 masters and Adam moments under the plain
model's parameter names (``optim_stage{S}.safetensors``), gathered from whichever optimizer wrapper
DeepSpeed built (ZeRO-1/2/3, bf16, fp16 unfused, plain torch: ``ds_compat.optimizer_kind``), and the
resume that restores weights, optimizer state, lr schedule and step into another layout."""
from __future__ import annotations

import glob
import os
from typing import Optional

import torch

from mmpipe.errors import MmpipeError
from mmpipe.families.expert_dispatch import mine, shard_of, whole
from mmpipe.parallel.ds_compat import (
    ensure_zero_optimizer_state,
    is_zero3_param,
    optimizer_kind,
    relink_optimizer_state,
    set_engine_step,
    set_zero3_partition,
    unfused_masters,
)
from mmpipe.train.checkpoint_record import FROZEN_EXCLUDED, read_record
from mmpipe.train.checkpoint_weights import EXPERTS_FILE, load_model_weights

OPTIM_FILE = "optim_stage{}.safetensors"  # per pipeline stage: plain name -> fp32 master and Adam moments
ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def _adam_step(inner) -> float:
    return max((float(s["step"]) for s in inner.state.values() if "step" in s), default=0.0)


def _param_state(kind: str, inner, masters: dict, p) -> tuple:
    """(fp32 master, {moment: tensor} or None) of a trainable parameter held by a ``plain`` or
    ``unfused`` optimizer (``ds_compat.optimizer_kind``)."""
    master = masters.get(id(p), p) if kind == "unfused" else p
    st = inner.state.get(master) or {}
    return master, ({k: st[k] for k in ADAM_KEYS} if all(k in st for k in ADAM_KEYS) else None)


def save_plain_optimizer(engine, inner, named_params, tag_dir: str, stage: int, dp_rank: int) -> bool:
    """This stage's optimizer state under plain parameter names (layout-free): the fp32 master
    weight and both Adam moments of every trainable parameter, assembled from ZeRO partitions or
    DeepSpeed's bf16 optimizer (``deepspeed.utils.safe_get_full_*``, a collective over the
    data-parallel group), read from ``FP16_UnfusedOptimizer``'s masters, or from the torch
    optimizer; written by data-parallel rank 0. False (nothing written) for a wrapper that cannot be
    read by parameter: such a checkpoint resumes on its own layout only."""
    from deepspeed.utils import safe_get_full_fp32_param
    from safetensors.torch import save_file

    kind = optimizer_kind(engine.optimizer)
    if kind == "other":
        return False
    relink_optimizer_state(engine.optimizer)
    masters = unfused_masters(engine.optimizer) if kind == "unfused" else {}
    out = {}
    for name, p in named_params:
        if not p.requires_grad:
            continue
        if kind == "mapped":  # (no state yet, e.g. every step so far skipped: the moments are left out)
            fp32 = safe_get_full_fp32_param(p)
            m, v = _full_state(p, "exp_avg"), _full_state(p, "exp_avg_sq")
            moments = None if m is None else {"exp_avg": m, "exp_avg_sq": v}
        else:
            fp32, moments = _param_state(kind, inner, masters, p)
        whole = _whole(p)
        out[f"{name}::fp32"] = whole(fp32.detach().float()).cpu().contiguous()
        for k, t in (moments or {}).items():
            out[f"{name}::{k}"] = whole(t.detach().float()).cpu().contiguous()
    if dp_rank == 0:
        save_file(out, os.path.join(tag_dir, OPTIM_FILE.format(stage)), metadata={"adam_step": str(_adam_step(inner))})
    return True


def _whole(p):
    """An expert slice's tensor -> every expert's (gathered over its expert-parallel group: a collective every rank
    of the group calls for the same parameters); any other parameter's as it is."""
    return lambda t: whole(p, t)


def save_expert_weights(named_params, tag_dir: str, stage: int, dp_rank: int, exclude_frozen: bool = False) -> None:
    """Expert parallelism: every expert's weights of this stage (DeepSpeed's per-stage files hold data-parallel rank
    0's slices only), gathered over each expert-parallel group, written by data-parallel rank 0
    (``EXPERTS_FILE``; ``checkpoint_weights.load_model_weights`` lays them over DeepSpeed's); frozen ones left out
    with the frozen base (``exclude_frozen``: a LoRA run's, rebuilt from its config)."""
    from safetensors.torch import save_file
    out = {name: whole(p, p.detach()).cpu().contiguous() for name, p in named_params
           if shard_of(p) and (p.requires_grad or not exclude_frozen)}
    if dp_rank == 0 and out:
        save_file(out, os.path.join(tag_dir, EXPERTS_FILE.format(stage)))


def _full_state(p, key: str):
    """A parameter's whole Adam state ``key`` (a collective over its data-parallel group; every
    rank calls it for the same parameters), None when the optimizer holds none yet."""
    from deepspeed.utils import safe_get_full_optimizer_state
    try:
        return safe_get_full_optimizer_state(p, key)
    except ValueError:
        return None


def has_plain_optimizer(tag_dir: str) -> bool:
    return bool(glob.glob(os.path.join(tag_dir, OPTIM_FILE.format("*"))))


def read_plain_optimizer(tag_dir: str, aliases: Optional[dict] = None) -> tuple:
    """(plain name::field -> tensor, Adam's step) from every stage's file. The step is the largest
    any file records: a stage whose parameters are all frozen keeps no state and records 0."""
    from safetensors import safe_open
    state, adam_step = {}, 0.0
    for f in sorted(glob.glob(os.path.join(tag_dir, OPTIM_FILE.format("*")))):
        with safe_open(f, "pt") as fh:
            adam_step = max(adam_step, float(fh.metadata().get("adam_step", 0)))
            state.update({k: fh.get_tensor(k) for k in fh.keys()})
    for a, b in (aliases or {}).items():  # a tied parameter saved once (one stage) restores both copies
        for f in ("fp32",) + ADAM_KEYS:
            if f"{a}::{f}" not in state and f"{b}::{f}" in state:
                state[f"{a}::{f}"] = state[f"{b}::{f}"]
    return state, adam_step


def load_elsewhere(engine, inner, named_params, tag_dir: str, step: int, aliases: Optional[dict] = None) -> None:
    """Resume a checkpoint saved in another layout: weights (plain names), fp32 masters, Adam
    moments and step count (``save_plain_optimizer``), the lr schedule and the engine's step, into
    whichever optimizer wrapper this layout uses (``ds_compat.optimizer_kind``)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    state, adam_step = read_plain_optimizer(tag_dir, aliases)
    kind = optimizer_kind(engine.optimizer)
    if kind == "other":
        raise MmpipeError(f"--resume: {tag_dir} was saved in another layout, and this run's optimizer "
                          f"({type(engine.optimizer).__name__}) cannot be restored by parameter: resume on the "
                          "checkpoint's layout, or use mmpipe's default optimizer (no optimizer block in the DeepSpeed JSON)")
    ensure_zero_optimizer_state(engine.optimizer, inner, adam_step)
    masters = unfused_masters(engine.optimizer) if kind == "unfused" else {}
    weights = load_model_weights(os.path.dirname(tag_dir), os.path.basename(tag_dir))
    frozen_excluded = (read_record(tag_dir) or {}).get(FROZEN_EXCLUDED, False)
    for name, p in named_params:
        if name not in weights and frozen_excluded and not p.requires_grad:
            continue  # a frozen base weight, left out of the checkpoint: the model's own, as built
        if name not in weights:
            raise MmpipeError(f"--resume: {tag_dir} holds no weight for {name}: it is another model's checkpoint")
        mine = _mine(p)
        fp32 = mine(state.get(f"{name}::fp32", weights[name].float())).to(p.device)
        moments = ({k: mine(state[f"{name}::{k}"]).to(p.device) for k in ADAM_KEYS}
                   if f"{name}::exp_avg" in state else None)
        with torch.no_grad():  # the model's own (possibly low-precision, or ZeRO-3 partitioned) weight
            set_zero3_partition(p, fp32) if is_zero3_param(p) else p.data.copy_(fp32.to(p.dtype))
        if not p.requires_grad:
            continue
        if kind == "mapped":  # the master always; the moments when the checkpoint has them
            safe_set_full_fp32_param(p, fp32)
            for k, t in (moments or {}).items():
                safe_set_full_optimizer_state(p, t, k)
            continue
        master = masters.get(id(p), p) if kind == "unfused" else p
        with torch.no_grad():
            master.data.copy_(fp32)
        if moments is not None:
            inner.state[master] = {"step": torch.tensor(adam_step), **{k: t.clone() for k, t in moments.items()}}
    for s in inner.state.values():
        if "step" in s:
            s["step"] = torch.tensor(adam_step) if torch.is_tensor(s["step"]) else adam_step
    _restore_schedule(engine, step)


def _mine(p):
    """Every expert's tensor -> this rank's slice for an expert parameter (``shard_of``); any other as it is."""
    return lambda t: mine(p, t)


def _restore_schedule(engine, step: int) -> None:
    """The lr schedule and the engine's counters at ``step``."""
    sched = engine.lr_scheduler
    if sched is not None and hasattr(sched, "lr_lambdas"):  # mmpipe's schedule (LambdaLR) at the step reached
        sched.last_epoch = step
        lrs = [base * f(step) for base, f in zip(sched.base_lrs, sched.lr_lambdas)]
        for g, lr in zip(sched.optimizer.param_groups, lrs):
            g["lr"] = lr
        sched._last_lr = lrs
    elif sched is not None and hasattr(sched, "last_batch_iteration"):  # DeepSpeed's WarmupLR & co.
        sched.step(step - 1)
    set_engine_step(engine, step)
