"""Checkpoints: DeepSpeed's own format (resumable with ``--resume``), plus what mmpipe adds:
the layer-name table of a pipelined run, each rank's RNG state, and the data position (the step).
``load_model_weights`` reads any layout's checkpoint back into the plain model's names."""
from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import shutil
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from mmpipe._version import __version__
from mmpipe.errors import MmpipeError
from mmpipe.parallel.ds_compat import (
    ensure_zero_optimizer_state,
    optimizer_kind,
    relink_optimizer_state,
    set_zero3_partition,
    unfused_masters,
)
from mmpipe.parallel.layers import plain_state_key
from mmpipe.parallel.plan import stage_lists

LAYERS_FILE = "mmpipe_layers.json"
RECORD_FILE = "mmpipe_checkpoint.json"  # self-describing: family, model config, layout, step, data, versions
FROZEN_EXCLUDED = "frozen_excluded"  # the record's flag: the checkpoint holds no frozen weight (a LoRA base)


def layout_record(topo, cfg, layer_names: Optional[list], parts: Optional[list]) -> dict:
    """What a checkpoint's DeepSpeed files are tied to: stages, their layers, data-parallel degree
    (with ZeRO, optimizer state is partitioned over it) and ZeRO stage."""
    return {"pipeline_stages": topo.pipeline_stages, "data_parallel": topo.data_parallel,
            "zero_stage": cfg.parallel.zero_stage, "placement": cfg.parallel.placement,
            "stages": stage_lists(layer_names, parts) if layer_names is not None else None,
            "decay_split": 2 if cfg.model.type == "vlm" else 1, "precision": cfg.train.precision}


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
            "plan": plan, "training": training_record(cfg),
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
    from mmpipe.planning.cache import _write_json, cache_dir
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
            _write_json(store, known)
        except OSError:  # a read-only cache: hashed again next time
            pass
    return known[key]


def base_fingerprint(model: dict) -> dict:
    """{config key: {dir, digest}} of every pretrained directory of a ``model`` section: the weight
    files' contents (sha256), what a LoRA run's frozen base is rebuilt from (a base without one is
    the seeded init, fixed by the model config)."""
    return {f"model.{k}": {"dir": os.path.abspath(d), "digest": _dir_digest(d)}
            for k, d in sorted(_flat(model).items()) if k.rsplit(".", 1)[-1] == "pretrained" and d}


def check_base(saved: Optional[dict], now: dict, where: str, config: str, prefix: str = "") -> None:
    """The pretrained directories hold the frozen base the adapters in ``where`` were trained on."""
    for key, rec in (saved or {}).items():
        cur = now.get(key) or {"dir": None, "digest": None}
        if cur["digest"] != rec["digest"]:
            state = "is missing" if cur["dir"] and cur["digest"] is None else "differs from the base trained on"
            raise MmpipeError(f"{prefix}{key}={cur['dir']} {state}: the LoRA adapters in {where} were trained on the "
                              f"weight files of {rec['dir']} as they were then (another fingerprint); point {key} "
                              f"({config}) at that base")


def read_record(tag_dir: str) -> Optional[dict]:
    path = os.path.join(tag_dir, RECORD_FILE)
    if not os.path.isfile(path):
        return None  # written by an mmpipe before the record existed
    return _readable(path, lambda: _json_dict(path), prefix="")


def _json_dict(path: str) -> dict:
    with open(path) as fh:
        out = json.load(fh)
    if not isinstance(out, dict):
        raise ValueError(f"not a JSON object ({type(out).__name__})")
    return out


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


def _describe(layout: dict) -> str:
    s = f"pipeline_stages={layout['pipeline_stages']} data_parallel={layout['data_parallel']} " \
        f"zero_stage={layout['zero_stage']}" + (f" precision={layout['precision']}" if layout.get("precision") else "")
    if layout.get("stages"):
        s += " stages " + " | ".join(f"{st[0]}..{st[-1]}" for st in layout["stages"])
    return s


