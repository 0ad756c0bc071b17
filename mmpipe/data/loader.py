"""Image-caption batches for every layout.

- Images are decoded (JPEGs with libjpeg-turbo's DCT scaling via simplejpeg, at reduced size when
  the source allows and the caller accepts it; other formats with Pillow), resized so the shortest
  edge is the tower's input size, centre-cropped (the order and filter of transformers' image
  processor with ``resample=BILINEAR``, which an export writes) and shipped as **uint8** (3,H,W):
  the first pipeline stage normalises on the device.
- ``MicroBatchSampler`` cuts each global batch into micro-batches *the same way in every layout*
  (P, DP, accumulation): data-parallel rank r takes micro-batches r*A .. r*A+A-1 of each global
  batch. Because the contrastive loss is per micro-batch, this is what makes losses identical
  across layouts. It is deterministic in (seed, epoch), so every stage that reads data gets the
  identical stream, and it can start at any step (resume).
- Images are converted to RGB as transformers' image processors do: EXIF orientation applied,
  transparency composited onto white, 16-bit grayscale scaled to 8 bits; more than ``MAX_PIXELS``
  pixels is refused before decoding.
- A missing, undecodable or too large image, an empty caption, or a manifest row that cannot be
  used is replaced by the next good sample (deterministically, so every stage and layout agrees),
  and reported in the batch's ``bad`` list; the trainer counts and logs them.
"""
from __future__ import annotations

import io
import math
import re
import warnings
from typing import Iterator, Optional

import numpy as np
import torch
from PIL import Image, ImageOps
from torch.utils.data import DataLoader, Dataset, Sampler

from mmpipe.data.manifest import Sample, json_type
from mmpipe.errors import DataError

try:  # libjpeg-turbo with DCT-domain scaling, ~15% faster than Pillow's JPEG decode here (BENCHMARKS.md)
    import simplejpeg
except ImportError:  # pragma: no cover - Pillow does the same, a little slower
    simplejpeg = None

# Images declaring more pixels than this are refused (a bad sample) before any pixel is decoded:
# Pillow's own decompression-bomb limit (89.5 Mpx; a 300 MB RGB array per loader worker).
MAX_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485


class TooLarge(ValueError):
    """An image mmpipe will not decode (too many pixels, no defined 8-bit scale): a bad sample whose
    reason is this message."""


def _check_pixels(w: int, h: int) -> None:
    if w * h > MAX_PIXELS:
        raise TooLarge(f"too large to decode safely ({w} x {h} pixels > {MAX_PIXELS})")


# EXIF orientation -> the array operation of PIL.ImageOps.exif_transpose (on (H, W, C) arrays)
_ORIENT = {2: lambda a: a[:, ::-1], 3: lambda a: a[::-1, ::-1], 4: lambda a: a[::-1],
           5: lambda a: a.transpose(1, 0, 2), 6: lambda a: np.rot90(a, -1),
           7: lambda a: np.rot90(a, -1)[::-1], 8: lambda a: np.rot90(a, 1)}
_JPEG_MODES = {"YCbCr": "RGB", "RGB": "RGB", "Gray": "L", "CMYK": "CMYK", "YCCK": "CMYK"}  # as Pillow names them


def jpeg_orientation(data: bytes) -> int:
    """The EXIF orientation (1-8) of a JPEG, 1 when it has none: a walk over the segment headers
    before the image data to the first APP1 "Exif" segment (the one Pillow reads), no decoding."""
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return 1
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xDA, 0xD9):  # start of scan / end of image: no EXIF
            return 1
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # segments without a length
            i += 2
            continue
        length = int.from_bytes(data[i + 2:i + 4], "big")
        if marker == 0xE1 and data[i + 4:i + 10] == b"Exif\0\0":
            return _tiff_orientation(data[i + 10:i + 2 + length])
        i += 2 + length
    return 1


