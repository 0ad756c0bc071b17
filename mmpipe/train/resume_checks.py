"""What a resume checks against a checkpoint's record before it loads anything, each refusal one
line naming the setting and how to resume: the model config, the training settings (train type,
LoRA spec), the frozen base, the data position's unit, the layout its DeepSpeed files fit, and a
LoRA checkpoint's adapters."""
from __future__ import annotations

import os
from typing import Optional

from mmpipe.errors import MmpipeError
from mmpipe.families.expert_dispatch import whole_shape
from mmpipe.families.lora import is_adapter
from mmpipe.train.checkpoint_files import check_complete, latest_tag, readable
from mmpipe.train.checkpoint_record import FROZEN_EXCLUDED, absolute_paths, check_base, flat_keys, read_record
from mmpipe.train.checkpoint_weights import load_model_weights


def check_resume(root: str, current: dict, packing: Optional[bool]) -> None:
    """Before a resume loads anything: the latest checkpoint was trained with this run's precision
    and LoRA spec, on the same frozen base (when ``current`` holds its fingerprint: rank 0), and its
    data position counts what this run's does (``data.packing``: packs or samples)."""
    tag_dir = os.path.join(root, latest_tag(root, prefix="--resume: "))
    check_complete(tag_dir)
    record = read_record(tag_dir)
    if not record:
        return
    check_training(tag_dir, record.get("training"), current.get("training") or {})
    check_hub(tag_dir, record.get("hub") or {}, current.get("hub") or {})
    if record.get(FROZEN_EXCLUDED, False) and current.get("frozen_base") is not None:
        check_base(record.get("frozen_base"), current["frozen_base"], tag_dir, "in the config resumed with",
                   "--resume: ")
    saved = ((record.get("client") or {}).get("data_position") or {}).get("packing")
    if saved is not None and packing is not None and bool(saved) != bool(packing):
        counts = "packs" if saved else "samples"
        raise MmpipeError(f"--resume: {tag_dir}'s data position counts {counts} (data.packing={str(saved).lower()}), "
                          f"this run has data.packing={str(packing).lower()}: the rest of its epoch cannot be found; "
                          f"resume with data.packing={str(saved).lower()}, or start a new train.output_dir")


def check_hub(tag_dir: str, saved: dict, now: dict) -> None:
    """A hub id resolves now to the snapshot the checkpoint was trained from (``config.hub``): a later
    change of its branch upstream is refused in one line, not picked up silently."""
    for key, pin in saved.items():
        cur = now.get(key)
        if cur and cur != pin and cur.split("@")[0] == pin.split("@")[0]:
            raise MmpipeError(f"--resume: {key}={cur.split('@')[0]} is {cur} now, the checkpoint in {tag_dir} was "
                              f"trained from {pin}: resume with --set {key}={pin} (its config.yaml), or start a new "
                              "train.output_dir")


def check_training(tag_dir: str, saved: Optional[dict], now: dict) -> None:
    """The checkpoint was trained with this run's train type and LoRA spec (one line naming the
    setting otherwise); a record older than this check is taken as it is."""
    if not saved:
        return
    keys = ["optim.train_type"]  # (a precision change resumes through the layout-free files: ``same_layout``)
    if saved.get("optim.train_type") == now.get("optim.train_type") == "lora":
        keys += ["optim.lora_rank", "optim.lora_alpha", "optim.lora_dropout", "optim.target_modules"]
    same = lambda a, b: sorted(a) == sorted(b) if isinstance(a, list) and isinstance(b, list) else a == b  # noqa: E731
    diff = [k for k in keys if k in saved and not same(saved[k], now.get(k))]  # (target modules: a set)
    if diff:
        shown = ", ".join(f"{k}={_setting(saved[k])} at the checkpoint, {_setting(now.get(k))} now" for k in diff)
        raise MmpipeError(f"--resume: {tag_dir} was trained with other settings ({shown}): resume with "
                          f"{' '.join(f'--set {k}={_setting(saved[k])}' for k in diff)} (its config.yaml), or start "
                          "a new train.output_dir")


def _setting(v) -> str:
    return "[" + ",".join(map(str, v)) + "]" if isinstance(v, list) else str(v)