def same_layout(saved: dict, current: dict) -> bool:
    """Whether DeepSpeed's own per-stage files fit this run (else the layout-free path)."""
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


def tag_for(step: int) -> str:
    return f"global_step{step}"


def _rng_state() -> dict:
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if acc.device_name() != "cpu":
        state["device"] = acc.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from deepspeed.accelerator import get_accelerator
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "device" in state:
        get_accelerator().set_rng_state(state["device"])


COMPLETE_FILE = "COMPLETE"  # written by rank 0 once every rank has written every file of a checkpoint


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _step_of(tag: str) -> int:
    return int(tag[len("global_step"):]) if tag.startswith("global_step") and tag[11:].isdigit() else -1


def is_complete(tag_dir: str) -> bool:
    return os.path.isfile(os.path.join(tag_dir, COMPLETE_FILE))


def remove_partial(root: str) -> list:
    """Delete checkpoint directories newer than ``latest`` that were never completed (a run killed
    while saving); returns their names. Checkpoints up to ``latest`` are kept as they are."""
    if not os.path.isdir(root):
        return []
    latest = os.path.join(root, "latest")
    done = _step_of(open(latest).read().strip()) if os.path.isfile(latest) else -1
    gone = []
    for t in os.listdir(root):
        if _step_of(t) > done and not is_complete(os.path.join(root, t)):
            shutil.rmtree(os.path.join(root, t), ignore_errors=True)
            gone.append(t)
    return sorted(gone, key=_step_of)


def save(engine, root: str, step: int, client_state: dict, layer_names: Optional[list] = None,
         parts: Optional[list] = None, keep: int = 0, record: Optional[dict] = None,
         plain_optimizer: Optional[tuple] = None, exclude_frozen: bool = False) -> str:
    """DeepSpeed's checkpoint of ``engine`` at ``step`` plus this rank's RNG, the layer table and
    (rank 0) the run ``record`` with the step and the client state's data position. Atomic: after
    every rank has written all its files, rank 0 marks the directory complete, then moves
    ``latest`` to it (a rename); a run killed before that leaves ``latest`` on the previous
    complete checkpoint. ``exclude_frozen`` (a LoRA run's frozen base): the weights that never
    change are left out - a resume and ``load_weights`` take them from the run's config, as the run
    built them (``FROZEN_EXCLUDED`` in the record)."""
    tag = tag_for(step)
    engine.save_checkpoint(root, tag=tag, client_state=dict(client_state, step=step), save_latest=False,
                           exclude_frozen_parameters=exclude_frozen)
    if record is not None:
        record = {**record, FROZEN_EXCLUDED: bool(exclude_frozen)}
    rank = dist.get_rank() if dist.is_initialized() else 0
    d = os.path.join(root, tag)
    torch.save(_rng_state(), os.path.join(d, f"rng_rank{rank}.pt"))
    _test_die_in_save(step, rank)
    if rank == 0 and layer_names is not None:
        with open(os.path.join(d, LAYERS_FILE), "w") as fh:
            json.dump({"layers": layer_names, "parts": parts}, fh)
    if rank == 0 and record is not None:
        with open(os.path.join(d, RECORD_FILE), "w") as fh:
            json.dump({**record, "step": step, "data": client_state.get("data"),
                       "client": {k: v for k, v in client_state.items() if k != "data"}}, fh, indent=1)
    if plain_optimizer is not None:
        inner, named_params, stage, dp_rank = plain_optimizer
        save_plain_optimizer(engine, inner, named_params, d, stage, dp_rank)
    if dist.is_initialized():
        dist.barrier()  # every rank's files are written
    if rank == 0:
        files = sorted(os.listdir(d))
        _write_atomic(os.path.join(d, COMPLETE_FILE), json.dumps({"step": step, "files": files}))
        _write_atomic(os.path.join(root, "latest"), tag)
        if keep > 0:
            tags = sorted((t for t in os.listdir(root) if _step_of(t) >= 0 and is_complete(os.path.join(root, t))),
                          key=_step_of)
            for old in tags[:-keep]:
                shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()  # nobody continues (or exits) before latest names the new checkpoint
    return d


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
        out[f"{name}::fp32"] = fp32.detach().float().cpu().contiguous()
        for k, t in (moments or {}).items():
            out[f"{name}::{k}"] = t.detach().float().cpu().contiguous()
    if dp_rank == 0:
        save_file(out, os.path.join(tag_dir, OPTIM_FILE.format(stage)), metadata={"adam_step": str(_adam_step(inner))})
    return True


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
        fp32 = state.get(f"{name}::fp32", weights[name].float()).to(p.device)
        moments = ({k: state[f"{name}::{k}"].to(p.device) for k in ADAM_KEYS}
                   if f"{name}::exp_avg" in state else None)
        with torch.no_grad():  # the model's own (possibly low-precision, or ZeRO-3 partitioned) weight
            set_zero3_partition(p, fp32) if hasattr(p, "ds_id") else p.data.copy_(fp32.to(p.dtype))
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
    engine.global_steps = step
    engine.global_samples = step * engine.train_batch_size()


