"""Image+text families: pixel values, token ids and an attention mask go to the first stage, and
the data defaults are an image-caption manifest (``data/manifest.py``), decoded images at the
model's size and a tokenizing ``Collate`` (open_clip's task / ``ImageTextTask`` split is the model).
A family with other records (the VLM's chats) overrides the data methods and keeps the rest."""
from __future__ import annotations

from typing import ClassVar

from mmpipe.data.loader import Collate, ImageTextDataset
from mmpipe.data.manifest import read_manifest
from mmpipe.data.pixels import square_pixels
from mmpipe.families.base import Family


class ImageTextFamily(Family):
    inputs: ClassVar[tuple] = ("pixel_values", "input_ids", "attention_mask")
    data_format: ClassVar[str] = "captions"

    @classmethod
    def image_size(cls, model_cfg) -> int:
        """The side of the square images the tower takes (the family's own: the data layer asks
        ``pixels``)."""
        raise NotImplementedError

    @classmethod
    def pixels(cls, model_cfg, data_cfg, seed=None):
        """Square images at the tower's size (``data.decode_size`` / ``data.augment`` apply)."""
        return square_pixels(cls.image_size(model_cfg), data_cfg, seed)

    @classmethod
    def read_records(cls, path: str, data_cfg, key: str) -> list:
        """An image-caption manifest (CSV, TSV or JSONL; ``key`` names it in errors)."""
        return read_manifest(path, key)

    @classmethod
    def record_texts(cls, records: list) -> list:
        return [s.text for s in records]

    def dataset(self, records: list, tokenizer, data_cfg, seed=None):
        return ImageTextDataset(records, self.pixels(self.cfg, data_cfg, seed))

    def collate(self, tokenizer, data_cfg):
        return Collate(tokenizer, data_cfg.max_length, data_cfg.padding, data_cfg.pad_multiple)
