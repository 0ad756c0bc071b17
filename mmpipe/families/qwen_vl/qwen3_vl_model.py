"""Qwen3-VL's pipeline layers: Qwen3's ViT (``qwen3_vision``: one home for it), DeepStack's mergers and the
Qwen3 decoder, with ``Qwen3VLForConditionalGeneration``'s arithmetic.

**DeepStack on a pipeline: the features travel.** After each ViT block of ``deepstack_visual_indexes`` a layer
``deepstack.k`` (its own merger, ``use_postshuffle_norm``) appends that block's merged features to the activation
tuple; they ride with the hidden states, across any cut, to decoder layer ``k``, which adds them at the image
positions after its own output (as transformers' ``_deepstack_process``) and drops them from the tuple. Their
gradients go back the same way to the ViT's blocks. So every cut the planner can place trains exactly; what
crosses a cut (the profiler measures each layer's output tuple: ``out_bytes``, ``out_tensors``) is priced by the
simulator and the memory model like any activation::

    vision   (patches, *deepstack features so far, image_grid_thw, input_ids, attention_mask, position_ids)
    merger   (image features, *deepstack features, image_grid_thw, input_ids, attention_mask, position_ids)
    llm      (hidden, *deepstack features not yet added, input_ids, attention_mask, position_ids)

A micro-batch without images carries empty features, tied to one merge unit of zeros run through each merger
(every rank's backward reaches the same parameters: ZeRO stays in step).
"""
from __future__ import annotations

from functools import lru_cache, partial

import torch

from mmpipe.errors import ConfigError
from mmpipe.families.base import Layer
from mmpipe.families.chat.masks import attention_inputs
from mmpipe.families.qwen_vl import model as m
from mmpipe.families.qwen_vl import products
from mmpipe.families.qwen_vl.hf_config import check_mrope
from mmpipe.families.qwen_vl.qwen3_vision import vision_classes  # noqa: F401 - this family's ViT (``model_parts``)
from mmpipe.families.towers.common import init_transformer_part


