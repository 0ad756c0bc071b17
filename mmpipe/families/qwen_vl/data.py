"""Qwen2.5-VL's batches: the chat home's collate plus the multimodal rotary positions of every token
(``positions.rope_positions``), computed here on the host, once per micro-batch."""
from __future__ import annotations

from mmpipe.families.chat.dataset import ChatCollate
from mmpipe.families.qwen_vl.positions import rope_positions


class RopeCollate(ChatCollate):
    """``ChatCollate`` + ``position_ids`` (3, B, T). Picklable (loader workers)."""

    def __init__(self, pad_id: int, pixels, pad_multiple: int = 1, pad_to=None, image_id: int = 0, merge: int = 2,
                 video_id=None):
        super().__init__(pad_id, pixels, pad_multiple, pad_to)
        self.image_id, self.merge, self.video_id = image_id, merge, video_id

    def __call__(self, items: list) -> dict:
        out = super().__call__(items)
        visual = [v for it in items for v in it["images"]]
        intervals = [v[2] if len(v) > 2 else None for v in visual]  # (a Qwen2.5-VL video's time scale)
        out["position_ids"] = rope_positions(out["input_ids"], out["image_grid_thw"], out["attention_mask"],
                                             self.image_id, self.merge, self.video_id,
                                             intervals if any(i is not None for i in intervals) else None)
        return out
