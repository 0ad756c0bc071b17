"""The ``model:`` section of Qwen3-VL (``model.type: qwen3_vl``): transformers' ``Qwen3VLConfig`` field names,
from a local directory or hub id (``model.pretrained``) or these fields (unset: transformers' default)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mmpipe.config.fields import Section, option
from mmpipe.families.qwen_vl.qwen3_vision import Qwen3VisionConfig
from mmpipe.families.towers.common import attention_option


@dataclass
class Qwen3VLVisionConfig(Qwen3VisionConfig):
    """Qwen3's ViT (``Qwen3VLVisionConfig``) with DeepStack: chosen blocks' features, each through its own
    merger, added into the first decoder layers."""
    deepstack_visual_indexes: Optional[list] = option(None, "ViT blocks whose output (through its own merger) is "
                                                      "added at the image positions after decoder layer 0, 1, ...: "
                                                      "[8, 16, 24] in the released checkpoints")


@dataclass
class Qwen3VLTextConfig(Section):
    """The Qwen3 decoder (q/k norm) with interleaved multimodal rotary positions (``Qwen3VLTextConfig``)."""
    hidden_size: Optional[int] = option(None, "width", ge=1)
    num_hidden_layers: Optional[int] = option(None, "decoder blocks", ge=1)
    num_attention_heads: Optional[int] = option(None, "query heads", ge=1)
    num_key_value_heads: Optional[int] = option(None, "key/value heads (grouped-query attention)", ge=1)
    head_dim: Optional[int] = option(None, "head width", ge=1)
    intermediate_size: Optional[int] = option(None, "MLP width", ge=1)
    vocab_size: Optional[int] = option(None, "vocabulary size; unset = the tokenizer's", ge=1)
    max_position_embeddings: Optional[int] = option(None, "longest sequence", ge=1)
    rope_theta: Optional[float] = option(None, "rotary base (5000000)", gt=0)
    mrope_section: Optional[list] = option(None, "rotary frequencies per (time, height, width), interleaved; sums "
                                           "to head_dim / 2 ([24, 20, 20])")
    tie_word_embeddings: Optional[bool] = option(None, "share the input embedding and the LM head (2B and 4B)")


@dataclass
class Qwen3VLConfig(Section):
    type: str = option("qwen3_vl", "Qwen3-VL at native resolution with DeepStack (transformers' "
                       "Qwen3VLForConditionalGeneration arithmetic)")
    pretrained: Optional[str] = option(None, "hub id (org/name[@revision]) or local Qwen3VLForConditionalGeneration "
                                       "save_pretrained directory (with its processor and tokenizer)")
    image_token_id: Optional[int] = option(None, "id of <|image_pad|>; unset = the tokenizer's")
    video_token_id: Optional[int] = option(None, "id of <|video_pad|>; unset = the tokenizer's")
    min_pixels: Optional[int] = option(None, "recorded by the run from data.min_pixels (leave unset)", ge=1)
    max_pixels: Optional[int] = option(None, "recorded by the run from data.max_pixels (leave unset)", ge=1)
    attention: str = attention_option()
    vision: Qwen3VLVisionConfig = field(default_factory=Qwen3VLVisionConfig, metadata={"help": "vision tower"})
    llm: Qwen3VLTextConfig = field(default_factory=Qwen3VLTextConfig, metadata={"help": "language model"})
