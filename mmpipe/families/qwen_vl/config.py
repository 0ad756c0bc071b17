"""The ``model:`` section of a native-resolution Qwen2.5-VL (``model.type: qwen2_5_vl``): transformers'
``Qwen2_5_VLConfig`` field names, from a local directory (``model.pretrained``) or these fields."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mmpipe.config.fields import Section, option
from mmpipe.families.towers.common import attention_option


@dataclass
class QwenVisionConfig(Section):
    """The native-resolution ViT (``Qwen2_5_VLVisionConfig``); unset = transformers' default."""
    depth: Optional[int] = option(None, "ViT blocks", ge=1)
    hidden_size: Optional[int] = option(None, "ViT width", ge=1)
    num_heads: Optional[int] = option(None, "attention heads", ge=1)
    intermediate_size: Optional[int] = option(None, "MLP width (SwiGLU)", ge=1)
    patch_size: Optional[int] = option(None, "patch side in pixels (14)", ge=1)
    temporal_patch_size: Optional[int] = option(None, "frames per temporal patch (2; an image is repeated)", ge=1)
    spatial_merge_size: Optional[int] = option(None, "the merger's patch grid side (2: 2x2 patches -> one token)", ge=1)
    window_size: Optional[int] = option(None, "window-attention side in pixels (112)", ge=1)
    fullatt_block_indexes: Optional[list] = option(None, "blocks with full attention over the image (the rest: windows)")


@dataclass
class QwenTextConfig(Section):
    """The Qwen2 decoder with multimodal rotary positions (``Qwen2_5_VLTextConfig``)."""
    hidden_size: Optional[int] = option(None, "width", ge=1)
    num_hidden_layers: Optional[int] = option(None, "decoder blocks", ge=1)
    num_attention_heads: Optional[int] = option(None, "attention heads", ge=1)
    num_key_value_heads: Optional[int] = option(None, "key/value heads (grouped-query attention)", ge=1)
    intermediate_size: Optional[int] = option(None, "MLP width", ge=1)
    vocab_size: Optional[int] = option(None, "vocabulary size; unset = the tokenizer's", ge=1)
    max_position_embeddings: Optional[int] = option(None, "longest sequence", ge=1)
    rope_theta: Optional[float] = option(None, "rotary base", gt=0)
    mrope_section: Optional[list] = option(None, "rotary frequencies per (time, height, width) section; sums to "
                                           "head_dim / 2")
    tie_word_embeddings: Optional[bool] = option(None, "share the input embedding and the LM head (3B and smaller)")


@dataclass
class Qwen25VLConfig(Section):
    type: str = option("qwen2_5_vl", "Qwen2.5-VL at native resolution: each image its own token count "
                       "(transformers' Qwen2_5_VLForConditionalGeneration arithmetic)")
    pretrained: Optional[str] = option(None, "hub id (org/name[@revision]) or local Qwen2_5_VLForConditionalGeneration save_pretrained directory "
                                       "(with its processor and tokenizer)")
    image_token_id: Optional[int] = option(None, "id of <|image_pad|>; unset = the tokenizer's")
    video_token_id: Optional[int] = option(None, "id of <|video_pad|>; unset = the tokenizer's")
    min_pixels: Optional[int] = option(None, "recorded by the run from data.min_pixels (leave unset): the bounds the "
                                       "planner, generation and an export resize images within", ge=1)
    max_pixels: Optional[int] = option(None, "recorded by the run from data.max_pixels (leave unset)", ge=1)
    attention: str = attention_option()
    vision: QwenVisionConfig = field(default_factory=QwenVisionConfig, metadata={"help": "vision tower"})
    llm: QwenTextConfig = field(default_factory=QwenTextConfig, metadata={"help": "language model"})
