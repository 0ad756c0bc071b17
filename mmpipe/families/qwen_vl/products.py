"""Qwen2.5-VL's matrix products per layer (``Family.matmuls``, for analytic FLOPs, TFLOP/s and MFU): the
native-resolution ViT runs on each micro-batch's own patches, its attention within each frame (the
full-attention blocks) or within each window of ``window_size`` pixels (the others), so its cost is
read from the micro-batch's image grids (``micro_batch``: host values, no device read), not from a
fixed image size."""
from __future__ import annotations

import warnings

import torch

from mmpipe.families.products import Matmul, MicroBatch, decoder_products, span_attention_products

VISION_BLOCK = {"qkv": "attn.qkv", "o": "attn.proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                "down": "mlp.down_proj"}


def _spans(n: int, size: int) -> list:
    return [min(size, n - i) for i in range(0, n, size)]


def grid_shape(grids: list, merge: int, window: int) -> tuple:
    """(patches, full-attention pairs, window-attention pairs) of images with patch grids ``grids``
    ((t, h, w) each), windows of ``window`` merged tokens a side (transformers'
    ``get_vision_window_index``: the last window of a row or column holds what is left)."""
    patches = full = windowed = 0
    for t, h, w in grids:
        patches += t * h * w
        full += t * (h * w) ** 2
        rows, cols = _spans(h // merge, window), _spans(w // merge, window)
        windowed += t * merge ** 4 * sum(r * r for r in rows) * sum(c * c for c in cols)
    return patches, full, windowed


def micro_batch(family, batch: dict, mb: MicroBatch) -> MicroBatch:
    """``mb`` with the patches and attention pairs of the batch's ``image_grid_thw`` (its host values:
    a loader's batch, or a meta grid carrying them)."""
    grid = batch.get("image_grid_thw")
    if not torch.is_tensor(grid) or grid.shape[0] == 0:
        return mb._replace(images=0)
    values = getattr(grid, "_mmpipe_grid", grid)
    if values.device.type != "cpu":  # a device grid: reading it would wait for the device
        warnings.warn("qwen_vl FLOPs: a micro-batch's image_grid_thw is on the device without its host values: its "
                      "ViT is priced as one merge unit (tflops / mfu low); count FLOPs on the loader's host batch")
        return mb._replace(images=int(grid.shape[0]))
    v = family.vision_cfg
    merge = v.spatial_merge_size
    patches, full, windowed = grid_shape(values.tolist(), merge, v.window_size // merge // v.patch_size)
    return mb._replace(images=int(grid.shape[0]), patches=patches, full_pairs=full, window_pairs=windowed)


def matmuls(family, name: str, mb: MicroBatch) -> list:
    """The products of layer ``name`` on ``mb``: the ViT's on its patches (a micro-batch without images:
    on the one merge unit its blocks then run on), the merger's on the merged tokens, the decoder's and
    the LM head's on every (padded) token position."""
    v, t = family.vision_cfg, family.text_cfg
    merge = v.spatial_merge_size
    patches, full, windowed = ((mb.patches, mb.full_pairs, mb.window_pairs) if mb.patches
                               else grid_shape([(1, merge, merge)], merge, 1))
    width, heads = v.hidden_size, v.num_heads
    if name == "vision.embed":  # (no images: the blocks start from the merge unit's zero rows)
        if not mb.patches:
            return []
        kernel = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
        return [Matmul(patches, kernel, width, "proj", 0)]
    if name.startswith("vision.blocks."):
        pairs = full if int(name.rsplit(".", 1)[1]) in (v.fullatt_block_indexes or ()) else windowed
        return ([Matmul(patches, width, 3 * width, VISION_BLOCK["qkv"], 1)]
                + span_attention_products(pairs, heads, width // heads)
                + [Matmul(patches, width, width, VISION_BLOCK["o"])]
                + [Matmul(patches, width, v.intermediate_size, VISION_BLOCK[k]) for k in ("gate", "up")]
                + [Matmul(patches, v.intermediate_size, width, VISION_BLOCK["down"], recomputed=False)])
    if name == "merger":
        tokens, wide = patches // merge ** 2, width * merge ** 2
        return [Matmul(tokens, wide, wide, "mlp.0", 1), Matmul(tokens, wide, v.out_hidden_size, "mlp.2", recomputed=False)]
    return decoder_products(name, mb, t)
