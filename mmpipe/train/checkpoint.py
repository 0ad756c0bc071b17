"""Checkpoints: DeepSpeed's own format (resumable with ``--resume``), plus what mmpipe adds: the
layer-name table of a pipelined run, each rank's RNG state, the run's record (the data position,
the step) and layout-free optimizer state; written atomically, read back in the layout they were
saved in or in another. The parts, by job: ``checkpoint_files`` (the directory: tags, ``COMPLETE``,
``latest``), ``checkpoint_record`` (what a checkpoint says about itself), ``resume_checks`` (what a
resume refuses), ``checkpoint_weights`` (the plain model's weights from any layout, no engine) and
``layout_free_state`` (optimizer state by parameter name, a resume in another layout)."""
from __future__ import annotations

import json
import os
import random
import shutil
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from mmpipe.errors import MmpipeError
from mmpipe.train.checkpoint_files import COMPLETE_FILE, check_complete, complete_tags, latest_tag, readable, \
    tag_for, write_atomic
from mmpipe.train.checkpoint_record import FROZEN_EXCLUDED, RECORD_FILE, read_record, record_client, saved_layout
from mmpipe.train.checkpoint_weights import LAYERS_FILE
from mmpipe.parallel.ds_compat import without_moe_checkpoint
from mmpipe.train.layout_free_state import has_plain_optimizer, load_elsewhere, save_expert_weights, save_plain_optimizer
from mmpipe.train.resume_checks import check_adapters, check_layout, check_model, same_layout


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
    with without_moe_checkpoint(engine):
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
        save_expert_weights(named_params, d, stage, dp_rank, exclude_frozen)
        save_plain_optimizer(engine, inner, named_params, d, stage, dp_rank)
    if dist.is_initialized():
        dist.barrier()  # every rank's files are written
    if rank == 0:
        files = sorted(os.listdir(d))
        write_atomic(os.path.join(d, COMPLETE_FILE), json.dumps({"step": step, "files": files}))
        write_atomic(os.path.join(root, "latest"), tag)
        if keep > 0:
            for old in complete_tags(root)[:-keep]:
                shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()  # nobody continues (or exits) before latest names the new checkpoint
    return d


def load(engine, root: str, layout: Optional[dict] = None, inner=None, named_params=None,
         aliases: Optional[dict] = None, model: Optional[dict] = None) -> dict:
    """Load the latest checkpoint into ``engine``: in the layout it was saved in, DeepSpeed's own
    files (and this rank's RNG); in another (P, DP, ZeRO stage, stage boundaries), the plain
    weights and layout-free optimizer state (``load_elsewhere``). Returns the client state. The
    AdamW kernel stays this run's (``keep_adamw_kernel``)."""
    return keep_adamw_kernel(inner, lambda: _load(engine, root, layout, inner, named_params, aliases, model))


def keep_adamw_kernel(inner, load):
    """``load()`` (a checkpoint into the torch optimizer ``inner``) with the kernel this run chose
    (``optim.fused``) kept: torch's ``load_state_dict`` takes the saved groups' ``fused`` / ``foreach``
    (a checkpoint saved by a CPU run would step a GPU run unfused), and each Adam ``step`` counter
    goes where the kernel reads it (torch's own policy: on the parameter's device, in float32, for
    the fused or capturable kernels; on the CPU otherwise: a layout-free resume makes it there)."""
    if inner is None:
        return load()
    kept = [{k: g[k] for k in ("fused", "foreach", "capturable") if k in g} for g in inner.param_groups]
    out = load()
    for g, flags in zip(inner.param_groups, kept):
        g.update(flags)
        on_device = bool(flags.get("fused") or flags.get("capturable"))
        for p in g["params"]:
            st = inner.state.get(p)
            if st and torch.is_tensor(st.get("step")):
                st["step"] = st["step"].to(dtype=torch.float32, device=p.device if on_device else torch.device("cpu"))
    return out


def _load(engine, root: str, layout: Optional[dict], inner, named_params, aliases: Optional[dict],
          model: Optional[dict]) -> dict:
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
        readable(tag_dir, lambda: load_elsewhere(engine, inner, named_params, tag_dir, client["step"], aliases))
        if same_layout({**saved, "expert_parallel": 1}, {**layout, "expert_parallel": 1}) and \
                saved.get("expert_parallel", 1) == layout.get("expert_parallel", 1):
            _restore_rng(tag_dir)  # (expert parallelism resumes by parameter name, on its own layout too)
        return client
    # a LoRA checkpoint leaves the frozen base out (the model's own, as built): non-strict, once
    # ``check_adapters`` found every missing weight frozen and every saved adapter in this run
    strict = not (record or {}).get(FROZEN_EXCLUDED, False)
    path, client = readable(tag_dir, lambda: engine.load_checkpoint(root, load_lr_scheduler_states=True,
                                                                     load_optimizer_states=True,
                                                                     load_module_strict=strict))
    if path is None:
        raise MmpipeError(f"--resume: DeepSpeed could not load the checkpoint in {root}")
    _restore_rng(tag_dir)
    # the run's records (bad samples, data position, counters) as rank 0 wrote them, the same on every rank
    return {**(client or {}), **(record_client(record) if record else {})}


def _restore_rng(tag_dir: str) -> None:
    """This rank's RNG state as saved (a checkpoint resumed on the layout that wrote it)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng = os.path.join(tag_dir, f"rng_rank{rank}.pt")
    if os.path.isfile(rng):
        readable(rng, lambda: _set_rng_state(torch.load(rng, weights_only=False)))


def _test_die_in_save(step: int, rank: int) -> None:
    """Test hook: ``MMPIPE_TEST_DIE_IN_SAVE=STEP:RANK`` kills that rank with SIGKILL (no cleanup)
    in the middle of that step's checkpoint, after its DeepSpeed files."""
    spec = os.environ.get("MMPIPE_TEST_DIE_IN_SAVE")
    if spec and spec == f"{step}:{rank}":
        import signal
        os.kill(os.getpid(), signal.SIGKILL)