def _tiff_orientation(t: bytes) -> int:
    order = {b"II": "little", b"MM": "big"}.get(t[:2])
    if order is None or len(t) < 8:
        return 1
    ifd = int.from_bytes(t[4:8], order)
    count = int.from_bytes(t[ifd:ifd + 2], order) if ifd + 2 <= len(t) else 0
    for k in range(count):
        e = ifd + 2 + 12 * k
        if e + 12 > len(t):
            break
        if int.from_bytes(t[e:e + 2], order) == 0x0112:  # Orientation, a SHORT (or LONG) value
            kind = int.from_bytes(t[e + 2:e + 4], order)
            v = int.from_bytes(t[e + 8:e + 10] if kind == 3 else t[e + 8:e + 12], order)
            return v if 1 <= v <= 8 else 1
    return 1


def _to_rgb(im: Image.Image) -> np.ndarray:
    """RGB uint8 (H, W, 3) as transformers' image processors convert (``convert_to_rgb``):
    transparency (alpha band, palette or colour-key ``transparency``) composited onto white,
    16-bit grayscale scaled to 8 bits (value / 257: Pillow's own convert would clip at 255; a 32-bit
    integer image, which has no defined scale, is refused as a bad sample),
    palette, CMYK, grayscale and bilevel images converted by Pillow."""
    mode = im.mode
    if mode == "RGB" and "transparency" not in im.info:
        return np.array(im)  # writable: torch.from_numpy needs it
    if mode == "I":  # 32-bit signed (e.g. TIFF): Pillow would clip at 255, transformers too
        raise TooLarge("a 32-bit integer image (mode I) has no defined 8-bit scale; save it as 8- or 16-bit")
    if mode in ("I;16", "I;16B", "I;16L", "I;16N"):
        a = np.asarray(im)
        gray = np.clip(np.rint(a / 257.0), 0, 255).astype(np.uint8)
        t = im.info.get("transparency")
        if isinstance(t, int):  # a 16-bit PNG's colour-key transparency
            gray[a == t] = 255
        return np.repeat(gray[:, :, None], 3, axis=2)
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.array(Image.alpha_composite(white, rgba).convert("RGB"))
    return np.array(im.convert("RGB"))


def _decode_rgb(data: bytes, size: int, info: Optional[dict] = None, draft: bool = True) -> np.ndarray:
    """RGB uint8 (H, W, 3), upright (EXIF orientation applied). With ``draft``, a JPEG at least
    twice the target is decoded straight to a reduced size (libjpeg's DCT scaling, never below
    ``size``): most of the decode work is skipped, but the pixels are not those of a full decode. An image of more than ``MAX_PIXELS`` raises ``TooLarge`` before it is
    decoded. ``info``, if given, receives the image's upright ``width``, ``height`` and file ``mode``."""
    if simplejpeg is not None and data[:2] == b"\xff\xd8":
        try:
            h, w, space, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError:
            h = None  # not readable here: Pillow decides
        if h is not None:
            _check_pixels(w, h)
            orientation = jpeg_orientation(data)
            m = size if draft and min(h, w) >= 2 * size else 0
            try:
                arr = simplejpeg.decode_jpeg(data, "RGB", min_height=m, min_width=m)
            except ValueError:
                pass  # truncated, unusual coding, ...: Pillow decides (and raises for what it cannot read)
            else:
                if orientation != 1:
                    arr = _ORIENT[orientation](arr)
                if info is not None:
                    info.update(width=h if orientation >= 5 else w, height=w if orientation >= 5 else h,
                                mode=_JPEG_MODES.get(space, space))
                return arr
    with warnings.catch_warnings():  # Pillow warns above its limit (refused below), raises above twice it
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            im = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as e:
            pixels = re.search(r"\((\d+) pixels\)", str(e))
            raise TooLarge(f"too large to decode safely ({pixels.group(1) if pixels else 'more than 2 x'} pixels > "
                           f"{MAX_PIXELS})") from None
    with im:
        w, h = im.size
        _check_pixels(w, h)
        mode = im.mode
        if draft and im.format == "JPEG" and min(w, h) >= 2 * size:
            im.draft("RGB", (size, size))
        im.load()
        orientation = im.getexif().get(0x0112, 1)
        ImageOps.exif_transpose(im, in_place=True)
        if info is not None:
            swap = orientation in (5, 6, 7, 8)
            info.update(width=h if swap else w, height=w if swap else h, mode=mode)
        return _to_rgb(im)