def deepstack_merger_cls():
    """DeepStack's merger: Qwen3.5's / Qwen3-VL's patch merger with its norm after the 2x2 shuffle."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionPatchMerger

    class DeepStackMerger(Qwen3VLVisionPatchMerger):
        def __init__(self, cfg):
            super().__init__(config=cfg, use_postshuffle_norm=True)
            self.cfg = cfg

        def forward(self, h, grid):
            return super().forward(h)

    return DeepStackMerger


def decoder_block_cls():
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextDecoderLayer, Qwen3VLTextRotaryEmbedding
    return qwen3_block_cls(Qwen3VLTextDecoderLayer, Qwen3VLTextRotaryEmbedding)


@lru_cache(maxsize=None)
def qwen3_block_cls(layer_cls, rotary_cls):
    """transformers' Qwen3 decoder layer ``layer_cls`` (Qwen3-VL's, Qwen3-VL-MoE's) as a pipeline block with the
    interleaved M-RoPE table of ``rotary_cls``."""

    class DecoderBlock(layer_cls):
        """transformers' Qwen3 decoder layer with its interleaved M-RoPE table (non-persistent); positions come
        with the batch, the mask kind from ``attention_inputs``."""

        def __init__(self, config, layer_idx: int):
            super().__init__(config, layer_idx)
            self.rotary = rotary_cls(config=config)

        def forward(self, hidden_states, attention_mask, position_ids):
            _, mask, spans = attention_inputs(attention_mask, hidden_states.dtype, self.self_attn.config._attn_implementation)
            cos_sin = self.rotary(hidden_states, position_ids)
            return super().forward(hidden_states, position_embeddings=cos_sin, attention_mask=mask, **spans)

    return DecoderBlock


# ---- layer steps: the tuple (h, *deepstack, ...integers) --------------------------------------------------
_INTS_VISION = 4  # image_grid_thw, input_ids, attention_mask, position_ids
_INTS_LLM = 3  # input_ids, attention_mask, position_ids


def vision_block_step(part, acts):
    ints, deep = acts[-_INTS_VISION:], acts[1:-_INTS_VISION]
    out = m.vision_block_step(part, (acts[0],) + tuple(ints))
    return (out[0],) + tuple(deep) + tuple(ints)


def deepstack_step(part, acts):
    """The block's features through DeepStack's merger, appended (no image: an empty tensor tied to one merge
    unit of zeros through it)."""
    h, ints = acts[0], tuple(acts[-_INTS_VISION:])
    feats = m.merger_step(part, (h,) + ints)[0]
    return (h,) + tuple(acts[1:-_INTS_VISION]) + (feats,) + ints


def merger_step(part, acts):
    ints = tuple(acts[-_INTS_VISION:])
    return (m.merger_step(part, (acts[0],) + ints)[0],) + tuple(acts[1:-_INTS_VISION]) + ints


def llm_embed_step(part, acts):
    feats, deep = acts[0], tuple(acts[1:-_INTS_VISION])
    _, ids, mask, pos = acts[-_INTS_VISION:]
    return (part(ids, feats),) + deep + (ids, mask, pos)


def llm_block_step(part, acts, visual_ids: tuple = ()):
    """The block, then (while any are left) the next DeepStack features added at the image and video positions
    (``visual_ids``: their token ids, bound by the family with ``functools.partial``)."""
    h, deep = acts[0], tuple(acts[1:-_INTS_LLM])
    ids, mask, pos = acts[-_INTS_LLM:]
    h = part(h, mask, pos)
    if deep:
        h = deepstack_add(h, ids, deep[0], visual_ids)
    return (h,) + deep[1:] + (ids, mask, pos)


def deepstack_add(h, ids, feats, visual_ids: tuple):
    """``h`` with ``feats`` (one row per image or video token, in order) added at those positions (transformers'
    ``_deepstack_process``; masked_scatter keeps shapes static for the meta-device planner)."""
    where = ids == visual_ids[0]
    for other in visual_ids[1:]:
        where = where | (ids == other)
    where = where.unsqueeze(-1)
    return h + torch.zeros_like(h).masked_scatter(where, feats.reshape(-1, h.shape[-1]).to(h.dtype))


class DeepStack:
    """What a family with DeepStack declares (listed before its base): the ``deepstack.k`` layers after their ViT
    blocks, the decoder blocks that add their features (the steps above), DeepStack's mergers in the merger
    group, their products."""
    # DeepStack's mergers are ms-swift's "aligner" beside the merger (its qwen3_vl model_arch)
    default_groups = {"vision": [r"^vision\."], "merger": [r"^merger\.", r"^deepstack\."], "llm": [r"^llm\."]}

    def __init__(self, model_cfg, seed: int = 0):
        super().__init__(model_cfg, seed)
        deep = list(self.vision_cfg.deepstack_visual_indexes or [])
        visual = (self.image_token_id,) + ((self.video_token_id,) if self.video_token_id is not None else ())
        block = partial(llm_block_step, visual_ids=visual)
        layers = [Layer("vision.embed", "vision", m.vision_embed_step)]
        for i in range(self.vision_cfg.depth):
            layers.append(Layer(f"vision.blocks.{i}", "vision", vision_block_step))
            if i in deep:
                layers.append(Layer(f"deepstack.{deep.index(i)}", "vision", deepstack_step))
        self._layers = (layers + [Layer("merger", "merger", merger_step, takes=("vision",)),
                                  Layer("llm.embed", "llm", llm_embed_step, takes=("merger",))]
                        + [Layer(f"llm.blocks.{i}", "llm", block) for i in range(self.text_cfg.num_hidden_layers)]
                        + [Layer("llm.head", "llm", m.llm_head_step)])

    def matmuls(self, name: str, mb) -> list:
        return products.qwen3_vl_matmuls(self, name, mb)

    def build_unseeded(self, name: str):
        if not name.startswith("deepstack."):
            return super().build_unseeded(name)
        module = deepstack_merger_cls()(self.vision_cfg)
        init_transformer_part(module, std=getattr(self.text_cfg, "initializer_range", 0.02))
        return module


def check_deepstack(top, default_section: list) -> None:
    """One line for a model transformers would build wrong or fail on."""
    t, v = top.text_config, top.vision_config
    check_mrope(t, default_section)
    deep = list(v.deepstack_visual_indexes or [])
    if sorted(set(deep)) != deep or any(not 0 <= i < v.depth for i in deep):
        raise ConfigError(f"model.vision.deepstack_visual_indexes={deep}: give increasing ViT block indexes below "
                          f"model.vision.depth={v.depth}")
    if len(deep) > t.num_hidden_layers:
        raise ConfigError(f"model.vision.deepstack_visual_indexes has {len(deep)} entries but the decoder has "
                          f"{t.num_hidden_layers} layers to add them into: give at most {t.num_hidden_layers}")
