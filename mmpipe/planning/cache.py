"""Where measurements are cached between runs (``MMPIPE_CACHE``, else ~/.cache/mmpipe), written atomically."""
from __future__ import annotations

import os


def cache_dir() -> str:
    return os.environ.get("MMPIPE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "mmpipe", "profiles"))


def _write_json(path: str, obj: dict) -> None:
    import json
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + f".{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
    os.replace(tmp, path)
