"""JSON files written atomically (a temporary file of this process, then renamed): a reader - another rank, the next
run - sees the old file or the new one, never half of one."""
from __future__ import annotations

import json
import os


def write_json(path: str, obj, indent: int = 1) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + f".{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=indent)
    os.replace(tmp, path)
