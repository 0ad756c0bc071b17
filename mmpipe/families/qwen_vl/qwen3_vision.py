"""The vision side Qwen3.5 and Qwen3-VL share (one home, no family importing a sibling): the ViT's
``model.vision`` fields, its pipeline modules (patch 16, temporal patch 2: the patch embedding plus the learned
position grid resampled bilinearly to each image's grid, blocks attending within each frame with 2-D rotary,
the 2x2 merger; each stage derives the integers it needs from the micro-batch's image grids once,
``vision_meta``), and what a family with it declares (``Qwen3Vision``: the processor classes its checkpoints
save, the processor without a directory, the video layout)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from mmpipe.config.fields import Section, option
from mmpipe.families.qwen_vl.model import longest_span


@dataclass
class Qwen3VisionConfig(Section):
    """The ViT (``Qwen3_5VisionConfig``, ``Qwen3VLVisionConfig``): learned position grid, 2-D rotary,
    attention within each frame."""
    depth: Optional[int] = option(None, "ViT blocks", ge=1)
    hidden_size: Optional[int] = option(None, "ViT width", ge=1)
    num_heads: Optional[int] = option(None, "attention heads", ge=1)
    intermediate_size: Optional[int] = option(None, "MLP width (gelu-tanh)", ge=1)
    patch_size: Optional[int] = option(None, "patch side in pixels (16)", ge=1)
    temporal_patch_size: Optional[int] = option(None, "frames per temporal patch (2; an image is repeated)", ge=1)
    spatial_merge_size: Optional[int] = option(None, "the merger's patch grid side (2: 2x2 patches -> one token)", ge=1)
    num_position_embeddings: Optional[int] = option(None, "the learned position grid's entries (a square: 2304 = "
                                                    "48 x 48), resampled bilinearly to each image's grid", ge=1)


class Qwen3Vision:
    """What a family on Qwen3's ViT declares (listed before its base: ``class F(Qwen3Vision, Qwen25VLFamily)``)."""
    processor_classes = ("Qwen3VLProcessor", "Qwen3VLVideoProcessor")
    video_style = "qwen3"  # an item per temporal patch, after its timestamp text

    @classmethod
    def processor_defaults(cls, model_cfg) -> dict:
        """Without a directory: the processor Qwen3.5 and Qwen3-VL checkpoints save (patch 16, mean and std
        0.5), at the model's patch and merge sizes."""
        v = model_cfg.vision
        return {"patch_size": v.patch_size or 16, "temporal_patch_size": v.temporal_patch_size or 2,
                "merge_size": v.spatial_merge_size or 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


class VisionMeta(NamedTuple):
    interp_indices: torch.Tensor
    interp_weights: torch.Tensor
    position_ids: torch.Tensor  # (patches, 2): each patch's (row, column), in the processor's merge-block order
    cu_seqlens: torch.Tensor  # per frame


def vision_meta(grid: torch.Tensor, cfg) -> VisionMeta:
    """The ViT's per-micro-batch integers from the image grids, as transformers derives them (once per grid
    tensor; a meta grid carries its host values: ``qwen_vl.model.mark_grid``)."""
    memo = getattr(grid, "_mmpipe_q35_meta", None)
    if memo is not None:
        return memo
    from transformers.vision_utils import (
        get_vision_cu_seqlens,
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
    )
    values = getattr(grid, "_mmpipe_grid", None) if grid.is_meta else grid
    if values is None:
        raise ValueError("a meta image_grid_thw without its values (mmpipe.families.qwen_vl.model.mark_grid)")
    side = int(cfg.num_position_embeddings ** 0.5)
    idx, w = get_vision_interpolation_indices_and_weights(values, num_grid_per_side=side, mode="bilinear",
                                                          align_corners=True,
                                                          spatial_merge_size=cfg.spatial_merge_size)
    dev = grid.device
    meta = VisionMeta(idx.to(dev), w.to(dev), get_vision_position_ids(values, cfg.spatial_merge_size).to(dev),
                      get_vision_cu_seqlens(values))
    try:
        grid._mmpipe_q35_meta = meta
    except AttributeError:  # pragma: no cover
        pass
    return meta


def vision_classes():
    """(patch embedding with the position grid, vision block, merger): transformers' modules, subclassed so
    their weights keep transformers' names under each layer."""
    from torch import nn
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q

    class PatchEmbed(nn.Module):
        """``patch_embed`` (a Conv3d over each patch) + ``pos_embed`` (the learned square grid, resampled)."""

        def __init__(self, cfg):
            super().__init__()
            self.cfg = cfg
            self.patch_embed = q.Qwen3_5VisionPatchEmbed(config=cfg)
            self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)

        def forward(self, pixels, grid):
            h = self.patch_embed(pixels)
            if not h.shape[0]:  # no image: the position grid still runs (on no index: ZeRO-3 gathers it on every
                idx = torch.zeros((0, 4), dtype=torch.int64, device=h.device)  # rank alike, DeepSpeed #7170)
                return h + self.pos_embed(idx).sum(1).to(h.dtype)
            meta = vision_meta(grid, self.cfg)
            pos = (self.pos_embed(meta.interp_indices) * meta.interp_weights[:, :, None]).sum(1)
            return h + pos.to(h.dtype)

    class VisionBlock(q.Qwen3_5VisionBlock):
        """A vision block with the tower's 2-D rotary table (non-persistent), attending within each frame."""

        def __init__(self, cfg, index: int):
            super().__init__(cfg)
            self.cfg = cfg
            self.rotary = q.Qwen3_5VisionRotaryEmbedding(cfg)

        def forward(self, h, grid):
            meta = vision_meta(grid, self.cfg)
            return super().forward(h, cu_seqlens=meta.cu_seqlens, position_embeddings=self.rotary(h, meta.position_ids),
                                   max_seqlen=longest_span(meta.cu_seqlens, self.cfg))

    class Merger(q.Qwen3_5VisionPatchMerger):
        def __init__(self, cfg):
            super().__init__(config=cfg, use_postshuffle_norm=False)
            self.cfg = cfg

        def forward(self, h, grid):
            return super().forward(h)

    return PatchEmbed, VisionBlock, Merger
