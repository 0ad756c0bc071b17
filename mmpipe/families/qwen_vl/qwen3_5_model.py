"""Qwen3.5's pipeline layers: transformers' modules (``Qwen3_5ForConditionalGeneration``'s arithmetic), cut
into mmpipe's layers, with what a packed row needs.

- The ViT (patch 16, temporal patch 2): the patch embedding plus the learned position grid resampled
  bilinearly to each image's grid, blocks attending within each frame (2-D rotary), the 2x2 merger. Each
  stage derives the integers it needs from the micro-batch's image grids once (``vision_meta``).
- The hybrid decoder: per ``layer_types``, a GatedDeltaNet block (linear attention: a causal depthwise
  conv and a gated delta-rule recurrence) or a gated full-attention block (q/k norm, output gate, partial
  rotary over interleaved multimodal positions). **A packed row's samples never share state**: a
  linear-attention block runs its conv and recurrence on each sample of the row separately (both start
  from zero at the sample's first token, forward and backward), and full attention stays within a sample
  (the block-diagonal mask of ``chat.masks``), as it does for Qwen2.5-VL. Padding after a row's tokens is
  causal-invisible and left as it is. Where flash-linear-attention / causal-conv1d are installed, the
  same rule is theirs (``cu_seqlens`` / ``seq_idx``); here the per-sample split is the reference path.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from mmpipe.families.chat.masks import attention_inputs, mask_kind
from mmpipe.families.qwen_vl.model import longest_span


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


def decoder_block_cls():
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        Qwen3_5DecoderLayer,
        Qwen3_5GatedDeltaNet,
        Qwen3_5TextRotaryEmbedding,
    )

    class SampleWiseGatedDeltaNet(Qwen3_5GatedDeltaNet):
        """A GatedDeltaNet that keeps a row's samples apart: ``attention_mask`` (the batch's: segment ids, 0 =
        padding) decides. Rows of one sample then padding run whole (the padding comes after every real token:
        a causal conv and recurrence never carry it back); left padding as transformers runs it (its inputs
        zeroed); a packed row sample by sample, each from a zero conv window and a zero state, its outputs
        written back in place (padding: zeros)."""

        def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
            kind = None if attention_mask is None or cache is not None else mask_kind(attention_mask)
            if kind == "packed" and attention_mask.is_meta:  # shapes only (the memory plan): the row whole, the
                kind = "causal"  # same output shape; a packed row's samples have no values here to split by
            if kind != "packed":
                return super().forward(hidden_states, cache=cache, attention_mask=attention_mask if kind == "dense"
                                       else None, **kwargs)
            out = hidden_states.new_zeros(hidden_states.shape[:-1] + (self.out_proj.out_features,))
            for b, row in enumerate(attention_mask.tolist()):
                for start, end in sample_spans(row):
                    out[b, start:end] = super().forward(hidden_states[b:b + 1, start:end], **kwargs)[0]
            return out

    class DecoderBlock(Qwen3_5DecoderLayer):
        """transformers' hybrid decoder layer with its interleaved M-RoPE table (non-persistent); positions
        come with the batch, the mask kind from ``attention_inputs``; a linear-attention layer keeps a packed
        row's samples apart (``SampleWiseGatedDeltaNet``)."""

        def __init__(self, config, layer_idx: int):
            super().__init__(config, layer_idx)
            if self.block_type == "linear_attention":
                self.linear_attn.__class__ = SampleWiseGatedDeltaNet  # (its parameters as built: same names)
            else:
                self.rotary = Qwen3_5TextRotaryEmbedding(config=config)

        def forward(self, hidden_states, attention_mask, position_ids):
            if self.block_type == "linear_attention":
                return super().forward(hidden_states, position_embeddings=None, attention_mask=attention_mask)
            _, mask, spans = attention_inputs(attention_mask, hidden_states.dtype, self.self_attn.config._attn_implementation)
            cos_sin = self.rotary(hidden_states, position_ids)
            return super().forward(hidden_states, position_embeddings=cos_sin, attention_mask=mask, **spans)

    return DecoderBlock


def sample_spans(segments: list) -> list:
    """[(start, end)] of each sample (a run of one segment id > 0) of a packed row."""
    out, start = [], None
    for t, s in enumerate(segments + [0]):
        if start is not None and (s != segments[start] or s == 0):
            out.append((start, t))
            start = None
        if start is None and s > 0:
            start = t
    return out