def check_model(tag_dir: str, model: dict) -> None:
    """The checkpoint's record was written for this model config (one line naming what differs)."""
    record = read_record(tag_dir)
    if not record or "model" not in record:
        return
    saved, now = flat_keys(absolute_paths(record["model"])), flat_keys(absolute_paths(model))
    diff = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if diff:
        shown = ", ".join(f"model.{k}: {saved.get(k)!r} saved, {now.get(k)!r} now" for k in diff[:3])
        raise MmpipeError(f"--resume: {tag_dir} was saved by another model config ({shown}"
                          f"{' ...' if len(diff) > 3 else ''}); resume with the config it was trained with "
                          "(its config.yaml), or start a new train.output_dir")


def _describe(layout: dict) -> str:
    s = f"pipeline_stages={layout['pipeline_stages']} data_parallel={layout['data_parallel']} " \
        f"zero_stage={layout['zero_stage']}" + (f" precision={layout['precision']}" if layout.get("precision") else "")
    if layout.get("stages"):
        s += " stages " + " | ".join(f"{st[0]}..{st[-1]}" for st in layout["stages"])
    return s


def same_layout(saved: dict, current: dict) -> bool:
    """Whether DeepSpeed's own per-stage files fit this run (else the layout-free path; always with expert
    parallelism on either side: DeepSpeed's files hold data-parallel rank 0's expert slices only)."""
    if saved.get("expert_parallel", 1) > 1 or current.get("expert_parallel", 1) > 1:
        return False
    keys = ["pipeline_stages", "zero_stage", "stages"] + (["data_parallel"] if saved["zero_stage"] > 0 else [])
    # another precision: DeepSpeed's optimizer wrappers differ (fp32, bf16, fp16): the layout-free path
    return (saved.get("decay_split", 1) == current.get("decay_split", 1)
            and saved.get("precision", current.get("precision")) == current.get("precision")
            and all(saved.get(k) == current.get(k) for k in keys))


def check_layout(saved: dict, current: dict, where: str) -> None:
    """A checkpoint without layout-free optimizer state resumes on its own layout only."""
    if saved.get("decay_split", 1) != current.get("decay_split", 1):
        raise MmpipeError(f"--resume: {where} was saved before the VLM's token embedding left the weight-decayed "
                          "optimizer group, and without layout-free optimizer state: resume it with the mmpipe version "
                          "that wrote it, or start from its weights (model.pretrained of an export)")
    if not same_layout(saved, current):
        raise MmpipeError(f"--resume: {where} was saved with {_describe(saved)} (placement {saved['placement']}); "
                          f"this run has {_describe(current)}: resume with the checkpoint's layout "
                          "(parallel.pipeline_stages, parallel.placement or parallel.plan, parallel.zero_stage and the "
                          "number of ranks); it was saved before mmpipe wrote layout-free optimizer state")


def check_adapters(tag_dir: str, named_params, stages: Optional[list], aliases: dict) -> None:
    """A LoRA checkpoint (frozen base left out) loads non-strictly: only if every weight of this
    rank it lacks is a frozen one, every adapter it holds for this rank's layers is one of this
    run's, of the same shape (one line otherwise: resumed with other target modules, another rank
    or other frozen groups, its adapters would be dropped)."""
    saved = readable(tag_dir, lambda: load_model_weights(os.path.dirname(tag_dir), os.path.basename(tag_dir)))
    mine = dict(named_params)
    layers = None if not stages else [n for st in stages for n in st if any(k.startswith(n + ".") for k in mine)]
    missing = [n for n, p in mine.items() if p.requires_grad and n not in saved and aliases.get(n) not in saved]
    extra = [k for k in saved if k not in mine and is_adapter(k)
             and (layers is None or any(k.startswith(n + ".") for n in layers))]
    shape = [k for k in saved if k in mine and tuple(saved[k].shape) != whole_shape(mine[k])]
    if missing or extra or shape:
        said = [f"{what} {', '.join(ks[:2])}{' ...' if len(ks) > 2 else ''}"
                for what, ks in (("lacks", missing), ("holds adapters this run has not:", extra),
                                 ("holds other shapes for", shape)) if ks]
        raise MmpipeError(f"--resume: {tag_dir} {'; '.join(said)}: resume with the LoRA settings it was trained with "
                          "(optim.target_modules, optim.lora_rank, the freeze_* flags: its config.yaml), or start a "
                          "new train.output_dir")
