"""WebDataset tar shards (img2dataset layout) as a streaming source.

``data.train: "dir/{00000..00099}.tar"`` (brace-expanded). Each shard holds samples as
``KEY.jpg`` (or .jpeg/.png/.webp) with ``KEY.txt`` (the caption) or ``KEY.json`` (its ``caption``
or ``text`` field), members of one sample adjacent, as img2dataset and ``tar --sort=name`` write them.

Splitting: data-parallel rank r reads shards r, r+D, r+2D, ... and its loader worker w reads
every W-th of those, so ranks and workers read disjoint shards sequentially (the point of shards).
Each worker streams its shards forever (reshuffled per pass, seeded by seed, rank, worker, pass)
through a shuffle buffer, decodes, skips unusable samples (counted, named ``shard/KEY``), optionally
groups windows by caption length, and yields whole micro-batches; the DataLoader interleaves its
workers. Every rank therefore yields exactly as many micro-batches as the step count asks for.

Resume is statistical, as with WebDataset: a resumed run reseeds the streams with the step it
starts at instead of replaying what was already read (replaying means decoding it all again).
"""
from __future__ import annotations

import io
import json
import os
import random
import tarfile
import zlib
from typing import Iterator, Optional

import torch
from torch.utils.data import IterableDataset, get_worker_info

from mmpipe.data.manifest import TEXT_KEYS, _field, caption_text
from mmpipe.errors import ConfigError

IMAGE_EXT = ("jpg", "jpeg", "png", "webp")


def is_shard_spec(path: Optional[str]) -> bool:
    return bool(path) and (path.endswith(".tar") or ".tar}" in path or "{" in path and ".tar" in path)


def expand(spec: str, key: str = "data.train") -> list[str]:
    from braceexpand import braceexpand
    urls = list(braceexpand(spec))
    missing = [u for u in urls if not os.path.isfile(u)]
    if missing:
        raise ConfigError(f"{key}: {len(missing)} of {len(urls)} shards not found, e.g. {missing[0]} "
                          "(check the brace range, e.g. dir/{00000..00099}.tar)")
    return urls


def iter_tar(path: str) -> Iterator[tuple[str, Optional[bytes], Optional[str]]]:
    """(KEY, image bytes or None, caption or None) per sample of one shard."""
    key, image, text = None, None, None
    with tarfile.open(path, "r|*") as tar:
        for m in tar:
            if not m.isfile():
                continue
            base = os.path.basename(m.name)
            stem, _, ext = base.partition(".")
            full_key = os.path.join(os.path.dirname(m.name), stem)
            if full_key != key:
                if key is not None:
                    yield key, image, text
                key, image, text = full_key, None, None
            ext = ext.lower()
            if ext in IMAGE_EXT:
                image = tar.extractfile(m).read()
            elif ext == "txt":
                text = tar.extractfile(m).read().decode("utf-8", "replace")
            elif ext == "json" and text is None:
                text = _json_caption(tar.extractfile(m).read())
    if key is not None:
        yield key, image, text


def _json_caption(raw: bytes):
    """A sample's ``.json`` caption by the manifests' rule (``text``/``caption``/``title``; a list:
    its first non-empty caption); an unusable value is returned as it is (the decode names it)."""
    try:
        d = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(d, dict):
        return None
    found, v = _field(d, TEXT_KEYS)
    try:
        return caption_text(v) if found else None
    except ValueError:
        return v


class ShardStream(IterableDataset):
    """Yields collated micro-batches of this data-parallel rank, forever."""

    def __init__(self, urls: list[str], dp_size: int, dp_rank: int, num_workers: int, micro_batch_size: int,
                 collate, pixels, seed: int = 0, start_step: int = 0,
                 shuffle_buffer: int = 1000, group_by_length: bool = False, group_window: int = 64):
        self.rank_urls = urls[dp_rank::dp_size]
        if not self.rank_urls:
            raise ConfigError(f"data.train has {len(urls)} shards, fewer than the data-parallel degree {dp_size}: "
                              f"write at least {dp_size} shards (ideally a multiple of {dp_size} x data.num_workers)")
        self.workers = max(1, min(num_workers, len(self.rank_urls)))
        self.dp_rank, self.mb, self.collate = dp_rank, micro_batch_size, collate
        self.pixels = pixels  # the family's image input (mmpipe.data.pixels)
        self.seed, self.start_step, self.buffer = seed, start_step, max(1, shuffle_buffer)
        self.group_by_length, self.group_window = group_by_length, group_window

    def _rng(self, worker: int, salt: int) -> random.Random:
        return random.Random(hash((self.seed, self.start_step, self.dp_rank, worker, salt)) & 0xFFFFFFFF)

    def _samples(self, worker: int) -> Iterator[dict]:
        """Decoded samples (and the unusable ones, flagged) of this worker's shards, shuffled, forever."""
        urls = self.rank_urls[worker::self.workers]
        buf_rng = self._rng(worker, -1)
        buf: list = []
        epoch = 0
        while True:
            order = list(urls)
            self._rng(worker, epoch).shuffle(order)
            for url in order:
                for key, image, text in iter_tar(url):
                    buf.append((f"{os.path.basename(url)}/{key}", image, text, epoch))
                    if len(buf) >= self.buffer:
                        yield self._decode(buf.pop(buf_rng.randrange(len(buf))))
            epoch += 1

    def _decode(self, raw) -> dict:
        name, image, text, epoch = raw
        if image is None:
            return {"bad": (name, "no image member")}
        sid = zlib.crc32(name.encode()) & 0x7FFFFFFF  # str hash() differs per process
        pixels, why = self.pixels.load(io.BytesIO(image), text or "", sid, epoch)
        if pixels is None:
            return {"bad": (name, why)}
        return {"pixel_values": pixels, "text": text, "index": -1, "key": name, "bad": []}

    def _micro_batches(self, worker: int) -> Iterator[list]:
        window = self.mb * (self.group_window if self.group_by_length else 1)
        order_rng = self._rng(worker, -2)
        pending_bad: list = []
        items: list = []
        for s in self._samples(worker):
            if "pixel_values" not in s:
                pending_bad.append(s["bad"])
                continue
            s["bad"], pending_bad = pending_bad, []  # reported with the next good sample
            items.append(s)
            if len(items) < window:
                continue
            if self.group_by_length:  # tokenize once: the collate then takes the ids as they are
                for it, ids in zip(items, self.collate.token_ids(items)):
                    it["ids"] = ids
                items.sort(key=lambda it: -len(it["ids"]))
            chunks = [items[i:i + self.mb] for i in range(0, len(items), self.mb)]
            order_rng.shuffle(chunks)
            yield from chunks
            items = []

    def __iter__(self):
        info = get_worker_info()
        worker = info.id if info is not None else 0
        if info is not None and info.num_workers != self.workers:
            raise RuntimeError(f"ShardStream expects {self.workers} loader workers, got {info.num_workers}")
        torch.set_num_threads(1) if info is not None else None
        for mb in self._micro_batches(worker):
            yield self.collate(mb)
