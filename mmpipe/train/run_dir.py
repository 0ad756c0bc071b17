"""TODO docstring."""
from __future__ import annotations
import os
from mmpipe.errors import ConfigError


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
        raise ConfigError(f"train.output_dir={out_dir} already holds a run without a checkpoint ({', '.join(held)}): "
                          "replace it with --overwrite, or set another train.output_dir")


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
