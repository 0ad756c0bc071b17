"""Checkpoints: DeepSpeed's own format (resumable with ``--resume``), plus what mmpipe adds:
the layer-name table of a pipelined run, each rank's RNG state, and the data position (the step).
``load_model_weights`` reads any layout's checkpoint back into the plain model's names."""
from __future__ import annotations

import glob
import json
import os
import random
import shutil
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from mmpipe.errors import MmpipeError
from mmpipe.pipeline.layers import plain_state_key

LAYERS_FILE = "mmpipe_layers.json"
RECORD_FILE = "mmpipe_checkpoint.json"  # self-describing: family, model config, layout, step, data, versions


def layout_record(topo, cfg, layer_names: Optional[list], parts: Optional[list]) -> dict:
    """What a checkpoint's DeepSpeed files are tied to: stages, their layers, data-parallel degree
    (with ZeRO, optimizer state is partitioned over it) and ZeRO stage."""
    from mmpipe.pipeline.partition import stage_lists
    return {"pipeline_stages": topo.pipeline_stages, "data_parallel": topo.data_parallel,
            "zero_stage": cfg.parallel.zero_stage, "placement": cfg.parallel.placement,
            "stages": stage_lists(layer_names, parts) if layer_names is not None else None}


def run_record(cfg, layout: dict, plan: Optional[dict] = None) -> dict:
    """What every checkpoint of a run records besides its step and data position: the model family,
    the resolved model config, the layout (stages, topology), the plan (``plan.json``'s schema) and
    the versions that wrote it."""
    import deepspeed
    import transformers

    from mmpipe._version import __version__
    return {"format": 1, "family": cfg.model.type, "model": cfg.to_dict()["model"], "layout": layout, "plan": plan,
            "versions": {"mmpipe": __version__, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
                         "transformers": transformers.__version__}}


def read_record(tag_dir: str) -> Optional[dict]:
    path = os.path.join(tag_dir, RECORD_FILE)
    if not os.path.isfile(path):
        return None  # written by an mmpipe before the record existed
    with open(path) as fh:
        return json.load(fh)


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
        f"zero_stage={layout['zero_stage']}"
    if layout.get("stages"):
        s += " stages " + " | ".join(f"{st[0]}..{st[-1]}" for st in layout["stages"])
    return s


def check_layout(saved: dict, current: dict, where: str) -> None:
    """Same-layout resume only (DeepSpeed's per-stage files): say what the checkpoint holds."""
    keys = ["pipeline_stages", "zero_stage", "stages"] + (["data_parallel"] if saved["zero_stage"] > 0 else [])
    if any(saved.get(k) != current.get(k) for k in keys):
        raise MmpipeError(f"--resume: {where} was saved with {_describe(saved)} (placement {saved['placement']}); "
                          f"this run has {_describe(current)}: resume with the checkpoint's layout "
                          "(parallel.pipeline_stages, parallel.placement or parallel.plan, parallel.zero_stage and the "
                          "number of ranks); resuming on another layout is not supported yet")


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
         parts: Optional[list] = None, keep: int = 0, record: Optional[dict] = None) -> str:
    """DeepSpeed's checkpoint of ``engine`` at ``step`` plus this rank's RNG, the layer table and
    (rank 0) the run ``record`` with the step and the client state's data position. Atomic: after
    every rank has written all its files, rank 0 marks the directory complete, then moves
    ``latest`` to it (a rename); a run killed before that leaves ``latest`` on the previous
    complete checkpoint."""
    tag = tag_for(step)
    engine.save_checkpoint(root, tag=tag, client_state=dict(client_state, step=step), save_latest=False)
    rank = dist.get_rank() if dist.is_initialized() else 0
    d = os.path.join(root, tag)
    torch.save(_rng_state(), os.path.join(d, f"rng_rank{rank}.pt"))
    _test_die_in_save(step, rank)
    if rank == 0 and layer_names is not None:
        with open(os.path.join(d, LAYERS_FILE), "w") as fh:
            json.dump({"layers": layer_names, "parts": parts}, fh)
    if rank == 0 and record is not None:
        with open(os.path.join(d, RECORD_FILE), "w") as fh:
            json.dump({**record, "step": step, "data": client_state.get("data")}, fh, indent=1)
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


def _test_die_in_save(step: int, rank: int) -> None:
    """Test hook: ``MMPIPE_TEST_DIE_IN_SAVE=STEP:RANK`` ends that rank abruptly (no cleanup, as
    kill -9 does) in the middle of that step's checkpoint, after its DeepSpeed files."""
    spec = os.environ.get("MMPIPE_TEST_DIE_IN_SAVE")
    if spec and spec == f"{step}:{rank}":
        os._exit(137)


def load(engine, root: str, layout: Optional[dict] = None) -> dict:
    """Load the latest checkpoint into ``engine`` (after checking it was saved in ``layout``);
    restore this rank's RNG. Returns client state."""
    if not os.path.isfile(os.path.join(root, "latest")):
        raise MmpipeError(f"--resume: no checkpoint in {root} (no 'latest' file); run without --resume first")
    tag_dir = os.path.join(root, latest_tag(root))
    check_complete(tag_dir)
    saved = saved_layout(root)
    if layout is not None and saved is not None:
        check_layout(saved, layout, os.path.join(root, latest_tag(root)))
    path, client = engine.load_checkpoint(root, load_lr_scheduler_states=True, load_optimizer_states=True)
    if path is None:
        raise MmpipeError(f"--resume: DeepSpeed could not load the checkpoint in {root}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    tag_dir = os.path.join(root, open(os.path.join(root, "latest")).read().strip())
    rng = os.path.join(tag_dir, f"rng_rank{rank}.pt")
    if os.path.isfile(rng):
        _set_rng_state(torch.load(rng, weights_only=False))
    return client or {}


def check_complete(tag_dir: str) -> None:
    """A checkpoint mmpipe marked complete holds every file it listed (one line naming what is
    missing otherwise); one saved before checkpoints were marked is taken as it is."""
    marker = os.path.join(tag_dir, COMPLETE_FILE)
    if not os.path.isdir(tag_dir):
        raise MmpipeError(f"--resume: {tag_dir} (named by 'latest') does not exist; point latest at a complete "
                          "checkpoint or run without --resume")
    if not os.path.isfile(marker):
        return
    with open(marker) as fh:
        files = json.load(fh).get("files", [])
    missing = [f for f in files if not os.path.exists(os.path.join(tag_dir, f))]
    if missing:
        raise MmpipeError(f"--resume: checkpoint {tag_dir} is incomplete: {', '.join(missing[:4])}"
                          f"{' ...' if len(missing) > 4 else ''} missing; restore them, or point latest at an "
                          "earlier checkpoint")


def latest_tag(root: str) -> str:
    f = os.path.join(root, "latest")
    if not os.path.isfile(f):
        raise MmpipeError(f"no checkpoint in {root} (no 'latest' file)")
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
    return load_model_weights(root, tag)


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