def load_image(path, size: int, info: Optional[dict] = None, draft: bool = True) -> torch.Tensor:
    """Decode -> RGB (upright, transparency on white) -> shortest edge ``size`` -> centre ``size`` x
    ``size`` crop, uint8 (3, size, size).

    ``path`` is a file name or a binary file object. The resize is torchvision's antialiased
    bilinear resize on the uint8 tensor, then ``center_crop``: exactly what transformers' image
    processor (``CLIPImageProcessor(resample=BILINEAR)``, torchvision backend) computes from a full
    decode, so with ``draft=False`` an exported model sees training's pixels. ``draft``: a large
    JPEG may be decoded at reduced size (faster, a few grey levels off). ``info``: see ``_decode_rgb``."""
    if hasattr(path, "read"):
        data = path.read()
    else:
        with open(path, "rb") as fh:
            data = fh.read()
    arr = _decode_rgb(data, size, info, draft)
    x = torch.from_numpy(np.ascontiguousarray(arr)).permute(2, 0, 1)
    h, w = x.shape[1:]
    if min(h, w) != size:
        from torchvision.transforms.v2 import functional as F
        x = F.resize(x, [size], antialias=True)  # shortest edge = size, the other int(size * long / short)
        h, w = x.shape[1:]
    if h != size or w != size:
        top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))  # torchvision's center_crop
        x = x[:, top:top + size, left:left + size]
    return x.contiguous()


def decode_sample(path, text: str, size: int, info: Optional[dict] = None, draft: bool = True
                  ) -> tuple[Optional[torch.Tensor], Optional[str]]:
    """(uint8 image, None), or (None, why the sample is unusable). ``path`` may be a file-like object.
    Nothing a file holds raises: a corrupt image of any kind is a bad sample. ``draft``: see
    ``load_image``."""
    if not isinstance(text, str):  # e.g. a shard's JSON caption that is a number
        return None, f"caption is {json_type(text)}, expected text"
    if not text.strip():
        return None, "empty caption"
    try:
        return load_image(path, size, info, draft), None
    except FileNotFoundError:
        return None, "missing file"
    except TooLarge as e:
        return None, str(e)
    except MemoryError:
        raise
    except Exception as e:  # Pillow raises many kinds (OSError, SyntaxError, struct.error, ...) on corrupt files
        return None, f"cannot decode ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"


def _item_key(item) -> tuple[int, int]:
    """Sampler items are ``index`` or ``(index, epoch)``; the epoch seeds augmentation."""
    return (item, 0) if isinstance(item, int) else (int(item[0]), int(item[1]))


class Augment:
    """Random augmentation applied to the uint8 image *after* decode or cache, so a cache never
    freezes it: torchvision's ``RandomResizedCrop`` (scale ``crop_scale``) and, with ``crop_flip``,
    ``RandomHorizontalFlip``. The draws are seeded by (seed, epoch, sample index): the same in every
    layout, loader worker and after a resume."""

    def __init__(self, mode: str, image_size: int, crop_scale, seed: int):
        from torchvision.transforms import v2
        self.mode, self.seed = mode, seed
        tfs = [v2.RandomResizedCrop(image_size, scale=tuple(crop_scale), antialias=True)]
        if mode == "crop_flip":
            tfs.append(v2.RandomHorizontalFlip())
        self.tf = v2.Compose(tfs)

    def __call__(self, pixels: torch.Tensor, index: int, epoch: int) -> torch.Tensor:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((self.seed * 1_000_003 + epoch) * 10_000_019 + index)
            return self.tf(pixels)


def make_augment(data_cfg, image_size: int, seed: int) -> Optional[Augment]:
    if data_cfg.augment == "none":
        return None
    return Augment(data_cfg.augment, image_size, data_cfg.crop_scale, seed)


