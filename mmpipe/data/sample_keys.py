"""What a micro-batch says of its samples for dropout drawn per sample (``mmpipe.parallel.sample_rng``):
every collate adds ``row_keys`` and ``image_keys`` (its samples' keys with their tokens per row, each
image's key with its patches), so a sample's masks follow the sample wherever it is batched."""
from __future__ import annotations

import zlib

import torch

from mmpipe.parallel.sample_rng import IMAGE_KEYS, ROW_KEYS, mix


def sample_key(index: int, name: str = "") -> int:
    """A sample's key: its row in the data set (every layout draws the same rows), or for a stream
    without indices (tar shards: -1) a checksum of its name."""
    return int(index) if int(index) >= 0 else zlib.crc32(str(name).encode()) + (1 << 40)


def image_key(sample: int, ordinal: int) -> int:
    """The key of a sample's ``ordinal``-th image."""
    return mix(sample, ordinal + 1)


def key_fields(rows: list, images: list) -> dict:
    """The micro-batch's key tensors: ``rows`` [[(key, tokens), ...] per row], ``images`` [(key, patches)]."""
    width = max([len(r) for r in rows] + [1])
    rk = torch.full((len(rows), width, 2), -1, dtype=torch.int64)
    rk[..., 1] = 0
    for i, segs in enumerate(rows):
        for j, (k, n) in enumerate(segs):
            rk[i, j, 0], rk[i, j, 1] = int(k), int(n)
    ik = torch.tensor([[int(k), int(n)] for k, n in images], dtype=torch.int64).reshape(-1, 2)
    return {ROW_KEYS: rk, IMAGE_KEYS: ik}
