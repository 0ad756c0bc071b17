"""How a family's images become tower input: the object a family hands the data layer
(``Family.pixels``), so generic datasets, the cache reader, the shard stream and the collate never
ask for an image size themselves.

``SquarePixels`` is the image-caption default (CLIP, LLaVA's CLIP ViT): every image decoded (or
cached) at ``decode_size``, then augmented (``Augment``) or resized to the tower's square ``size``;
a batch is ``(N, 3, S, S)`` uint8. A native-resolution family gives its own object with the same
methods (``load``, ``finish``, ``batch``; ``cache_size`` None when no square cache fits it)."""
from __future__ import annotations

from typing import Optional

import torch

from mmpipe.data.decode import decode_sample


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


class SquarePixels:
    """Square images of side ``size``, decoded at ``decode_size`` (default ``size``); ``augment``: the
    training augmentation (None: resize only). Picklable (loader workers)."""

    def __init__(self, size: int, decode_size: Optional[int] = None, augment: Optional[Augment] = None):
        self.size, self.decode_size, self.augment = int(size), int(decode_size or size), augment

    @property
    def cache_size(self) -> int:
        """The side a preprocessed cache (``mmpipe data prepare``) must hold."""
        return self.decode_size

    def decode(self, source, what: str, draft: bool = True):
        """(uint8 (3, H, W) at ``decode_size``, None) or (None, why)."""
        return decode_sample(source, what, self.decode_size, draft=draft)

    def finish(self, pixels: torch.Tensor, sample_id: int, epoch: int) -> torch.Tensor:
        """A decoded or cached image -> the tower's input (augmented, or resized)."""
        return finish_pixels(pixels, self.size, self.augment, sample_id, epoch)

    def load(self, source, what: str, sample_id: int, epoch: int, draft: bool = True):
        """(the tower's input, None) or (None, why): decode then finish."""
        pixels, why = self.decode(source, what, draft)
        return (None, why) if pixels is None else (self.finish(pixels, sample_id, epoch), None)

    def batch(self, images: list) -> dict:
        """The batch's pixel fields: every image in order, ``(0, 3, S, S)`` when there is none
        (pipeline stages exchange tensors only)."""
        return {"pixel_values": torch.stack(images) if images else
                torch.zeros((0, 3, self.size, self.size), dtype=torch.uint8)}

    def example(self, n: int, generator: torch.Generator) -> dict:
        """Pixel fields of ``n`` random images (the profiler's example batch)."""
        return {"pixel_values": torch.randint(0, 256, (n, 3, self.size, self.size), dtype=torch.uint8,
                                              generator=generator)}


def square_pixels(size: int, data_cfg, seed: Optional[int] = None) -> SquarePixels:
    """``SquarePixels`` of a run's data section: decoded at ``data.decode_size`` (unset: ``size``), and
    with ``seed`` (training data) ``data.augment``'s augmentation seeded by it."""
    augment = make_augment(data_cfg, size, seed) if seed is not None else None
    return SquarePixels(size, getattr(data_cfg, "decode_size", None), augment)
