"""Qwen2.5-VL layers, with transformers' ``Qwen2_5_VLForConditionalGeneration`` arithmetic (its own
modules: patch embedding, vision blocks, merger, decoder layers, rotary tables)::

    vision: vision.embed (3-D patch embedding; patches put in window order),
            vision.blocks.0 .. D-1 (window attention, full attention at ``fullatt_block_indexes``)
    merger: merger (2x2 patch merger; features back in image order)   -- ms-swift's "aligner"
    llm:    llm.embed (token embedding; image features replace the <|image_pad|> positions),
            llm.blocks.0 .. N-1 (M-RoPE positions from the batch), llm.head (norm + LM head)

Activation contract (floating-point first, integer last)::

    data     (pixel_values, image_grid_thw, input_ids, attention_mask, position_ids)
    vision   (patch hidden states in window order, image_grid_thw, input_ids, attention_mask, position_ids)
    merger   (image features, image_grid_thw, input_ids, attention_mask, position_ids)
    llm      (hidden, input_ids, attention_mask, position_ids)

Shapes change per micro-batch (patches, tokens): the family's ``dynamic_shapes``. Each stage derives
the ViT's attention spans, window order and 2-D rotary table from ``image_grid_thw`` once per
micro-batch (``vision_meta``, remembered on the grid tensor), so only integers cross stages.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from mmpipe.families.chat.layers import through
from mmpipe.families.chat.masks import attention_inputs
from mmpipe.families.towers.varlen import VARLEN_SPANS


class VisionMeta(NamedTuple):
    window_index: torch.Tensor
    reverse: torch.Tensor
    cu_full: torch.Tensor
    cu_window: torch.Tensor
    rotary_pos: torch.Tensor  # (patches, 2) in window order


def vision_meta(grid: torch.Tensor, cfg) -> VisionMeta:
    """The ViT's per-micro-batch integers from the image grids (as transformers derives them),
    computed once per grid tensor."""
    memo = getattr(grid, "_mmpipe_vision_meta", None)
    if memo is not None:
        return memo
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index
    values = grid
    if grid.is_meta:  # shapes only (planning): the values ride on the tensor (``mark_grid``); the spans stay on
        values = getattr(grid, "_mmpipe_grid", None)  # the host, where attention reads their lengths
        if values is None:
            raise ValueError("a meta image_grid_thw without its values (mmpipe.families.qwen_vl.model.mark_grid)")
    merge = cfg.spatial_merge_size
    unit = merge * merge
    window_index, cu_window = get_vision_window_index(values, spatial_merge_size=merge, window_size=cfg.window_size,
                                                      patch_size=cfg.patch_size)
    window_index = window_index.to(values.device)
    pos = get_vision_position_ids(values, merge)
    n = pos.shape[0]
    pos = pos.reshape(n // unit, unit, -1)[window_index].reshape(n, -1)
    dev = grid.device
    meta = VisionMeta(window_index.to(dev), torch.argsort(window_index).to(dev), get_vision_cu_seqlens(values),
                      cu_window, pos.to(dev))
    try:
        grid._mmpipe_vision_meta = meta
    except AttributeError:  # pragma: no cover
        pass
    return meta


def longest_span(cu: torch.Tensor, cfg):
    """The longest span of ``cu`` for a ViT attending by span boundaries (``model.attention: varlen``), read once
    per boundaries tensor; None for sdpa (transformers splits the spans itself)."""
    if cfg._attn_implementation != VARLEN_SPANS:
        return None
    memo = getattr(cu, "_mmpipe_longest", None)
    if memo is None:
        memo = int(cu.diff().max())
        try:
            cu._mmpipe_longest = memo
        except AttributeError:  # pragma: no cover
            pass
    return memo


def mark_grid(grid: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A meta ``image_grid_thw`` carrying its host ``values`` (what ``vision_meta`` reads)."""
    grid._mmpipe_grid = values
    return grid


def _dummy_grid(cfg, device) -> torch.Tensor:
    """One merge unit's grid: what a block runs on when its micro-batch holds no image."""
    return torch.tensor([[1, cfg.spatial_merge_size, cfg.spatial_merge_size]], dtype=torch.int64, device=device)


