"""A run's checkpoint directory: one ``global_stepN`` directory per checkpoint, its ``COMPLETE``
marker, the ``latest`` file naming the one to resume, and reads that fail in one line."""
from __future__ import annotations

import json
import os
import shutil

from mmpipe.errors import MmpipeError

COMPLETE_FILE = "COMPLETE"  # written by rank 0 once every rank has written every file of a checkpoint


def tag_for(step: int) -> str:
    return f"global_step{step}"


def step_of(tag: str) -> int:
    return int(tag[len("global_step"):]) if tag.startswith("global_step") and tag[11:].isdigit() else -1


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def json_dict(path: str) -> dict:
    with open(path) as fh:
        out = json.load(fh)
    if not isinstance(out, dict):
        raise ValueError(f"not a JSON object ({type(out).__name__})")
    return out


def readable(what: str, fn, prefix: str = "--resume: ", fix: str = "point latest at an earlier checkpoint"):
    """Run a checkpoint read; a corrupt or unreadable file becomes one line naming it."""
    try:
        return fn()
    except MmpipeError:
        raise
    except Exception as e:  # noqa: BLE001 - torch/DeepSpeed/safetensors read errors of damaged files
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise MmpipeError(f"{prefix}cannot read {what}: {type(e).__name__}: {first}; restore the file or "
                          f"{fix}") from None


def is_complete(tag_dir: str) -> bool:
    return os.path.isfile(os.path.join(tag_dir, COMPLETE_FILE))


def remove_partial(root: str) -> list:
    """Delete checkpoint directories newer than ``latest`` that were never completed (a run killed
    while saving); returns their names. Checkpoints up to ``latest`` are kept as they are."""
    if not os.path.isdir(root):
        return []
    latest = os.path.join(root, "latest")
    done = step_of(open(latest).read().strip()) if os.path.isfile(latest) else -1
    gone = []
    for t in os.listdir(root):
        if step_of(t) > done and not is_complete(os.path.join(root, t)):
            shutil.rmtree(os.path.join(root, t), ignore_errors=True)
            gone.append(t)
    return sorted(gone, key=step_of)


def check_complete(tag_dir: str, prefix: str = "--resume: ") -> None:
    """A checkpoint mmpipe marked complete holds every file it listed (one line naming what is
    missing otherwise); one saved before checkpoints were marked is taken as it is."""
    marker = os.path.join(tag_dir, COMPLETE_FILE)
    if not os.path.isdir(tag_dir):
        raise MmpipeError(f"{prefix}{tag_dir} (named by 'latest') does not exist; point latest at a complete "
                          "checkpoint" + (" or run without --resume" if prefix else ""))
    if not os.path.isfile(marker):
        return
    missing = readable(marker, lambda: missing_files(tag_dir), prefix=prefix)
    if missing:
        raise MmpipeError(f"{prefix}checkpoint {tag_dir} is incomplete: {', '.join(missing[:4])}"
                          f"{' ...' if len(missing) > 4 else ''} missing; restore them, or point latest at an "
                          "earlier checkpoint")


def missing_files(tag_dir: str) -> list:
    """The files a checkpoint's ``COMPLETE`` marker lists that are not there (a damaged checkpoint)."""
    files = json_dict(os.path.join(tag_dir, COMPLETE_FILE)).get("files", [])
    return [f for f in files if not os.path.exists(os.path.join(tag_dir, f))]


def usable(tag_dir: str) -> bool:
    """Marked complete, its marker readable and every file it lists present."""
    try:
        return is_complete(tag_dir) and not missing_files(tag_dir)
    except (OSError, ValueError):
        return False


def complete_tags(root: str) -> list:
    """The checkpoints of ``root`` marked complete, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted((t for t in os.listdir(root) if step_of(t) >= 0 and is_complete(os.path.join(root, t))),
                  key=step_of)


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
