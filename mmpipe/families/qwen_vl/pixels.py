"""Native-resolution image input (``Family.pixels`` of ``qwen2_5_vl``): each image keeps its aspect
ratio, is resized by the model's own image processor (``Qwen2VLImageProcessor``: sides to multiples
of patch x merge, pixels within ``min_pixels`` / ``max_pixels``) and becomes its own number of
patches; a micro-batch's images travel as one ``(patches, 3*T*P*P)`` float tensor plus their
``(t, h, w)`` grids, as transformers' processor hands them to ``Qwen2_5_VLForConditionalGeneration``."""
from __future__ import annotations

from typing import Optional

import torch

from mmpipe.errors import ConfigError


class NativePixels:
    """``processor``: a transformers Qwen2-VL image processor (the directory's, or built from defaults
    and ``data.min_pixels`` / ``data.max_pixels``). Picklable (loader workers)."""

    cache_size = None  # no square cache holds native-resolution images

    def __init__(self, processor):
        self.processor = processor
        p = processor
        self.patch, self.merge, self.temporal = int(p.patch_size), int(p.merge_size), int(p.temporal_patch_size)
        self.min_pixels, self.max_pixels = int(p.size["shortest_edge"]), int(p.size["longest_edge"])

    def checked(self) -> "NativePixels":
        """Itself, once its pixel bounds are usable (else one line naming ``data.min_pixels`` / ``data.max_pixels``):
        ``min_pixels > max_pixels`` would invert the order of sizes (a small image more tokens than a large
        one), and a bound below one merge unit (``(patch x merge)^2`` pixels) resizes nothing to it."""
        unit = (self.patch * self.merge) ** 2
        if self.min_pixels > self.max_pixels:
            raise ConfigError(f"data.min_pixels={self.min_pixels} is above data.max_pixels={self.max_pixels}: an image "
                              "under the minimum would grow past the maximum; give min_pixels <= max_pixels")
        for key in ("min_pixels", "max_pixels"):
            if getattr(self, key) < unit:
                raise ConfigError(f"data.{key}={getattr(self, key)} is below one merge unit ({self.patch * self.merge}"
                                  f" x {self.patch * self.merge} = {unit} pixels: the fewest an image becomes); give at "
                                  f"least {unit}")
        return self

    @property
    def width(self) -> int:
        """Values per patch: 3 x temporal x patch x patch."""
        return 3 * self.temporal * self.patch * self.patch

    def grid(self, width: int, height: int) -> tuple:
        """(t, h, w) patch grid of an image of ``width`` x ``height`` pixels, as the processor resizes it."""
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
        h, w = smart_resize(height, width, factor=self.patch * self.merge, min_pixels=self.min_pixels,
                            max_pixels=self.max_pixels)
        return 1, h // self.patch, w // self.patch

    def tokens(self, path) -> int:
        """Image tokens the image becomes in the text (patches / merge^2); reads the header only."""
        from PIL import Image
        with Image.open(path) as im:
            t, h, w = self.grid(*im.size)
        return t * h * w // (self.merge * self.merge)

    def load(self, source, what: str, sample_id: int, epoch: int, draft: bool = False):
        """((patches, grid), None) or (None, why): the file decoded in full and processed."""
        from PIL import Image
        try:
            with Image.open(source) as im:
                im = im.convert("RGB")
        except Exception as e:  # noqa: BLE001 - a corrupt or missing file is the sample's error
            return None, f"cannot decode {what} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        return self.process(im), None

    def process(self, image) -> tuple:
        """A PIL image -> (float patches (n, 3*T*P*P), grid (3,) int64), the processor's arithmetic."""
        out = self.processor(images=[image], return_tensors="pt")
        return out["pixel_values"].float(), out["image_grid_thw"][0].to(torch.int64)

    def batch(self, images: list) -> dict:
        """``pixel_values`` (every visual item's patches, in order: images, and videos' items) and
        ``image_grid_thw`` (N, 3)."""
        if not images:
            return {"pixel_values": torch.zeros((0, self.width)), "image_grid_thw": torch.zeros((0, 3), dtype=torch.int64)}
        return {"pixel_values": torch.cat([item[0] for item in images]),
                "image_grid_thw": torch.stack([item[1] for item in images])}

    def example(self, n: int, generator: torch.Generator, grid: Optional[tuple] = None) -> dict:
        """Pixel fields of ``n`` random images of ``grid`` (default: the largest square ``max_pixels``
        allows): the profiler's and the memory model's example."""
        if grid is None:
            side = int((self.max_pixels ** 0.5) // (self.patch * self.merge)) * self.merge
            grid = (1, max(side, self.merge), max(side, self.merge))
        t, h, w = grid
        return {"pixel_values": torch.randn((n * t * h * w, self.width), generator=generator),
                "image_grid_thw": torch.tensor([list(grid)] * n, dtype=torch.int64)}


def image_processor(pretrained: Optional[str], lo: Optional[int] = None, hi: Optional[int] = None,
                    defaults: Optional[dict] = None):
    """The directory's image processor (``model.pretrained``), else transformers' Qwen2-VL processor with
    ``defaults`` (a family's geometry and normalisation: Qwen3.5's patch 16, mean and std 0.5); ``lo`` / ``hi``
    (``data.min_pixels`` / ``data.max_pixels``: ms-swift's MIN_PIXELS / MAX_PIXELS) override its bounds."""
    if pretrained:
        from transformers import AutoImageProcessor
        proc = AutoImageProcessor.from_pretrained(pretrained, local_files_only=True)
    else:
        from transformers import Qwen2VLImageProcessor
        proc = Qwen2VLImageProcessor(**(defaults or {}))
    if lo or hi:
        size = dict(proc.size)
        size["shortest_edge"] = int(lo or size["shortest_edge"])
        size["longest_edge"] = int(hi or size["longest_edge"])
        proc.size = size
        for key, v in (("min_pixels", size["shortest_edge"]), ("max_pixels", size["longest_edge"])):
            if hasattr(proc, key):
                setattr(proc, key, v)
    return proc