def vision_classes():
    """(patch embedding, vision block, merger): transformers' modules, subclassed so their weights keep
    transformers' names under each layer (``vision.blocks.3.attn.qkv.weight``)."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as q

    class PatchEmbed(q.Qwen2_5_VisionPatchEmbed):
        """The 3-D patch embedding; its output put in window order (``vision_meta``)."""

        def __init__(self, cfg):
            super().__init__(patch_size=cfg.patch_size, temporal_patch_size=cfg.temporal_patch_size,
                             in_channels=cfg.in_channels, embed_dim=cfg.hidden_size)
            self.cfg = cfg

        def forward(self, pixels, grid):
            h = super().forward(pixels)
            if not h.shape[0]:
                return h
            unit, n = self.cfg.spatial_merge_size ** 2, h.shape[0]
            return h.reshape(n // unit, unit, -1)[vision_meta(grid, self.cfg).window_index].reshape(n, -1)

    class VisionBlock(q.Qwen2_5_VLVisionBlock):
        """A vision block with the tower's 2-D rotary table (non-persistent) and its attention span:
        windows, or each whole image at ``fullatt_block_indexes``."""

        def __init__(self, cfg, index: int):
            super().__init__(cfg)
            self.cfg, self.full = cfg, index in set(cfg.fullatt_block_indexes or ())
            self.rotary = q.Qwen2_5_VLVisionRotaryEmbedding(cfg)

        def forward(self, h, grid):
            meta = vision_meta(grid, self.cfg)
            cu = meta.cu_full if self.full else meta.cu_window
            return super().forward(h, cu_seqlens=cu, position_embeddings=self.rotary(h, meta.rotary_pos),
                                   max_seqlen=longest_span(cu, self.cfg))

    class Merger(q.Qwen2_5_VLPatchMerger):
        """The 2x2 patch merger; features back in image order."""

        def __init__(self, cfg):
            super().__init__(dim=cfg.out_hidden_size, context_dim=cfg.hidden_size,
                             spatial_merge_size=cfg.spatial_merge_size)
            self.cfg = cfg

        def forward(self, h, grid):
            return super().forward(h)[vision_meta(grid, self.cfg).reverse]

    return PatchEmbed, VisionBlock, Merger


def decoder_block_cls():
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLDecoderLayer, Qwen2_5_VLRotaryEmbedding

    class DecoderBlock(Qwen2_5_VLDecoderLayer):
        """transformers' decoder layer with its M-RoPE table (non-persistent); positions come with
        the batch (``positions.rope_positions``), the mask kind from ``attention_inputs``."""

        def __init__(self, config, layer_idx: int):
            super().__init__(config, layer_idx)
            self.rotary = Qwen2_5_VLRotaryEmbedding(config=config)

        def forward(self, hidden_states, attention_mask, position_ids):
            _, mask, spans = attention_inputs(attention_mask, hidden_states.dtype, self.self_attn.config._attn_implementation)
            cos_sin = self.rotary(hidden_states, position_ids)
            out = super().forward(hidden_states, attention_mask=mask, position_embeddings=cos_sin, **spans)
            return out[0] if isinstance(out, tuple) else out

    return DecoderBlock


# ---- layer steps ---------------------------------------------------------------------------------
def vision_embed_step(part, acts):
    pixels, grid, ids, mask, pos = acts
    return part(pixels, grid), grid, ids, mask, pos


def vision_block_step(part, acts):
    h, grid, ids, mask, pos = acts
    if h.shape[0]:
        return part(h, grid), grid, ids, mask, pos
    dummy = _dummy_grid(part.cfg, h.device)  # no image: one merge unit of zeros runs (chat.layers.through)
    return through(lambda z: part(z.expand(dummy.prod().item(), -1), dummy), h), grid, ids, mask, pos


def merger_step(part, acts):
    h, grid, ids, mask, pos = acts
    if h.shape[0]:
        return part(h, grid), grid, ids, mask, pos
    dummy = _dummy_grid(part.cfg, h.device)
    zero = part(h.new_zeros((int(dummy.prod()), h.shape[-1])), dummy)
    return h.new_zeros((0, zero.shape[-1])) + (zero.sum() + h.sum()) * 0.0, grid, ids, mask, pos  # (tied to h)


def llm_embed_step(part, acts):
    feats, _, ids, mask, pos = acts
    return part(ids, feats), ids, mask, pos


def llm_block_step(part, acts):
    h, ids, mask, pos = acts
    return part(h, mask, pos), ids, mask, pos


def llm_head_step(part, acts):
    return part(acts[0])
