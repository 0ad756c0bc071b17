"""The run directory: refuse to overwrite a run by accident, clear it with ``--overwrite``, remove a
checkpoint left incomplete by a run killed while saving before ``--resume``, and find where
``--resume auto`` continues (``resume_point``)."""
from __future__ import annotations

import os
from typing import Optional

import yaml

from mmpipe.errors import ConfigError
from mmpipe.parallel.plan import stage_lists
from mmpipe.train.checkpoint_files import complete_tags, is_complete, point_latest, remove_partial, step_of, usable, \
    write_atomic
from mmpipe.train.checkpoint_record import absolute_paths
from mmpipe.train.faults import _warn
from mmpipe.train.metrics import MetricsWriter, NullWriter


def check_run_dir(out_dir: str, resume: bool, overwrite: bool) -> None:
    """A fresh run never mixes with an earlier run's files: a run directory that already holds a run
    is continued (--resume), replaced (--overwrite) or refused in one line."""
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: --resume continues the run in "
                          f"train.output_dir={out_dir}, --overwrite deletes it")
    if resume or overwrite or not os.path.isdir(out_dir):
        return
    held = [f for f in RUN_FILES if os.path.exists(os.path.join(out_dir, f))]
    if held:
        latest = os.path.join(out_dir, "checkpoints", "latest")
        if os.path.isfile(latest):
            raise ConfigError(f"train.output_dir={out_dir} already holds a run (checkpoint "
                              f"{open(latest).read().strip()}): continue it with --resume, replace it with --overwrite, "
                              "or set another train.output_dir")
        found = point_latest(os.path.join(out_dir, "checkpoints"))
        if found:  # a run that lost its 'latest' file: --overwrite would delete its checkpoints
            raise ConfigError(f"train.output_dir={out_dir} already holds a run: {found} and continue it with --resume "
                              "(--overwrite would delete them), or set another train.output_dir")
        raise ConfigError(f"train.output_dir={out_dir} already holds a run without a checkpoint ({', '.join(held)}): "
                          "replace it with --overwrite, or set another train.output_dir")


def resume_point(out_dir: str) -> Optional[str]:
    """Where ``train.resume: auto`` continues: the newest checkpoint of ``out_dir`` marked complete
    with every file it lists present (one left partial by a kill while saving, or damaged since, is
    passed over); of a run saved before checkpoints were marked, the one 'latest' names. ``None``: a
    fresh start, where no checkpoint was ever completed (one line where only damaged ones are)."""
    root = os.path.join(out_dir, "checkpoints")
    marked = complete_tags(root)
    for tag in reversed(marked):
        if usable(os.path.join(root, tag)):
            return tag
    if marked:
        raise ConfigError(f"train.resume=auto: {root} holds the checkpoint(s) {', '.join(marked[-4:])}, each missing "
                          "files its COMPLETE marker lists: restore them, or start afresh with --overwrite")
    latest = os.path.join(root, "latest")
    if os.path.isfile(latest):
        tag = open(latest).read().strip()
        if os.path.isdir(os.path.join(root, tag)):
            return tag
    return None


def take_resume_point(out_dir: str, tag: str) -> None:
    """Rank 0, ``train.resume: auto``: 'latest' names ``tag``, and a newer checkpoint it passed over as
    damaged (marked complete, a listed file missing) is set aside as ``damaged-<tag>``, so that no later
    save lands in a directory holding an earlier save's files (a partial one: ``remove_partial``)."""
    import shutil
    root = os.path.join(out_dir, "checkpoints")
    latest = os.path.join(root, "latest")
    if not os.path.isfile(latest) or open(latest).read().strip() != tag:
        write_atomic(latest, tag)
    for t in os.listdir(root):
        path = os.path.join(root, t)
        if step_of(t) > step_of(tag) and is_complete(path):
            aside = os.path.join(root, f"damaged-{t}")
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(path, aside)
            _warn(f"train.resume=auto: {path} is missing files its COMPLETE marker lists: set aside as {aside}; "
                  f"continuing from {tag}")


def clear_run_dir(out_dir: str, keep=()) -> None:
    """Remove an earlier run's files, except those the new run's config reads (``keep``: e.g. a
    ``data.tokenizer`` or ``parallel.plan`` inside the directory)."""
    import shutil
    kept = {os.path.realpath(k) for k in keep if k}
    for f in RUN_FILES:
        path = os.path.join(out_dir, f)
        real = os.path.realpath(path)
        if any(k == real or k.startswith(real + os.sep) for k in kept):
            continue
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


# what a run writes into its directory (--overwrite removes exactly these)
RUN_FILES = ("checkpoints", "metrics.jsonl", "tokenizer", "config.yaml", "ds_config.json", "plan.json", "samples",
             "trace.json", "timeline.png", "tb", "layout.json")