def finish_pixels(pixels: torch.Tensor, image_size: int, augment: Optional[Augment], sample_id: int,
                  epoch: int) -> torch.Tensor:
    """A decoded or cached uint8 image -> the tower's input: augmented (crop to ``image_size``), or
    resized when it was decoded/cached at another size."""
    if augment is not None:
        return augment(pixels, sample_id, epoch)
    if pixels.shape[-1] != image_size:
        from torchvision.transforms.v2 import functional as F
        pixels = F.resize(pixels, [image_size, image_size], antialias=True)
    return pixels


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
        return {
            "pixel_values": torch.stack([it["pixel_values"] for it in items]),
            "input_ids": input_ids,
            "attention_mask": mask,
            "index": torch.tensor([it["index"] for it in items]),
            "keys": [it.get("key", str(it["index"])) for it in items],
            "bad": [b for it in items for b in it["bad"]],
        }


class MicroBatchSampler(Sampler):
    """Yields this data-parallel rank's micro-batches (lists of ``(index, epoch)``), step after
    step, forever (epochs reshuffle with ``seed + epoch``), starting at global step ``start_step``.

    Each epoch is one stream of micro-batches, defined by the micro-batch size alone: a seeded
    permutation cut into micro-batches; with ``lengths`` (caption token counts) every window of
    ``group_window`` micro-batches is sorted by length before it is cut, and the window's
    micro-batches are shuffled (HF's ``LengthGroupedSampler`` idea). Global step k takes the next
    ``accumulation x dp`` micro-batches and data-parallel rank r the r-th run of ``accumulation``
    of them, so every layout (P, DP, accumulation) sees the same micro-batches.

    ``start_at``, a ``position()`` saved by a run of another batch size, continues that run's
    epoch at the next unseen sample: its epoch's remaining micro-batches are taken ``accumulation
    x dp`` at a time (a micro-batch size change re-cuts the rest of the permutation), and the
    following epochs are cut as usual."""

    def __init__(self, num_samples: int, micro_batch_size: int, accumulation: int, dp_size: int, dp_rank: int,
                 seed: int, start_step: int = 0, shuffle: bool = True, max_steps: Optional[int] = None,
                 lengths=None, group_window: int = 64, start_at: Optional[dict] = None):
        self.n, self.mb, self.acc, self.dp, self.rank = num_samples, micro_batch_size, accumulation, dp_size, dp_rank
        self.seed, self.start_step, self.shuffle, self.max_steps = seed, start_step, shuffle, max_steps
        self.lengths = None if lengths is None else np.asarray(lengths)
        self.group_window = group_window
        self.global_batch = micro_batch_size * accumulation * dp_size
        self.per_step = accumulation * dp_size
        self._cache: dict = {}  # (epoch, offset) -> micro-batches; the two last used
        self.steps_per_epoch = len(self.epoch_micro_batches(0)) // self.per_step
        if self.steps_per_epoch < 1:
            raise DataError(f"the data set has {num_samples} samples, fewer than one global batch "
                            f"({self.global_batch}): lower train.batch_size or add data")
        # the anchor: global step ``start_step`` begins at micro-batch ``pos`` of ``epoch``, whose
        # micro-batches are the permutation from sample ``offset`` on
        epoch, k = divmod(start_step, self.steps_per_epoch)
        self.anchor = (start_step, epoch, 0, k * self.per_step)
        if start_at is not None:
            self.anchor = (start_step,) + self._continue(start_at)
        _, epoch, offset, pos = self.anchor
        self.first_steps = (len(self.epoch_micro_batches(epoch, offset)) - pos) // self.per_step  # left in it

    def _continue(self, at: dict) -> tuple:
        epoch, pos, mb = int(at["epoch"]), int(at["micro_batch"]), int(at["micro_batch_size"])
        if mb == self.mb:
            return epoch, int(at.get("offset", 0)), pos
        if self.lengths is not None:
            raise DataError(f"--resume: the checkpoint's micro-batch size is {mb}, this run's {self.mb}, and "
                            "data.group_by_length cuts each epoch by the micro-batch size: resume with "
                            f"parallel.micro_batch_size={mb} (train.batch_size may change), or finish the epoch first")
        return epoch, int(at.get("offset", 0)) + pos * mb, 0

    def _perm(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(self.n, generator=g)

    def epoch_micro_batches(self, epoch: int, offset: int = 0) -> list[list[int]]:
        """The micro-batches of ``epoch``; ``offset``: of its permutation from that sample on."""
        if (epoch, offset) in self._cache:
            return self._cache[(epoch, offset)]
        perm = self._perm(epoch).numpy()[offset:]
        mbs = []
        if self.lengths is None:
            mbs = [perm[i:i + self.mb].tolist() for i in range(0, len(perm) - self.mb + 1, self.mb)]
        else:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch + 7_777)
            w = self.group_window * self.mb
            for start in range(0, len(perm), w):
                win = perm[start:start + w]
                win = win[np.argsort(-self.lengths[win], kind="stable")]
                chunk = [win[i:i + self.mb].tolist() for i in range(0, len(win) - self.mb + 1, self.mb)]
                order = torch.randperm(len(chunk), generator=g).tolist() if self.shuffle else range(len(chunk))
                mbs.extend(chunk[i] for i in order)
        self._cache = {k: v for k, v in list(self._cache.items())[-1:]}
        self._cache[(epoch, offset)] = mbs
        return mbs

    def _locate(self, step: int) -> tuple:
        """(epoch, offset, first micro-batch) of global step ``step`` (>= the start step)."""
        step0, epoch, offset, pos = self.anchor
        d = step - step0
        if d < self.first_steps:
            return epoch, offset, pos + d * self.per_step
        e, k = divmod(d - self.first_steps, self.steps_per_epoch)
        return epoch + 1 + e, 0, k * self.per_step

    def position(self, steps_done: int) -> dict:
        """Where the stream stands after ``steps_done`` global steps: saved with a checkpoint, so a
        resume with another batch size continues at the next unseen sample (``start_at``)."""
        epoch, offset, pos = self._locate(steps_done)
        return {"epoch": epoch, "offset": offset, "micro_batch": pos, "micro_batch_size": self.mb,
                "sample": offset + pos * self.mb}

    def global_batch_indices(self, step: int) -> list[int]:
        return [i for mb in self.micro_batches(step, all_ranks=True) for i in mb]

    def micro_batches(self, step: int, all_ranks: bool = False) -> list[list[int]]:
        epoch, offset, pos = self._locate(step)
        mbs = self.epoch_micro_batches(epoch, offset)[pos:pos + self.per_step]
        return mbs if all_ranks else mbs[self.rank * self.acc:(self.rank + 1) * self.acc]

    def __iter__(self) -> Iterator[list]:
        step = self.start_step
        while self.max_steps is None or step < self.max_steps:
            epoch = self._locate(step)[0]
            for mb in self.micro_batches(step):
                yield [(i, epoch) for i in mb]
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


def eval_batches(samples: list[Sample], micro_batch_size: int, multiple: int = 1,
                 pad: bool = True) -> tuple[list[list[int]], int]:
    """Sequential micro-batches over ``samples`` padded (by repeating the last sample) so their count
    is a multiple of ``multiple`` and every micro-batch is full: the pipeline needs fixed shapes
    (``pad=False``, for families whose shapes change anyway: the last micro-batch may be short).
    Returns (micro-batches, number of real samples)."""
    n = len(samples)
    if not pad:
        return [list(range(i, min(n, i + micro_batch_size))) for i in range(0, n, micro_batch_size)], n
    count = math.ceil(n / micro_batch_size)
    count = math.ceil(count / multiple) * multiple
    idx = list(range(n)) + [n - 1] * (count * micro_batch_size - n)
    return [idx[i * micro_batch_size:(i + 1) * micro_batch_size] for i in range(count)], n
