"""Multimodal rotary positions (M-RoPE), computed in the loader's collate, where the token ids, the
image grids and the packing segments are all on the host: ``(3, B, T)`` (time, height, width).

As transformers' ``Qwen2_5_VLModel.get_rope_index``: text tokens count up in all three sections; an
image's tokens take (start, start + row, start + col) over its merged grid; text after an image
resumes at the image's largest position + 1 (start + max(h, w) / merge). A packed row restarts at 0 at
each sample (``attention_mask`` holding segment ids), in all three sections, so a packed sample gets
exactly the positions it gets alone; padding gets 0. A video's tokens (``video_id``) take its item's grid the
same way; a Qwen2.5-VL video's time index is scaled (``intervals``: ``tokens_per_second x second_per_grid_t``,
as transformers' ``get_rope_index``: ``(t x interval).long()`` in float32)."""
from __future__ import annotations

import torch


def rope_positions(input_ids: torch.Tensor, grids: torch.Tensor, attention_mask: torch.Tensor, image_id: int,
                   merge: int, video_id=None, intervals=None) -> torch.Tensor:
    """``(3, B, T)`` int64 positions; ``grids``: ``(N, 3)`` the batch's visual items in token order (images,
    videos' items); ``intervals``: per item, a video's time scale (None: an image's, or a Qwen3 frame's)."""
    visual = {image_id} | ({video_id} if video_id is not None else set())
    B, T = input_ids.shape
    out = torch.zeros((3, B, T), dtype=torch.int64)
    grid_list = [tuple(int(v) for v in g) for g in grids.tolist()]
    k = 0  # next image of the batch
    ids, mask = input_ids.tolist(), attention_mask.tolist()
    for b in range(B):
        row, seg = ids[b], mask[b]
        t, pos = 0, 0
        while t < T:
            if seg[t] == 0:
                t += 1
                continue
            if t == 0 or seg[t] != seg[t - 1]:
                pos = 0  # a new sample of a packed row
            if row[t] not in visual:
                out[:, b, t] = pos
                pos += 1
                t += 1
                continue
            gt, gh, gw = grid_list[k]
            scale = intervals[k] if intervals is not None else None
            k += 1
            h, w = gh // merge, gw // merge
            n = gt * h * w
            times = torch.arange(gt) if scale is None else (torch.arange(gt) * torch.tensor(scale, dtype=torch.float32)).long()
            tt = times.repeat_interleave(h * w)
            hh = torch.arange(h).repeat_interleave(w).repeat(gt)
            ww = torch.arange(w).repeat(gt * h)
            out[:, b, t:t + n] = torch.stack([tt, hh, ww]) + pos
            pos += max(h, w)
            t += n
    if k != len(grid_list):
        raise ValueError(f"{len(grid_list)} images but {k} runs of image tokens in the batch")
    return out
