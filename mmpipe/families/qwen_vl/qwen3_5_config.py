"""The ``model:`` section of Qwen3.5 (``model.type: qwen3_5``): transformers' ``Qwen3_5Config`` field names,
from a local directory (``model.pretrained``) or these fields (unset: transformers' default)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mmpipe.config.fields import Section, option
from mmpipe.families.qwen_vl.qwen3_vision import Qwen3VisionConfig
from mmpipe.families.towers.common import attention_option


@dataclass
class Qwen35TextConfig(Section):
    """The hybrid decoder (``Qwen3_5TextConfig``): GatedDeltaNet linear attention and gated full attention."""
    hidden_size: Optional[int] = option(None, "width", ge=1)
    num_hidden_layers: Optional[int] = option(None, "decoder blocks", ge=1)
    layer_types: Optional[list] = option(None, "per block: linear_attention or full_attention; unset = "
                                         "full_attention_interval's pattern")
    full_attention_interval: Optional[int] = option(None, "unset layer_types: every this many blocks one full "
                                                    "attention (4: three linear, one full)", ge=1)
    num_attention_heads: Optional[int] = option(None, "full attention: query heads", ge=1)
    num_key_value_heads: Optional[int] = option(None, "full attention: key/value heads", ge=1)
    head_dim: Optional[int] = option(None, "full attention: head width", ge=1)
    partial_rotary_factor: Optional[float] = option(None, "full attention: the share of a head that rotates (0.25)",
                                                    gt=0, le=1)
    linear_num_key_heads: Optional[int] = option(None, "GatedDeltaNet: query/key heads", ge=1)
    linear_num_value_heads: Optional[int] = option(None, "GatedDeltaNet: value heads (a multiple of the key heads)",
                                                   ge=1)
    linear_key_head_dim: Optional[int] = option(None, "GatedDeltaNet: query/key head width", ge=1)
    linear_value_head_dim: Optional[int] = option(None, "GatedDeltaNet: value head width", ge=1)
    linear_conv_kernel_dim: Optional[int] = option(None, "GatedDeltaNet: the causal depthwise conv's width (4)", ge=1)
    intermediate_size: Optional[int] = option(None, "MLP width", ge=1)
    vocab_size: Optional[int] = option(None, "vocabulary size; unset = the tokenizer's", ge=1)
    max_position_embeddings: Optional[int] = option(None, "longest sequence", ge=1)
    rope_theta: Optional[float] = option(None, "rotary base", gt=0)
    mrope_section: Optional[list] = option(None, "rotary frequencies per (time, height, width), interleaved; sums to "
                                           "the rotary half of a head (head_dim x partial_rotary_factor / 2)")
    tie_word_embeddings: Optional[bool] = option(None, "share the input embedding and the LM head")


@dataclass
class Qwen35Config(Section):
    type: str = option("qwen3_5", "Qwen3.5 at native resolution: a hybrid decoder of GatedDeltaNet and gated full "
                       "attention (transformers' Qwen3_5ForConditionalGeneration arithmetic)")
    pretrained: Optional[str] = option(None, "hub id (org/name[@revision]) or local Qwen3_5ForConditionalGeneration save_pretrained directory (with "
                                       "its processor and tokenizer)")
    image_token_id: Optional[int] = option(None, "id of <|image_pad|>; unset = the tokenizer's")
    video_token_id: Optional[int] = option(None, "id of <|video_pad|>; unset = the tokenizer's")
    min_pixels: Optional[int] = option(None, "recorded by the run from data.min_pixels (leave unset)", ge=1)
    max_pixels: Optional[int] = option(None, "recorded by the run from data.max_pixels (leave unset)", ge=1)
    attention: str = attention_option()
    vision: Qwen3VisionConfig = field(default_factory=Qwen3VisionConfig, metadata={"help": "vision tower"})
    llm: Qwen35TextConfig = field(default_factory=Qwen35TextConfig, metadata={"help": "language model"})
