"""Image-caption batches for every layout.

- Images are decoded with Pillow (at reduced size when the JPEG allows), centre-cropped and resized
  to the tower's input size and shipped as **uint8** (3,H,W): the first pipeline stage normalises on the device.
- ``MicroBatchSampler`` cuts each global batch into micro-batches *the same way in every layout*
  (P, DP, accumulation): data-parallel rank r takes micro-batches r*A .. r*A+A-1 of each global
  batch. Because the contrastive loss is per micro-batch, this is what makes losses identical
  across layouts. It is deterministic in (seed, epoch), so every stage that reads data gets the
  identical stream, and it can start at any step (resume).
- A missing or undecodable image, or an empty caption, is replaced by the next good sample
  (deterministically, so every stage and layout agrees), and reported in the batch's ``bad`` list;
  the trainer counts and logs them.
"""
from __future__ import annotations

import math
from typing import Iterator, Optional

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset, Sampler

from mmpipe.data.manifest import Sample
from mmpipe.errors import DataError


def load_image(path: str, size: int) -> torch.Tensor:
    """Decode -> RGB -> centre square -> ``size`` x ``size`` uint8 (3, size, size).

    A JPEG at least twice the target is decoded straight to a reduced size (libjpeg's DCT scaling
    via Pillow's ``draft``: 1/2, 1/4 or 1/8, never below the target), which skips most of the
    decode work. The centre crop is folded into one antialiased bilinear resize (``box``), the
    filter torchvision's ``Resize`` uses."""
    with Image.open(path) as im:
        if im.format == "JPEG" and min(im.size) >= 2 * size:
            im.draft("RGB", (size, size))
        if im.mode != "RGB":
            im = im.convert("RGB")
        w, h = im.size
        s = min(w, h)
        box = ((w - s) / 2, (h - s) / 2, (w + s) / 2, (h + s) / 2)
        arr = np.asarray(im.resize((size, size), Image.BILINEAR, box=box), dtype=np.uint8)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()


class ImageTextDataset(Dataset):
    def __init__(self, samples: list[Sample], image_size: int):
        self.samples = samples
        self.image_size = image_size

    def __len__(self):
        return len(self.samples)

    def _try(self, idx: int):
        s = self.samples[idx]
        if not s.text.strip():
            return None, "empty caption"
        try:
            return load_image(s.image, self.image_size), None
        except FileNotFoundError:
            return None, "missing file"
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
            return None, f"cannot decode ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"

    def __getitem__(self, idx: int) -> dict:
        bad = []
        n = len(self.samples)
        for step in range(n):
            j = (idx + step) % n
            pixels, why = self._try(j)
            if pixels is not None:
                return {"pixel_values": pixels, "text": self.samples[j].text, "index": j, "bad": bad}
            bad.append((self.samples[j].image, why))
        raise DataError(f"no readable sample in the manifest (first failure: {bad[0][0]}: {bad[0][1]})")


class Collate:
    def __init__(self, tokenizer, max_length: int):
        self.tokenizer = tokenizer
        self.max_length = max_length

    def __call__(self, items: list[dict]) -> dict:
        enc = self.tokenizer([it["text"] for it in items], padding="max_length", truncation=True,
                             max_length=self.max_length, return_tensors="pt")
        return {
            "pixel_values": torch.stack([it["pixel_values"] for it in items]),
            "input_ids": enc["input_ids"].to(torch.int64),
            "attention_mask": enc["attention_mask"].to(torch.int64),
            "index": torch.tensor([it["index"] for it in items]),
            "bad": [b for it in items for b in it["bad"]],
        }


class MicroBatchSampler(Sampler):
    """Yields this data-parallel rank's micro-batches (lists of indices), step after step, forever
    (epochs reshuffle with ``seed + epoch``), starting at global step ``start_step``."""

    def __init__(self, num_samples: int, micro_batch_size: int, accumulation: int, dp_size: int, dp_rank: int,
                 seed: int, start_step: int = 0, shuffle: bool = True, max_steps: Optional[int] = None):
        self.n, self.mb, self.acc, self.dp, self.rank = num_samples, micro_batch_size, accumulation, dp_size, dp_rank
        self.seed, self.start_step, self.shuffle, self.max_steps = seed, start_step, shuffle, max_steps
        self.global_batch = micro_batch_size * accumulation * dp_size
        self.steps_per_epoch = num_samples // self.global_batch
        if self.steps_per_epoch < 1:
            raise DataError(f"the data set has {num_samples} samples, fewer than one global batch "
                            f"({self.global_batch}): lower train.batch_size or add data")

    def _perm(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(self.n, generator=g)

    def global_batch_indices(self, step: int) -> list[int]:
        epoch, k = divmod(step, self.steps_per_epoch)
        perm = self._perm(epoch)
        return perm[k * self.global_batch:(k + 1) * self.global_batch].tolist()

    def micro_batches(self, step: int) -> list[list[int]]:
        g = self.global_batch_indices(step)
        first = self.rank * self.acc
        return [g[(first + i) * self.mb:(first + i + 1) * self.mb] for i in range(self.acc)]

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start_step
        while self.max_steps is None or step < self.max_steps:
            yield from self.micro_batches(step)
            step += 1

    def __len__(self):
        if self.max_steps is None:
            return 2 ** 62
        return max(0, self.max_steps - self.start_step) * self.acc


def make_loader(dataset, batch_sampler, collate, data_cfg, device_is_cpu: bool) -> DataLoader:
    workers = data_cfg.num_workers
    kw = {}
    if workers > 0:
        kw = {"prefetch_factor": data_cfg.prefetch_factor, "persistent_workers": data_cfg.persistent_workers}
    return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate, num_workers=workers,
                      pin_memory=data_cfg.pin_memory and not device_is_cpu, **kw)


def eval_batches(samples: list[Sample], micro_batch_size: int, multiple: int = 1) -> tuple[list[list[int]], int]:
    """Sequential micro-batches over ``samples`` padded (by repeating the last sample) so their count
    is a multiple of ``multiple`` and every micro-batch is full: the pipeline needs fixed shapes.
    Returns (micro-batches, number of real samples)."""
    n = len(samples)
    count = math.ceil(n / micro_batch_size)
    count = math.ceil(count / multiple) * multiple
    idx = list(range(n)) + [n - 1] * (count * micro_batch_size - n)
    return [idx[i * micro_batch_size:(i + 1) * micro_batch_size] for i in range(count)], n
