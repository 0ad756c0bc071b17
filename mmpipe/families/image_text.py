"""Image+text families: pixel values, token ids and an attention mask go to the first stage, and
the data defaults are an image-caption manifest (``data/manifest.py``), decoded images at the
model's size and a tokenizing ``Collate`` (open_clip's task / ``ImageTextTask`` split is the model).
A family with other records (the VLM's chats) overrides the data methods and keeps the rest."""
from __future__ import annotations

from typing import ClassVar

from mmpipe.data.loader import Collate, ImageTextDataset
from mmpipe.data.manifest import read_manifest
from mmpipe.families.base import Family


class ImageTextFamily(Family):
    inputs: ClassVar[tuple] = ("pixel_values", "input_ids", "attention_mask")

    @classmethod
    def image_size(cls, model_cfg) -> int:
        raise NotImplementedError

    @classmethod
    def read_records(cls, path: str, data_cfg, key: str) -> list:
        """An image-caption manifest (CSV, TSV or JSONL; ``key`` names it in errors)."""
        return read_manifest(path, key)

    @classmethod
    def record_texts(cls, records: list) -> list:
        return [s.text for s in records]

    def dataset(self, records: list, tokenizer, data_cfg, image_size: int, augment=None, decode_size=None):
        return ImageTextDataset(records, image_size, augment, decode_size or image_size)

    def collate(self, tokenizer, data_cfg):
        return Collate(tokenizer, data_cfg.max_length, data_cfg.padding, data_cfg.pad_multiple)
