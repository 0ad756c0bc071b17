"""The ``model:`` section of Qwen3-VL-MoE (``model.type: qwen3_vl_moe``): transformers' ``Qwen3VLMoeConfig`` field
names, from a local directory or hub id (``model.pretrained``) or these fields (unset: transformers' default)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mmpipe.config.fields import Section, option
from mmpipe.families.qwen_vl.experts import ExpertFields
from mmpipe.families.qwen_vl.qwen3_vl_config import Qwen3VLTextConfig, Qwen3VLVisionConfig
from mmpipe.families.towers.common import attention_option


@dataclass
class Qwen3VLMoeTextConfig(ExpertFields, Qwen3VLTextConfig):
    """The Qwen3 decoder with sparse MoE blocks (``Qwen3VLMoeTextConfig``): routed experts, no shared expert;
    ``intermediate_size`` is the width of the dense blocks ``mlp_only_layers`` / ``decoder_sparse_step`` leave."""
    decoder_sparse_step: Optional[int] = option(None, "every this many blocks one is sparse (1: all)", ge=1)
    mlp_only_layers: Optional[list] = option(None, "blocks with a dense MLP instead of experts ([])")


@dataclass
class Qwen3VLMoeConfig(Section):
    type: str = option("qwen3_vl_moe", "Qwen3-VL-MoE at native resolution with DeepStack: the Qwen3 decoder with "
                       "routed experts (transformers' Qwen3VLMoeForConditionalGeneration arithmetic)")
    pretrained: Optional[str] = option(None, "hub id (org/name[@revision]) or local Qwen3VLMoeForConditionalGeneration "
                                       "save_pretrained directory (with its processor and tokenizer)")
    image_token_id: Optional[int] = option(None, "id of <|image_pad|>; unset = the tokenizer's")
    video_token_id: Optional[int] = option(None, "id of <|video_pad|>; unset = the tokenizer's")
    min_pixels: Optional[int] = option(None, "recorded by the run from data.min_pixels (leave unset)", ge=1)
    max_pixels: Optional[int] = option(None, "recorded by the run from data.max_pixels (leave unset)", ge=1)
    attention: str = attention_option()
    vision: Qwen3VLVisionConfig = field(default_factory=Qwen3VLVisionConfig, metadata={"help": "vision tower"})
    llm: Qwen3VLMoeTextConfig = field(default_factory=Qwen3VLMoeTextConfig, metadata={"help": "language model"})
