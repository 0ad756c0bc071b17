"""``log.grads``: every trainable parameter's gradient at chosen steps, written under the plain model's names
(``OUTPUT/grads/step{N}.stage{S}.safetensors``), so that two layouts of one run - P = 1 and a pipeline, one
rank and many, accumulation 1 and 8 - can be compared parameter by parameter (``compare_grads``).

Taken where the clipper takes its norms: DeepSpeed has reduced and accumulated them (over the micro-batches
and the data-parallel ranks) and unscaled them, nothing is clipped yet. Read through whichever optimizer
wrapper DeepSpeed built (``ds_compat.optimizer_kind``): the fp32 accumulation buffer of the bf16 optimizer or
ZeRO (``deepspeed.utils.safe_get_full_grad``, a collective over the data-parallel group), the fp32 masters of
the unfused one, the parameters' own ``grad`` otherwise; an expert slice's gathered over its expert-parallel group
(every expert's). Data-parallel rank 0 of each stage writes."""
from __future__ import annotations

import glob
import os
import re

import torch

from mmpipe.families.expert_dispatch import shard_of, whole
from mmpipe.parallel.ds_compat import optimizer_kind, unfused_masters

FILE = "step{:06d}.stage{}.safetensors"


def save_grads(engine, named_params, out_dir: str, step: int, stage: int, dp_rank: int) -> None:
    from deepspeed.utils import safe_get_full_grad
    from safetensors.torch import save_file
    kind = optimizer_kind(engine.optimizer)
    masters = unfused_masters(engine.optimizer) if kind == "unfused" else {}
    out = {}
    for name, p in named_params:
        if not p.requires_grad:
            continue
        if kind == "mapped":
            g = safe_get_full_grad(p)
        else:
            g = getattr(masters.get(id(p), p), "grad", None)
        if shard_of(p) is not None:  # (DeepSpeed gives every expert slice a gradient: each rank joins the gather)
            g = whole(p, (g if g is not None else torch.zeros_like(p)).detach().float())
        if g is not None:
            out[name] = g.detach().float().cpu().contiguous()
    if dp_rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        save_file(out, os.path.join(out_dir, FILE.format(step, stage)), metadata={"optimizer": kind})


def load_grads(run_dir: str, step: int) -> dict:
    """Every stage's gradients of ``step`` of a run (plain name -> fp32 tensor)."""
    from safetensors.torch import load_file
    files = sorted(glob.glob(os.path.join(run_dir, "grads", FILE.format(step, "*"))))
    if not files:
        raise FileNotFoundError(f"{run_dir}/grads: no gradients of step {step} (log.grads lists the steps)")
    out = {}
    for f in files:
        out.update(load_file(f))
    return out


def dumped_steps(run_dir: str) -> list:
    return sorted({int(m.group(1)) for f in glob.glob(os.path.join(run_dir, "grads", "step*.safetensors"))
                   if (m := re.search(r"step(\d+)\.stage", os.path.basename(f)))})


def compare_grads(got: dict, want: dict, floor: float = 0.0, layers=None) -> dict:
    """Parameter by parameter and layer by layer. ``by_name``: each parameter's relative L2 error
    ||got - want|| / max(||want||, ``floor``) (``floor`` keeps a parameter without a gradient in exact arithmetic, a
    key projection's bias, from turning rounding noise into a large ratio), ``worst`` its largest (name, error);
    ``by_layer`` / ``worst_layer``: the same over each layer's parameters together (``layers``: the layer names, a
    parameter belonging to the longest that prefixes it; bf16 rounding leaves a small-gradient norm's bias a few
    percent off while its layer agrees to ~1e-3); ``global``: over all; ``missing`` / ``extra`` names. A gradient
    scaled on one stage (DeepSpeed's 1/GAS^2 on earlier stages before 0.19.3) or taken from one micro-batch
    shows as an error of order one on every layer it touches."""
    both = sorted(set(got) & set(want))
    diff = {k: (got[k].double() - want[k].double()).pow(2).sum() for k in both}
    ref = {k: want[k].double().pow(2).sum() for k in both}
    by_name = {}
    for k in both:
        denom = max(float(ref[k].sqrt()), floor)
        by_name[k] = float(diff[k].sqrt()) / denom if denom > 0 else float(got[k].norm())
    groups: dict = {}
    for k in both:
        owner = max((name for name in layers or () if k.startswith(name + ".")), key=len, default=k)
        groups.setdefault(owner, []).append(k)
    by_layer = {}
    for owner, ks in groups.items():
        d, r = float(sum(diff[k] for k in ks).sqrt()), float(sum(ref[k] for k in ks).sqrt())
        by_layer[owner] = d / max(r, floor) if max(r, floor) > 0 else d
    total_ref = float(sum(ref.values(), torch.zeros((), dtype=torch.float64)).sqrt())
    total_diff = float(sum(diff.values(), torch.zeros((), dtype=torch.float64)).sqrt())
    return {"worst": max(by_name.items(), key=lambda kv: kv[1], default=(None, 0.0)),
            "worst_layer": max(by_layer.items(), key=lambda kv: kv[1], default=(None, 0.0)),
            "global": total_diff / total_ref if total_ref > 0 else total_diff,
            "missing": sorted(set(want) - set(got)), "extra": sorted(set(got) - set(want)),
            "by_name": by_name, "by_layer": by_layer, "count": len(by_name)}


def grad_norm_of(grads: dict) -> float:
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))
