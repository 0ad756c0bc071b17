"""Image-caption manifests: JSONL (``{"image": path, "text": caption}`` per line; ``image_path`` /
``caption`` accepted) or CSV with a header naming those columns. Image paths are relative to the
manifest's directory unless absolute."""
from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass

from mmpipe.errors import DataError

IMAGE_KEYS = ("image", "image_path", "file", "filepath")
TEXT_KEYS = ("text", "caption", "title")


@dataclass(frozen=True)
class Sample:
    image: str
    text: str


def _pick(row: dict, keys, where: str, what: str):
    for k in keys:
        if k in row and row[k] is not None:
            return str(row[k])
    raise DataError(f"{where}: no {what} field (expected one of {', '.join(keys)})")


def require_manifest(path: str, key: str = "data.train") -> None:
    if not path:
        raise DataError(f"{key} is not set: point it at a .jsonl or .csv manifest (mmpipe data synth --out DIR makes one)")
    if not os.path.isfile(path):
        raise DataError(f"{key}: manifest not found: {path} (fix the path, or run mmpipe data synth --out DIR)")


def read_manifest(path: str, key: str = "data.train") -> list[Sample]:
    require_manifest(path, key)
    base = os.path.dirname(os.path.abspath(path))
    rows = []
    if path.endswith(".csv") or path.endswith(".tsv"):
        with open(path, newline="") as fh:
            reader = csv.DictReader(fh, delimiter="\t" if path.endswith(".tsv") else ",")
            for i, row in enumerate(reader, start=2):
                rows.append((f"{path} line {i}", row))
    else:
        with open(path) as fh:
            for i, line in enumerate(fh, start=1):
                line = line.strip()
                if not line:
                    continue
                try:
                    rows.append((f"{path} line {i}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path} line {i}: not valid JSON ({e.msg})") from None
    samples = []
    for where, row in rows:
        image = _pick(row, IMAGE_KEYS, where, "image")
        text = _pick(row, TEXT_KEYS, where, "caption")
        samples.append(Sample(image if os.path.isabs(image) else os.path.join(base, image), text))
    if not samples:
        raise DataError(f"{key}: manifest {path} has no samples")
    return samples
