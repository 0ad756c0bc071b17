"""Qwen2.5-VL's batches: the chat home's collate plus the multimodal rotary positions of every token
(``positions.rope_positions``), computed here on the host, once per micro-batch."""
from __future__ import annotations

from mmpipe.families.chat.dataset import ChatCollate
from mmpipe.families.qwen_vl.positions import rope_positions


class RopeCollate(ChatCollate):
    """``ChatCollate`` + ``position_ids`` (3, B, T). Picklable (loader workers)."""

    def __init__(self, pad_id: int, pixels, pad_multiple: int = 1, pad_to=None, image_id: int = 0, merge: int = 2):
        super().__init__(pad_id, pixels, pad_multiple, pad_to)
        self.image_id, self.merge = image_id, merge

    def __call__(self, items: list) -> dict:
        out = super().__call__(items)
        out["position_ids"] = rope_positions(out["input_ids"], out["image_grid_thw"], out["attention_mask"],
                                             self.image_id, self.merge)
        return out
