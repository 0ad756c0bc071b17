"""A checkpoint's self-describing record (``mmpipe_checkpoint.json``): the model family and config,
the layout its DeepSpeed files are tied to, the plan, the training settings, the fingerprint of a
LoRA run's frozen base, the versions that wrote it, the step and the run's client state."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import torch

from mmpipe._version import __version__
from mmpipe.config.schema import family_of
from mmpipe.data.json_files import write_json
from mmpipe.errors import MmpipeError
from mmpipe.parallel.plan import stage_lists
from mmpipe.parallel.schedules import Order
from mmpipe.planning.cache import cache_dir
from mmpipe.train.checkpoint_files import json_dict, readable

RECORD_FILE = "mmpipe_checkpoint.json"  # self-describing: family, model config, layout, step, data, versions
FROZEN_EXCLUDED = "frozen_excluded"  # the record's flag: the checkpoint holds no frozen weight (a LoRA base)


def layout_record(topo, cfg, layer_names: Optional[list], parts: Optional[list], order: Order) -> dict:
    """What a checkpoint's DeepSpeed files are tied to: stages, their layers, data-parallel degree
    (with ZeRO, optimizer state is partitioned over it) and ZeRO stage; and the pipeline order that
    wrote it (the order holds no state: a resume under another one reads the same files)."""
    return {"pipeline_stages": topo.pipeline_stages, "data_parallel": topo.data_parallel, "schedule": order.name,
            "frozen_stages": order.frozen,
            "zero_stage": cfg.parallel.zero_stage, "placement": cfg.parallel.placement,
            "expert_parallel": topo.expert_parallel,
            "stages": stage_lists(layer_names, parts) if layer_names is not None else None,
            "decay_split": family_of(cfg).decay_split, "precision": cfg.train.precision}


# "decay_split": how parameters split into decayed / undecayed optimizer groups, which DeepSpeed's
# per-stage files hold as they were. 2: embedding tables by type (``mark_embedding_tables``), which
# moved the VLM's decoder token table (named ``embed_tokens``) out of the decayed group; other families'
# groups did not change (1). A checkpoint written under another split resumes through the layout-free
# path, which maps optimizer state by parameter name.


def run_record(cfg, layout: dict, plan: Optional[dict] = None) -> dict:
    """What every checkpoint of a run records besides its step and data position: the model family,
    the resolved model config, the layout (stages, topology), the plan (``plan.json``'s schema) and
    the versions that wrote it."""
    import deepspeed
    import transformers

    return {"format": 1, "family": cfg.model.type, "model": absolute_paths(cfg.to_dict()["model"]), "layout": layout,
            "plan": plan, "training": training_record(cfg), "hub": dict(getattr(cfg, "hub", {}) or {}),
            "versions": {"mmpipe": __version__, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
                         "transformers": transformers.__version__}}


def absolute_paths(section: dict) -> dict:
    """A config section with every ``pretrained`` directory as an absolute path: what a run saves
    (config.yaml, the checkpoint record), so later commands do not depend on the launch directory."""
    return {k: absolute_paths(v) if isinstance(v, dict) else
            (os.path.abspath(v) if k == "pretrained" and isinstance(v, str) and v else v) for k, v in section.items()}


def training_record(cfg) -> dict:
    """The precision and the LoRA spec, by config key: a resume must keep the LoRA spec as it was."""
    o = cfg.optim
    out = {"train.precision": cfg.train.precision, "optim.train_type": o.train_type}
    if o.train_type == "lora":
        tm = [o.target_modules] if isinstance(o.target_modules, str) else list(o.target_modules)
        out.update({"optim.lora_rank": o.lora_rank, "optim.lora_alpha": o.lora_alpha,
                    "optim.lora_dropout": o.lora_dropout, "optim.target_modules": tm})
    return out


def record_client(record: dict) -> dict:
    """What a checkpoint's record keeps of the run besides weights: the step, the bad-sample ledger
    (``data``) and every client field (data position, skipped steps, ...)."""
    return {**(record.get("client") or {}), "data": record.get("data") or {}, "step": int(record["step"])}


def read_record(tag_dir: str) -> Optional[dict]:
    path = os.path.join(tag_dir, RECORD_FILE)
    if not os.path.isfile(path):
        return None  # written by an mmpipe before the record existed
    return readable(path, lambda: json_dict(path), prefix="")


def saved_layout(root: str) -> Optional[dict]:
    """The layout of the latest checkpoint in ``root``, if it records one."""
    latest = os.path.join(root, "latest")
    if not os.path.isfile(latest):
        return None
    record = read_record(os.path.join(root, open(latest).read().strip()))
    return record["layout"] if record else None


def saved_plan(root: str) -> Optional[dict]:
    """The plan (plan.json's schema) the latest checkpoint in ``root`` records, if any (a record
    older than plans: its layout, whose ``stages`` say the same)."""
    latest = os.path.join(root, "latest")
    if not os.path.isfile(latest):
        return None
    record = read_record(os.path.join(root, open(latest).read().strip()))
    return (record.get("plan") or record.get("layout")) if record else None


# --------------------------------------------------------------------------------------------
# the frozen base a LoRA checkpoint leaves out, by the contents of its weight files
# --------------------------------------------------------------------------------------------
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")  # what a fingerprint of a pretrained directory reads


def _dir_digest(d: str) -> Optional[str]:
    if not os.path.isdir(d):
        return None
    h = hashlib.sha256()
    for f in sorted(os.listdir(d)):
        if f.endswith(WEIGHT_FILES) and os.path.isfile(os.path.join(d, f)):
            h.update(f.encode() + b"\0" + _file_digest(os.path.join(d, f)).encode())
    return h.hexdigest()[:32]


def _file_digest(path: str) -> str:
    """sha256 of a weight file's contents, read once: kept in the measurement cache under (path, size,
    modification time), which a re-saved or edited file changes (so a 14 GB base is read once, not at
    every export, generate and resume)."""
    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}"
    store = os.path.join(cache_dir(), "file_digests.json")
    try:
        with open(store) as fh:
            known = json.load(fh)
    except (OSError, ValueError):
        known = {}
    if key not in known:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
        known[key] = h.hexdigest()
        try:
            write_json(store, known)
        except OSError:  # a read-only cache: hashed again next time
            pass
    return known[key]


def flat_keys(d: dict, prefix: str = "") -> dict:
    """A nested config section as {dotted key: value}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def base_fingerprint(model: dict) -> dict:
    """{config key: {dir, digest}} of every pretrained directory of a ``model`` section: the weight
    files' contents (sha256), what a LoRA run's frozen base is rebuilt from (a base without one is
    the seeded init, fixed by the model config)."""
    return {f"model.{k}": {"dir": os.path.abspath(d), "digest": _dir_digest(d)}
            for k, d in sorted(flat_keys(model).items()) if k.rsplit(".", 1)[-1] == "pretrained" and d}


def check_base(saved: Optional[dict], now: dict, where: str, config: str, prefix: str = "") -> None:
    """The pretrained directories hold the frozen base the adapters in ``where`` were trained on."""
    for key, rec in (saved or {}).items():
        cur = now.get(key) or {"dir": None, "digest": None}
        if cur["digest"] != rec["digest"]:
            state = "is missing" if cur["dir"] and cur["digest"] is None else "differs from the base trained on"
            raise MmpipeError(f"{prefix}{key}={cur['dir']} {state}: the LoRA adapters in {where} were trained on the "
                              f"weight files of {rec['dir']} as they were then (another fingerprint); point {key} "
                              f"({config}) at that base")
