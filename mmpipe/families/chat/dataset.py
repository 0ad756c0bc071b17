"""Chat samples for the loader: ``ChatDataset`` (images loaded by the family's image input, ids and
labels encoded), ``PackedChatDataset`` (``data.packing``: several samples per sequence) and
``ChatCollate`` (samples -> the batch; the family's image input batches the pixels)."""
from __future__ import annotations

from typing import Optional

from mmpipe.data.balance import SampleUnits
from mmpipe.data.sample_keys import image_key, key_fields, sample_key
from mmpipe.data.sampler import _item_key
from mmpipe.errors import DataError
from mmpipe.families.chat.encoder import ChatEncoder

class ChatDataset:
    """Chat samples for the loader: images decoded to the tower's size, ids and labels encoded. An
    unusable sample (a bad entry, a missing or corrupt image, nothing left at ``max_length``) is
    replaced by the next usable one, deterministically (every stage and layout agrees), and
    reported in the item's ``bad`` list, as for image-caption data."""

    def __init__(self, samples: list, encoder: ChatEncoder, pixels):
        """``pixels``: the family's image input (``Family.pixels``: ``load`` an image, ``batch`` them)."""
        self.samples, self.encoder, self.pixels = samples, encoder, pixels

    def __len__(self):
        return len(self.samples)

    @property
    def lengths(self) -> list:
        """Encoded token counts (length grouping, packing); an unusable sample counts as 0."""
        def n(s):
            if s.error is not None:
                return 0
            enc = self.encoder.encode(s)
            return 0 if enc.dropped else len(enc.input_ids)
        return [n(s) for s in self.samples]

    @property
    def units(self):
        """``SampleUnits`` per sample (``data.balance: cost``): its image tokens and its encoded tokens (an
        unusable sample: 0 and 0; the loader replaces it by the next usable one)."""
        vision, tokens = [], []
        for s in self.samples:
            enc = None if s.error is not None else self.encoder.encode(s)
            ok = enc is not None and not enc.dropped
            vision.append(sum(1 for x in enc.input_ids if x in self.encoder.visual_ids) if ok else 0)
            tokens.append(len(enc.input_ids) if ok else 0)
        return SampleUnits(vision, tokens)

    def first_unusable(self) -> tuple:
        """(where, why) of the first sample that cannot be used as it stands (no image decoded)."""
        for s in self.samples:
            why = s.error if s.error is not None else self.encoder.encode(s).dropped
            if why is not None:
                return s.where, why
        return "", "none found"

    def _load(self, j: int, epoch: int = 0):
        s = self.samples[j]
        if s.error is not None:
            return None, (s.where, s.error)
        enc = self.encoder.encode(s)
        if enc.dropped:
            return None, (s.where, f"dropped: {enc.dropped}")
        images, paths, videos = [], iter(enc.images), iter(getattr(enc, "videos", ()))
        for kind in getattr(enc, "media", ()) or ("image",) * len(enc.images):  # the visual inputs in token order
            if kind == "video":  # its frames' items (Qwen3: one per temporal patch)
                source = next(videos)
                items, why = self.encoder.video.load(source)
                if items is None:
                    return None, (str(source), why)
                images += items
                continue
            path = next(paths)  # a full decode: an exported processor, given the user's PIL image, sees these pixels
            pixels, why = self.pixels.load(path, "<image>", j, epoch, draft=False)
            if pixels is None:
                return None, (path, why)
            images.append(pixels)
        return {"input_ids": enc.input_ids, "labels": enc.labels, "images": images, "truncated": enc.truncated}, None

    def __getitem__(self, item) -> dict:
        idx, epoch = _item_key(item)
        bad = []
        for step in range(len(self)):
            j = (idx + step) % len(self)
            fields, why = self._load(j, epoch)
            if fields is not None:
                return {**fields, "index": j, "key": self.samples[j].where, "bad": bad}
            bad.append(why)
        raise DataError(f"no usable sample in the chat data (first failure: {bad[0][0]}: {bad[0][1]})")


def plan_packs(lengths: list, max_length: int, window: int = 1000) -> list:
    """Sample indices -> packs (lists of indices) of total length <= ``max_length``: within each window
    of ``window`` samples (in data order), first-fit decreasing; a sample is never split, an empty
    one (unusable: length 0) is left out, and a pack keeps its samples in data order."""
    packs = []
    for lo in range(0, len(lengths), window):
        bins, room = [], []
        for i in sorted(range(lo, min(lo + window, len(lengths))), key=lambda i: (-lengths[i], i)):
            n = lengths[i]
            if n <= 0:
                continue
            for b in range(len(bins)):
                if room[b] >= n:
                    bins[b].append(i)
                    room[b] -= n
                    break
            else:
                bins.append([i])
                room.append(max_length - n)
        packs.extend(sorted(b) for b in sorted(bins, key=min))
    return packs


