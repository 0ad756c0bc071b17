"""The plain model's weights from a checkpoint of any layout, without a DeepSpeed engine: pipeline
per-layer files (through the layer table), a ``P = 1`` module file, ZeRO-3 partitions (DeepSpeed's
``zero_to_fp32``), and a LoRA checkpoint's frozen base rebuilt from the run's config."""
from __future__ import annotations

import glob
import json
import os
from typing import Optional

import torch

from mmpipe.config.resolve import build_family
from mmpipe.config.schema import load_config
from mmpipe.errors import MmpipeError
from mmpipe.families.lora import is_adapter
from mmpipe.parallel.layers import plain_state_key
from mmpipe.parallel.plain import plain_model
from mmpipe.train.checkpoint_files import COMPLETE_FILE, check_complete, is_complete, latest_tag, readable, step_of, \
    tag_for
from mmpipe.train.checkpoint_record import FROZEN_EXCLUDED, base_fingerprint, check_base, read_record

LAYERS_FILE = "mmpipe_layers.json"  # a pipelined run's layer table: layer index -> the plain model's layer name
EXPERTS_FILE = "experts_stage{}.safetensors"  # expert parallelism: per stage, every expert's weights (plain names)


def load_weights(path: str, step: Optional[int] = None) -> dict:
    """The plain model's state dict from a run directory, its ``checkpoints`` directory or one
    ``global_stepN`` directory, saved in any layout; no DeepSpeed engine. ``step`` picks a
    checkpoint of a run (default: the latest)."""
    if os.path.isfile(os.path.join(path, "latest")):
        root, tag = path, None
    elif os.path.isdir(os.path.join(path, "checkpoints")):
        root, tag = os.path.join(path, "checkpoints"), None
    elif os.path.basename(os.path.normpath(path)).startswith("global_step"):
        root, tag = os.path.dirname(os.path.normpath(path)), os.path.basename(os.path.normpath(path))
    else:
        raise MmpipeError(f"{path}: not a run directory, a checkpoints directory or a global_stepN checkpoint")
    if step is not None:
        tag = tag_for(step)
        if not os.path.isdir(os.path.join(root, tag)):
            have = sorted(t for t in os.listdir(root) if t.startswith("global_step"))
            raise MmpipeError(f"{root}: no checkpoint for step {step} (have {', '.join(have) or 'none'})")
    tag = tag or latest_tag(root)
    tag_dir = os.path.join(root, tag)
    latest = os.path.join(root, "latest")
    if not is_complete(tag_dir) and os.path.isfile(latest) and step_of(tag) > step_of(open(latest).read().strip()):
        raise MmpipeError(f"{tag_dir} is incomplete (no {COMPLETE_FILE} marker: the run stopped while saving it); "
                          "read an earlier step (--step) or the latest checkpoint")
    check_complete(tag_dir, prefix="")
    weights = readable(tag_dir, lambda: load_model_weights(root, tag), prefix="",
                       fix="read an earlier checkpoint (--step)")
    record = read_record(tag_dir) or {}
    if record.get(FROZEN_EXCLUDED, False):
        weights = {**frozen_base(root, record.get("frozen_base"), tag_dir), **weights}
    return weights


def frozen_base(root: str, fingerprint: Optional[dict] = None, where: Optional[str] = None) -> dict:
    """The weights a LoRA checkpoint leaves out: the frozen base, rebuilt from the run's config as the
    run built it (pretrained directories, or the seeded init); ``fingerprint`` (the checkpoint's
    record of its pretrained directories) refuses another base in one line."""
    cfg_path = os.path.join(os.path.dirname(os.path.normpath(root)), "config.yaml")
    if not os.path.isfile(cfg_path):
        raise MmpipeError(f"{root}: the checkpoint holds the adapters only (a LoRA run) and the run's config.yaml, "
                          f"which rebuilds its frozen base, is not beside it ({cfg_path})")
    cfg = load_config(cfg_path)
    check_base(fingerprint, base_fingerprint(cfg.to_dict()["model"]), where or root, cfg_path)
    model = plain_model(build_family(cfg))
    return {k: v for k, v in model.state_dict().items() if not is_adapter(k)}


def load_model_weights(root: str, tag: Optional[str] = None) -> dict:
    """State dict in the plain model's names (``parallel.plain.PlainModel``: every family's), from a checkpoint of any
    layout (a pipeline's per-layer files, or a single-process / ZeRO one)."""
    tag = tag or latest_tag(root)
    sd = _deepspeed_weights(root, tag)
    from safetensors.torch import load_file  # expert parallelism: every expert, over DeepSpeed's rank-0 slices
    for f in sorted(glob.glob(os.path.join(root, tag, EXPERTS_FILE.format("*")))):
        sd.update(load_file(f))
    return sd


def _deepspeed_weights(root: str, tag: str) -> dict:
    d = os.path.join(root, tag)
    layers_file = os.path.join(d, LAYERS_FILE)
    if os.path.isfile(layers_file):
        with open(layers_file) as fh:
            names = json.load(fh)["layers"]
        sd = {}
        for i, name in enumerate(names):
            files = sorted(glob.glob(os.path.join(d, f"layer_{i:02d}-*model_states.pt")))
            if not files:
                raise MmpipeError(f"{d}: no weights for layer {i} ({name})")
            for k, v in torch.load(files[0], map_location="cpu", weights_only=False).items():
                sd[plain_state_key(name, k)] = v
        return sd
    files = sorted(glob.glob(os.path.join(d, "mp_rank_*_model_states.pt")))
    if not files:
        if glob.glob(os.path.join(d, "zero_pp_rank_*_mp_rank_*_model_states.pt")):
            return _zero3_weights(root, tag)
        raise MmpipeError(f"{d}: not a DeepSpeed checkpoint")
    return torch.load(files[0], map_location="cpu", weights_only=False)["module"]


def _zero3_weights(root: str, tag: str) -> dict:
    """ZeRO-3 (P = 1): each data-parallel rank saved only its partition of every parameter
    (``zero_pp_rank_*``); DeepSpeed's engine-free ``zero_to_fp32`` merges the fp32 partitions from
    the optimizer files, the buffers and any frozen parameters into one plain state dict."""
    import contextlib
    import io

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):  # it reports every stage
        return dict(get_fp32_state_dict_from_zero_checkpoint(root, tag))
