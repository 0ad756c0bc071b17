"""``mmpipe bench data``: the image/text data path against a naive PIL + per-sample tokenizer loader."""
from __future__ import annotations

import json
import os
import shlex
import sys

from mmpipe.bench.common import append_benchmarks, with_scratch
from mmpipe.data import decode
from mmpipe.data.cache import CachedDataset, prepare
from mmpipe.data.loader import Collate, ImageTextDataset
from mmpipe.data.manifest import Sample
from mmpipe.data.pixels import SquarePixels
from mmpipe.data.tokenizer import train_tokenizer


def make_photos(out: str, n: int, width: int = 640, height: int = 480, seed: int = 0) -> list:
    """Photographic-ish JPEGs (smooth gradients, blobs and sensor-like noise), quality 90."""
    import numpy as np
    from PIL import Image
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    paths = []
    for i in range(n):
        c = rng.uniform(0, 255, (3, 3))
        img = (c[:, 0] * (x / width)[..., None] + c[:, 1] * (y / height)[..., None] + c[:, 2]) / 2
        for _ in range(4):
            cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(30, 150)
            img += rng.uniform(-80, 80, 3) * np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))[..., None]
        img += rng.normal(0, 12, img.shape)
        p = os.path.join(out, f"{i:05d}.jpg")
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(p, quality=90)
        paths.append(p)
    return paths


class _NaiveDataset:
    """The baseline users write first: full decode, resize to 224, ToTensor, normalize, pad to 512."""

    def __init__(self, samples, tokenizer):
        from torchvision import transforms
        self.samples, self.tok = samples, tokenizer
        self.tf = transforms.Compose([transforms.Resize(224), transforms.CenterCrop(224), transforms.ToTensor(),
                                      transforms.Normalize((0.481, 0.458, 0.408), (0.269, 0.261, 0.276))])

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        from PIL import Image
        s = self.samples[i]
        with Image.open(s.image) as im:
            x = self.tf(im.convert("RGB"))
        ids = self.tok(s.text, padding="max_length", max_length=512, truncation=True, return_tensors="pt")
        return x, ids["input_ids"][0]


def _images_per_sec(loader, n: int) -> float:
    import time
    t0 = time.perf_counter()
    seen = 0
    for batch in loader:
        seen += len(batch["index"]) if isinstance(batch, dict) else len(batch[0])
    assert seen == n, (seen, n)
    return n / (time.perf_counter() - t0)


@with_scratch("data")
def bench_data(args, tmp: str) -> int:
    """(a) naive per-sample path vs (b) mmpipe's direct path vs (c) its preprocessed cache, images/s
    through a DataLoader, in one run."""
    import time

    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    print(f"[bench] writing {args.n} JPEGs of {args.width}x{args.height} ...", flush=True)
    paths = make_photos(os.path.join(tmp, "img"), args.n, args.width, args.height)
    words = ["a", "photo", "of", "red", "blue", "gradient", "sky", "over", "the", "hills", "with", "soft", "light"]
    samples = [Sample(p, " ".join(words[j % len(words)] for j in range(i % 20 + 3))) for i, p in enumerate(paths)]
    manifest = os.path.join(tmp, "train.jsonl")
    with open(manifest, "w") as fh:
        for s in samples:
            fh.write(json.dumps({"image": s.image, "text": s.text}) + "\n")
    tok = train_tokenizer([s.text for s in samples], 200, os.path.join(tmp, "tok"))
    print("[bench] mmpipe data prepare (the cache for (c)) ...", flush=True)
    t0 = time.perf_counter()
    prepare(manifest, os.path.join(tmp, "cache"), 224, 32, tokenizer=os.path.join(tmp, "tok"), workers=args.workers)
    prepare_rate = args.n / (time.perf_counter() - t0)
    kw = dict(batch_size=32, num_workers=args.workers, persistent_workers=False)
    loaders = {
        "(a) naive: full decode, Resize/ToTensor/Normalize, pad to 512": DataLoader(_NaiveDataset(samples, tok), **kw),
        "(b) mmpipe direct: reduced-size JPEG decode, uint8, pad to batch": DataLoader(
            ImageTextDataset(samples, SquarePixels(224)), collate_fn=Collate(tok, 32), **kw),
        "(c) mmpipe cache: memory-mapped uint8 + token ids": DataLoader(
            CachedDataset(os.path.join(tmp, "cache"), SquarePixels(224)), collate_fn=Collate(tok, 32), **kw),
    }
    results = {name: [] for name in loaders}
    for _ in range(args.repeats):  # alternate, keep the best: less exposed to the shared machine's noise
        for name, ldr in loaders.items():
            results[name].append(_images_per_sec(ldr, args.n))
    base = max(next(iter(results.values())))
    lines = ["| path | images/s (best of %d) | vs (a) |" % args.repeats, "|---|---|---|"]
    for name, vals in results.items():
        lines.append(f"| {name} | {max(vals):.1f} | {max(vals) / base:.2f}x |")
    table = "\n".join(lines)
    print(table)
    notes = (f"{args.n} JPEGs {args.width}x{args.height}, quality 90 (gradients, blobs, noise), target 224x224, "
             f"batch 32, {args.workers} loader workers, 1 torch thread; JPEG decoder for (b): "
             f"{'simplejpeg (libjpeg-turbo) with DCT scaling' if _has_simplejpeg() else 'Pillow draft'}, "
             "resize: torchvision's uint8 antialiased bilinear. "
             f"Building the cache ran at {prepare_rate:.0f} images/s ({args.workers} processes), a one-time cost.")
    if not args.no_append:
        cmd = "mmpipe bench data " + " ".join(shlex.quote(a) for a in sys.argv[3:])
        append_benchmarks("Data path: images/s", cmd, table, notes)
    return 0


def _has_simplejpeg() -> bool:
    return decode.simplejpeg is not None