def prepare_run_dir(cfg, rank: int, resume: bool, overwrite: bool, auto: Optional[tuple] = None) -> None:
    """Rank 0: clear (``--overwrite``, keeping inputs that live inside it) or create the run
    directory; on ``--resume`` remove a partial checkpoint, which is never loaded. ``auto``:
    ``(checkpoint or None,)`` where ``train.resume: auto`` chose (a fresh start replaces a run that
    never completed a checkpoint)."""
    if rank != 0:
        return
    out_dir, c = cfg.train.output_dir, cfg
    if auto is not None:
        print("[mmpipe] train.resume=auto: " + (f"continuing from {out_dir}/checkpoints/{auto[0]}" if auto[0] else
                                                 f"no complete checkpoint in {out_dir}: a fresh start"), flush=True)
        held = [f for f in RUN_FILES if os.path.exists(os.path.join(out_dir, f))] if not auto[0] else []
        if held:
            _warn(f"train.resume=auto: replacing {', '.join(held)} in {out_dir} (a run that never completed a checkpoint)")
    if overwrite:
        clear_run_dir(out_dir, keep=(c.data.tokenizer, c.parallel.plan, c.data.cache, c.train.deepspeed_config))
    os.makedirs(out_dir, exist_ok=True)
    if auto is not None and auto[0]:
        take_resume_point(out_dir, auto[0])
    if resume:
        ckpt_dir = os.path.join(out_dir, "checkpoints")
        for tag in remove_partial(ckpt_dir):
            _warn(f"removed the incomplete checkpoint {ckpt_dir}/{tag} (the run stopped while saving it)")


def note_schedule(plan_file: str, plan, start_step: int) -> None:
    """A resume under another schedule: ``plan.json`` names the order the run runs now (``schedule``,
    ``frozen_stages``) and, in ``schedule_segments``, which order ran from which step."""
    import json
    with open(plan_file) as fh:
        doc = json.load(fh)
    if doc.get("schedule") == plan.schedule and doc.get("frozen_stages", 0) == plan.frozen_stages:
        return
    segments = doc.get("schedule_segments") or [{"from_step": 1, "schedule": doc.get("schedule")}]
    doc["schedule_segments"] = segments + [{"from_step": start_step + 1, "schedule": plan.schedule}]
    doc["schedule"], doc["frozen_stages"] = plan.schedule, plan.frozen_stages
    with open(plan_file, "w") as fh:
        json.dump(doc, fh, indent=2)


def write_run_files(run, eng, start_step: int):
    """config.yaml, ds_config.json, layout.json, plan.json (rank 0); returns the metrics writer
    (the reporting rank's; a null writer elsewhere) after its opening lines."""
    import json

    cfg, out = run.cfg, run.out_dir
    writer = (MetricsWriter(out, cfg.train.steps, start_step, progress=cfg.log.progress,
                            tensorboard=cfg.log.tensorboard, every=cfg.log.every) if run.is_reporter else NullWriter())
    if run.rank == 0:
        # pretrained directories as absolute paths: export, generate, load_weights and a resume rebuild
        # the model (a LoRA run's frozen base) from them, from any working directory
        saved = cfg.to_dict()
        saved["model"] = absolute_paths(saved["model"])
        for key in ("tokenizer", "cache"):
            if saved["data"].get(key):
                saved["data"][key] = os.path.abspath(saved["data"][key])
        for dotted, pin in getattr(cfg, "hub", {}).items():  # hub ids as org/name@commit: the same snapshot again
            node = saved
            *parents, last = dotted.split(".")
            for part in parents:
                node = node[part]
            node[last] = pin
        with open(os.path.join(out, "config.yaml"), "w") as fh:
            yaml.safe_dump(saved, fh, sort_keys=False)
        with open(os.path.join(out, "ds_config.json"), "w") as fh:
            json.dump(run.where.ds_cfg, fh, indent=2)
        if run.layout_doc is not None:  # parallel.layout=auto: what it chose and why
            with open(os.path.join(out, "layout.json"), "w") as fh:
                json.dump(run.layout_doc, fh, indent=1)
        plan_file = os.path.join(out, "plan.json")
        if eng.layer_names is not None and not (run.resume and os.path.isfile(plan_file)):
            run.plan.write(plan_file)
        elif eng.layer_names is not None:  # a resume keeps the plan (and its predictions) it continues
            note_schedule(plan_file, run.plan, start_step)
    writer.info(f"{run.topo.describe()} precision={cfg.train.precision} zero={cfg.parallel.zero_stage} "
                f"device={run.device_name}" + (f" resume@{start_step}" if run.resume else ""))
    if eng.layer_names is not None:
        for s, names in enumerate(stage_lists(eng.layer_names, eng.parts)):
            fo = ", forward-only" if all(n in run.frozen.forward_only for n in names) else ""
            writer.info(f"stage {s}: {names[0]} .. {names[-1]} ({len(names)} layers{fo})")
    return writer
