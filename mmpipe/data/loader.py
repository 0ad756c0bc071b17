"""Image-caption datasets and the loader.

- ``ImageTextDataset`` reads a manifest; images are loaded by the family's image input
  (``mmpipe.data.pixels``), decoded by ``mmpipe.data.decode``.
- A missing, undecodable or too large image, an empty caption, or a manifest row that cannot be
  used is replaced by the next good sample (deterministically, so every stage and layout agrees),
  and reported in the batch's ``bad`` list; the trainer counts and logs them.
- ``Collate`` tokenizes and pads captions; ``make_loader`` wraps a dataset and ``MicroBatchSampler``
  (``mmpipe.data.sampler``) in a DataLoader.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils.data import DataLoader, Dataset

from mmpipe.data.handoff import Packed, Unpacking
from mmpipe.data.manifest import Sample
from mmpipe.data.sample_keys import key_fields, sample_key
from mmpipe.data.sampler import _item_key
from mmpipe.errors import DataError


class SubstitutingDataset(Dataset):
    """Indexable samples where an unusable row is replaced by the next usable one (deterministically,
    so every stage and layout agrees) and reported in the item's ``bad`` list. Subclasses load a
    row: ``_load(j)`` -> ({"pixel_values": uint8, and "text" or "ids"}, None) or (None, (name, why));
    ``pixels`` (the family's image input, ``mmpipe.data.pixels``) finishes each image."""

    pixels = None
    what = "the data set"

    def _load(self, j: int) -> tuple[Optional[dict], Optional[tuple]]:
        raise NotImplementedError

    def __getitem__(self, item) -> dict:
        idx, epoch = _item_key(item)
        bad = []
        n = len(self)
        for step in range(n):
            j = (idx + step) % n
            fields, why = self._load(j)
            if fields is not None:
                fields["pixel_values"] = self.pixels.finish(fields["pixel_values"], j, epoch)
                return {**fields, "index": j, "bad": bad}
            bad.append(why)
        raise DataError(f"no usable sample in {self.what} (first failure: {bad[0][0]}: {bad[0][1]})")


class ImageTextDataset(SubstitutingDataset):
    """Samples of a manifest, decoded on the fly and finished by the family's image input
    (``pixels``: ``mmpipe.data.pixels``)."""

    what = "the manifest"

    def __init__(self, samples: list[Sample], pixels):
        self.samples = samples
        self.pixels = pixels

    def __len__(self):
        return len(self.samples)

    def _load(self, j: int):
        s = self.samples[j]
        if s.error is not None:  # a manifest row that cannot be used: counted like an unreadable image
            return None, (s.where, s.error)
        pixels, why = self.pixels.decode(s.image, s.text)
        if pixels is None:
            return None, (s.image, why)
        return {"pixel_values": pixels, "text": s.text}, None


def padded_length(lengths, max_length: int, multiple: int) -> int:
    """The batch's longest caption rounded up to ``multiple``, never above ``max_length``."""
    longest = max(lengths)
    return min(max_length, -(-longest // multiple) * multiple)


class Collate:
    """Stack images; tokenize captions (or take pre-tokenized ``ids`` from the cache) and pad them
    to the batch's longest rounded up to ``pad_multiple`` (``padding="batch"``), or to
    ``max_length`` (``padding="max_length"``)."""

    def __init__(self, tokenizer, max_length: int, padding: str = "batch", pad_multiple: int = 4):
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.padding = padding
        self.pad_multiple = pad_multiple
        self.pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0

    def token_ids(self, items: list[dict]) -> list[list[int]]:
        if "ids" in items[0]:
            return [list(it["ids"]) for it in items]
        enc = self.tokenizer([it["text"] for it in items], truncation=True, max_length=self.max_length)
        return enc["input_ids"]

    def __call__(self, items: list[dict]) -> dict:
        ids = self.token_ids(items)
        lengths = [len(x) for x in ids]
        n = self.max_length if self.padding == "max_length" else padded_length(lengths, self.max_length,
                                                                              self.pad_multiple)
        input_ids = torch.full((len(ids), n), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(ids), n), dtype=torch.int64)
        for i, x in enumerate(ids):
            input_ids[i, :len(x)] = torch.as_tensor(x, dtype=torch.int64)
            mask[i, :len(x)] = 1
        keys = [sample_key(it["index"], it.get("key", "")) for it in items]  # each sample's dropout (sample_rng)
        return {
            "pixel_values": torch.stack([it["pixel_values"] for it in items]),
            "input_ids": input_ids,
            "attention_mask": mask,
            "index": torch.tensor([it["index"] for it in items]),
            "keys": [it.get("key", str(it["index"])) for it in items],
            "bad": [b for it in items for b in it["bad"]],
            **key_fields([[(k, min(len(x), n))] for k, x in zip(keys, ids)], [(k, -1) for k in keys]),
        }


def make_loader(dataset, batch_sampler, collate, data_cfg, device_is_cpu: bool) -> DataLoader:
    workers = data_cfg.num_workers
    if workers == 0:
        return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate, num_workers=0,
                          pin_memory=data_cfg.pin_memory and not device_is_cpu)
    # each batch handed over as one buffer (``data.handoff``), not a shared-memory file per tensor
    return Unpacking(DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=Packed(collate), num_workers=workers,
                                pin_memory=data_cfg.pin_memory and not device_is_cpu,
                                prefetch_factor=data_cfg.prefetch_factor,
                                persistent_workers=data_cfg.persistent_workers))
