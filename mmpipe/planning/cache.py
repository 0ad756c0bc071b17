"""Where measurements are cached between runs (``MMPIPE_CACHE``, else ~/.cache/mmpipe), written atomically (``data.json_files``)."""
from __future__ import annotations

import os


def cache_dir() -> str:
    return os.environ.get("MMPIPE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "mmpipe", "profiles"))