class PackedChatDataset:
    """``data.packing``: each item is a pack of chat samples (``plan_packs`` over their encoded
    lengths) concatenated into one sequence, each sample's first label hidden (nothing predicts
    across samples) and ``segments`` numbering the samples (the collate writes them into the
    attention mask: the model attends within a sample and restarts positions at each). A sample that
    fails to load (e.g. its image no longer decodes) is dropped from its pack and reported; a pack
    with none left is replaced by the next, as an unusable sample is."""

    def __init__(self, chat: ChatDataset, max_length: int):
        import bisect
        self.chat = chat
        self.sample_lengths = chat.lengths
        self.packs = plan_packs(self.sample_lengths, max_length)
        if not self.packs:
            where, why = chat.first_unusable()
            raise DataError(f"no usable sample in the chat data to pack (the first, {where}: {why})")
        # an unusable sample (left out of every pack) is reported with the pack that follows it in data
        # order, once per epoch, as an unpacked run reports it when it draws it
        firsts = [p[0] for p in self.packs]
        self.unusable: dict = {}
        for i, n in enumerate(self.sample_lengths):
            if n <= 0:
                j = min(bisect.bisect_right(firsts, i), len(self.packs) - 1)
                self.unusable.setdefault(j, []).append(i)

    def __len__(self):
        return len(self.packs)

    @property
    def lengths(self) -> list:
        return [sum(self.sample_lengths[i] for i in p) for p in self.packs]

    @property
    def units(self):
        """``SampleUnits`` per pack: its samples' image tokens and tokens summed."""
        u = self.chat.units
        return SampleUnits([sum(u.vision[i] for i in p) for p in self.packs],
                           [sum(int(u.tokens[i]) for i in p) for p in self.packs])

    def __getitem__(self, item) -> dict:
        idx, epoch = _item_key(item)
        bad = []
        for step in range(len(self)):
            j = (idx + step) % len(self)
            for i in self.unusable.get(j, ()):
                fields, why = self.chat._load(i, epoch)
                bad.append(why if fields is None else (self.chat.samples[i].where, "not packed (no tokens)"))
            ids, labels, segments, images, keys, truncated, members = [], [], [], [], [], 0, []
            for i in self.packs[j]:
                fields, why = self.chat._load(i, epoch)
                if fields is None:
                    bad.append(why)
                    continue
                k = len(fields["input_ids"])
                ids += fields["input_ids"]
                labels += [-100] + list(fields["labels"][1:])  # position k-1 of the last sample predicts none of this one
                segments += [len(keys) + 1] * k
                images += fields["images"]
                keys.append(self.chat.samples[i].where)
                members.append((i, k, len(fields["images"])))
                truncated += bool(fields["truncated"])
            if keys:
                return {"input_ids": ids, "labels": labels, "segments": segments, "images": images,
                        "truncated": truncated, "index": j, "keys": keys, "bad": bad, "members": members}
        raise DataError(f"no usable sample in the chat data (first failure: {bad[0][0]}: {bad[0][1]})")


class ChatCollate:
    """Samples -> a chat family's batch: the pixel fields of every image of the micro-batch in order
    (the family's image input batches them: ``pixels.batch``), ``input_ids``
    padded with the pad id to a multiple of ``pad_multiple``, ``attention_mask``, ``labels`` padded
    with -100; plus ``index``, ``keys``, ``bad`` and the count of truncated samples."""

    def __init__(self, pad_id: int, pixels, pad_multiple: int = 1, pad_to: Optional[int] = None):
        self.pad_id, self.pixels, self.pad_multiple, self.pad_to = pad_id, pixels, max(1, pad_multiple), pad_to

    def __call__(self, items: list) -> dict:
        import torch
        n = max(len(it["input_ids"]) for it in items)
        n = self.pad_to or -(-n // self.pad_multiple) * self.pad_multiple
        ids = torch.full((len(items), n), self.pad_id, dtype=torch.int64)
        labels = torch.full((len(items), n), -100, dtype=torch.int64)
        mask = torch.zeros((len(items), n), dtype=torch.int64)
        for i, it in enumerate(items):
            k = len(it["input_ids"])
            ids[i, :k] = torch.as_tensor(it["input_ids"])
            labels[i, :k] = torch.as_tensor(it["labels"])
            mask[i, :k] = torch.as_tensor(it["segments"]) if "segments" in it else 1  # packed: segment ids
        pixels = self.pixels.batch([im for it in items for im in it["images"]])
        return {**pixels, **self.sample_keys(items, pixels), "input_ids": ids, "attention_mask": mask,
                "labels": labels, "index": torch.tensor([it["index"] for it in items]),
                "keys": [k for it in items for k in (it["keys"] if "keys" in it else [it["key"]])],
                "bad": [b for it in items for b in it["bad"]],
                "truncated": sum(int(it["truncated"]) for it in items)}

    @staticmethod
    def sample_keys(items: list, pixels: dict) -> dict:
        """Each sample's dropout key (``sample_rng``: its row in the chat data, packed or not) with its tokens
        per row, and each image's with its patches (a flat tower's ``image_grid_thw``; else one row each)."""
        rows, images = [], []
        for it in items:  # a packed row: its samples in order (``members``: index, tokens, images)
            members = it.get("members") or [(it["index"], len(it["input_ids"]), len(it["images"]))]
            rows.append([(sample_key(i), n) for i, n, _ in members])
            images += [image_key(sample_key(i), o) for i, _, m in members for o in range(m)]
        grid = pixels.get("image_grid_thw")
        flat = grid.prod(-1).tolist() if grid is not None and len(grid) == len(images) else [-1] * len(images)
        return key_fields(rows, list(zip(images, flat)))