def _test_die_in_save(step: int, rank: int) -> None:
    """Test hook: ``MMPIPE_TEST_DIE_IN_SAVE=STEP:RANK`` kills that rank with SIGKILL (no cleanup)
    in the middle of that step's checkpoint, after its DeepSpeed files."""
    spec = os.environ.get("MMPIPE_TEST_DIE_IN_SAVE")
    if spec and spec == f"{step}:{rank}":
        import signal
        os.kill(os.getpid(), signal.SIGKILL)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_model(tag_dir: str, model: dict) -> None:
    """The checkpoint's record was written for this model config (one line naming what differs)."""
    record = read_record(tag_dir)
    if not record or "model" not in record:
        return
    saved, now = _flat(absolute_paths(record["model"])), _flat(absolute_paths(model))
    diff = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if diff:
        shown = ", ".join(f"model.{k}: {saved.get(k)!r} saved, {now.get(k)!r} now" for k in diff[:3])
        raise MmpipeError(f"--resume: {tag_dir} was saved by another model config ({shown}"
                          f"{' ...' if len(diff) > 3 else ''}); resume with the config it was trained with "
                          "(its config.yaml), or start a new train.output_dir")


def check_adapters(tag_dir: str, named_params, stages: Optional[list], aliases: dict) -> None:
    """A LoRA checkpoint (frozen base left out) loads non-strictly: only if every weight of this
    rank it lacks is a frozen one, every adapter it holds for this rank's layers is one of this
    run's, of the same shape (one line otherwise: resumed with other target modules, another rank
    or other frozen groups, its adapters would be dropped)."""
    saved = _readable(tag_dir, lambda: load_model_weights(os.path.dirname(tag_dir), os.path.basename(tag_dir)))
    from mmpipe.families.lora import is_adapter
    mine = dict(named_params)
    layers = None if not stages else [n for st in stages for n in st if any(k.startswith(n + ".") for k in mine)]
    missing = [n for n, p in mine.items() if p.requires_grad and n not in saved and aliases.get(n) not in saved]
    extra = [k for k in saved if k not in mine and is_adapter(k)
             and (layers is None or any(k.startswith(n + ".") for n in layers))]
    shape = [k for k in saved if k in mine and tuple(saved[k].shape) != tuple(mine[k].shape)]
    if missing or extra or shape:
        said = [f"{what} {', '.join(ks[:2])}{' ...' if len(ks) > 2 else ''}"
                for what, ks in (("lacks", missing), ("holds adapters this run has not:", extra),
                                 ("holds other shapes for", shape)) if ks]
        raise MmpipeError(f"--resume: {tag_dir} {'; '.join(said)}: resume with the LoRA settings it was trained with "
                          "(optim.target_modules, optim.lora_rank, the freeze_* flags: its config.yaml), or start a "
                          "new train.output_dir")


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
    if record.get(FROZEN_EXCLUDED, False) and current.get("frozen_base") is not None:
        check_base(record.get("frozen_base"), current["frozen_base"], tag_dir, "in the config resumed with",
                   "--resume: ")
    saved = ((record.get("client") or {}).get("data_position") or {}).get("packing")
    if saved is not None and packing is not None and bool(saved) != bool(packing):
        counts = "packs" if saved else "samples"
        raise MmpipeError(f"--resume: {tag_dir}'s data position counts {counts} (data.packing={str(saved).lower()}), "
                          f"this run has data.packing={str(packing).lower()}: the rest of its epoch cannot be found; "
                          f"resume with data.packing={str(saved).lower()}, or start a new train.output_dir")


