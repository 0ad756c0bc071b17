"""``mmpipe data check --manifest M``: every row read and every image decoded exactly as training
reads them (``read_manifest`` + ``decode_sample`` at the run's decode size), each row reported for
itself (no substitution), before a long run finds out.

Per row: ``line``, ``image`` (the path training opens), ``text`` (the caption training sees),
``status`` (ok / bad), ``why``, and for a decoded image its ``width`` and ``height`` (upright, at
full resolution), ``mode`` (as stored in the file: RGB, L, P, RGBA, I;16, CMYK, ...) and ``mean``
(the mean 0-255 value of the decode-size RGB image training gets: centre square, resized).
"""
from __future__ import annotations

import json
import sys
from typing import Iterator

from mmpipe.data.decode import decode_sample
from mmpipe.data.manifest import read_manifest
from mmpipe.data.processes import pool_context

_W: dict = {}  # worker side: the decode size


def check_sample(s, size: int) -> dict:
    rec = {"line": s.line, "image": s.image or None, "text": None if s.error else s.text, "status": "bad",
           "why": s.error, "width": None, "height": None, "mode": None, "mean": None}
    if s.error is not None:
        return rec
    info: dict = {}
    pixels, why = decode_sample(s.image, s.text, size, info)
    if pixels is None:
        rec["why"] = why
        return rec
    rec.update(status="ok", width=info.get("width"), height=info.get("height"), mode=info.get("mode"),
               mean=round(float(pixels.float().mean()), 2))
    return rec


def _init(size: int) -> None:
    import torch
    torch.set_num_threads(1)
    _W["size"] = size


def _chunk(samples: list) -> list:
    return [check_sample(s, _W["size"]) for s in samples]


def check_rows(samples: list, size: int, workers: int = 1) -> Iterator[dict]:
    """One record per sample, in manifest order; decoded in ``workers`` processes when > 1."""
    chunk = max(1, min(32, len(samples) // (4 * max(1, workers))))
    if workers <= 1 or len(samples) < 2:
        for s in samples:
            yield check_sample(s, size)
        return
    ctx = pool_context("mmpipe.data.check")  # (not a plain fork: see mmpipe.data.processes)
    with ctx.Pool(workers, _init, (size,)) as pool:
        for recs in pool.imap(_chunk, [samples[k:k + chunk] for k in range(0, len(samples), chunk)]):
            yield from recs


def run_check(manifest: str, size: int, max_bad_fraction: float, as_json: bool = False, workers: int = 1,
              out=None, err=None) -> int:
    """Report every row; 0 when the unusable fraction is within ``max_bad_fraction``, else 1."""
    from tqdm import tqdm

    out, err = out or sys.stdout, err or sys.stderr
    samples = read_manifest(manifest, "--manifest", require_usable=False)
    n, bad = len(samples), 0
    for rec in tqdm(check_rows(samples, size, workers), total=n, unit="row", desc=f"check {manifest}",
                    file=err, disable=None, mininterval=1.0):
        if rec["status"] != "ok":
            bad += 1
        if as_json:
            out.write(json.dumps(rec, ensure_ascii=False) + "\n")
        elif rec["status"] != "ok":
            image = "" if rec["text"] is None else f"{rec['image']}: "  # a bad manifest row: no image to name
            out.write(f"{manifest} line {rec['line']}: {image}{rec['why']}\n")
    summary = f"{manifest}: {n} rows, {n - bad} usable, {bad} unusable ({100 * bad / n:.1f}%)"
    print(summary, file=err if as_json else out, flush=True)
    if bad > max_bad_fraction * n:
        print(f"mmpipe: error: {bad} of {n} rows of {manifest} are unusable ({100 * bad / n:.1f}%), over "
              f"data.max_bad_fraction={max_bad_fraction}: fix or drop them, or raise the limit", file=err, flush=True)
        return 1
    return 0