def _readable(what: str, fn, prefix: str = "--resume: ", fix: str = "point latest at an earlier checkpoint"):
    """Run a checkpoint read; a corrupt or unreadable file becomes one line naming it."""
    try:
        return fn()
    except MmpipeError:
        raise
    except Exception as e:  # noqa: BLE001 - torch/DeepSpeed/safetensors read errors of damaged files
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise MmpipeError(f"{prefix}cannot read {what}: {type(e).__name__}: {first}; restore the file or "
                          f"{fix}") from None


def load(engine, root: str, layout: Optional[dict] = None, inner=None, named_params=None,
         aliases: Optional[dict] = None, model: Optional[dict] = None) -> dict:
    """Load the latest checkpoint into ``engine``: in the layout it was saved in, DeepSpeed's own
    files (and this rank's RNG); in another (P, DP, ZeRO stage, stage boundaries), the plain
    weights and layout-free optimizer state (``load_elsewhere``). Returns the client state."""
    tag_dir = os.path.join(root, latest_tag(root, prefix="--resume: "))
    check_complete(tag_dir)
    if model is not None:
        check_model(tag_dir, model)
    saved = saved_layout(root)
    record = read_record(tag_dir)
    if (record or {}).get(FROZEN_EXCLUDED, False) and named_params is not None:
        check_adapters(tag_dir, named_params, (layout or {}).get("stages"), aliases or {})
    if layout is not None and saved is not None and not same_layout(saved, layout):
        if not has_plain_optimizer(tag_dir):
            check_layout(saved, layout, tag_dir)
        client = record_client(record)
        _readable(tag_dir, lambda: load_elsewhere(engine, inner, named_params, tag_dir, client["step"], aliases))
        return client
    # a LoRA checkpoint leaves the frozen base out (the model's own, as built): non-strict, once
    # ``check_adapters`` found every missing weight frozen and every saved adapter in this run
    strict = not (record or {}).get(FROZEN_EXCLUDED, False)
    path, client = _readable(tag_dir, lambda: engine.load_checkpoint(root, load_lr_scheduler_states=True,
                                                                      load_optimizer_states=True,
                                                                      load_module_strict=strict))
    if path is None:
        raise MmpipeError(f"--resume: DeepSpeed could not load the checkpoint in {root}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng = os.path.join(tag_dir, f"rng_rank{rank}.pt")
    if os.path.isfile(rng):
        _readable(rng, lambda: _set_rng_state(torch.load(rng, weights_only=False)))
    # the run's records (bad samples, data position, counters) as rank 0 wrote them, the same on every rank
    return {**(client or {}), **(record_client(record) if record else {})}


def record_client(record: dict) -> dict:
    """What a checkpoint's record keeps of the run besides weights: the step, the bad-sample ledger
    (``data``) and every client field (data position, skipped steps, ...)."""
    return {**(record.get("client") or {}), "data": record.get("data") or {}, "step": int(record["step"])}


def check_complete(tag_dir: str, prefix: str = "--resume: ") -> None:
    """A checkpoint mmpipe marked complete holds every file it listed (one line naming what is
    missing otherwise); one saved before checkpoints were marked is taken as it is."""
    marker = os.path.join(tag_dir, COMPLETE_FILE)
    if not os.path.isdir(tag_dir):
        raise MmpipeError(f"{prefix}{tag_dir} (named by 'latest') does not exist; point latest at a complete "
                          "checkpoint" + (" or run without --resume" if prefix else ""))
    if not os.path.isfile(marker):
        return
    files = _readable(marker, lambda: _json_dict(marker).get("files", []), prefix=prefix)
    missing = [f for f in files if not os.path.exists(os.path.join(tag_dir, f))]
    if missing:
        raise MmpipeError(f"{prefix}checkpoint {tag_dir} is incomplete: {', '.join(missing[:4])}"
                          f"{' ...' if len(missing) > 4 else ''} missing; restore them, or point latest at an "
                          "earlier checkpoint")


def complete_tags(root: str) -> list:
    """The checkpoints of ``root`` marked complete, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted((t for t in os.listdir(root) if _step_of(t) >= 0 and is_complete(os.path.join(root, t))),
                  key=_step_of)


def point_latest(root: str) -> str:
    """How to continue from complete checkpoints that no ``latest`` file names ('' when there is none)."""
    tags = complete_tags(root)
    if not tags:
        return ""
    return (f"{root} has no 'latest' file but holds the complete checkpoint(s) {', '.join(tags[-4:])}: point latest "
            f"at one (echo {tags[-1]} > {os.path.join(root, 'latest')})")


def latest_tag(root: str, prefix: str = "") -> str:
    f = os.path.join(root, "latest")
    if not os.path.isfile(f):
        found = point_latest(root)
        if found:
            raise MmpipeError(f"{prefix}{found}" + (", then --resume" if prefix else ""))
        raise MmpipeError(f"{prefix}no checkpoint in {root} (no 'latest' file)"
                          + ("; run without --resume first" if prefix else ""))
    return open(f).read().strip()


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
    if not is_complete(tag_dir) and os.path.isfile(latest) and _step_of(tag) > _step_of(open(latest).read().strip()):
        raise MmpipeError(f"{tag_dir} is incomplete (no {COMPLETE_FILE} marker: the run stopped while saving it); "
                          "read an earlier step (--step) or the latest checkpoint")
    check_complete(tag_dir, prefix="")
    weights = _readable(tag_dir, lambda: load_model_weights(root, tag), prefix="",
                        fix="read an earlier checkpoint (--step)")
    record = read_record(tag_dir) or {}
    if record.get(FROZEN_EXCLUDED, False):
        weights = {**frozen_base(root, record.get("frozen_base"), tag_dir), **weights}
    return weights


def frozen_base(root: str, fingerprint: Optional[dict] = None, where: Optional[str] = None) -> dict:
    """The weights a LoRA checkpoint leaves out: the frozen base, rebuilt from the run's config as the
    run built it (pretrained directories, or the seeded init); ``fingerprint`` (the checkpoint's
    record of its pretrained directories) refuses another base in one line."""
    from mmpipe.config.registry import build_family
    from mmpipe.config.schema import load_config
    cfg_path = os.path.join(os.path.dirname(os.path.normpath(root)), "config.yaml")
    if not os.path.isfile(cfg_path):
        raise MmpipeError(f"{root}: the checkpoint holds the adapters only (a LoRA run) and the run's config.yaml, "
                          f"which rebuilds its frozen base, is not beside it ({cfg_path})")
    from mmpipe.families.lora import is_adapter
    cfg = load_config(cfg_path)
    check_base(fingerprint, base_fingerprint(cfg.to_dict()["model"]), where or root, cfg_path)
    model = build_family(cfg).plain_model()
    return {k: v for k, v in model.state_dict().items() if not is_adapter(k)}


def load_model_weights(root: str, tag: Optional[str] = None) -> dict:
    """State dict in the plain ``DualEncoder``'s names, from a checkpoint of any layout."""
    tag = tag or latest_tag(root)
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
