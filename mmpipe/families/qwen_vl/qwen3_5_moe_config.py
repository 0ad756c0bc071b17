"""The ``model:`` section of Qwen3.5-MoE (``model.type: qwen3_5_moe``): transformers' ``Qwen3_5MoeConfig`` field
names, from a local directory or hub id (``model.pretrained``) or these fields (unset: transformers' default)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mmpipe.config.fields import Section, option
from mmpipe.families.qwen_vl.experts import ExpertFields
from mmpipe.families.qwen_vl.qwen3_5_config import Qwen35TextConfig
from mmpipe.families.qwen_vl.qwen3_vision import Qwen3VisionConfig
from mmpipe.families.towers.common import attention_option


@dataclass
class Qwen35MoeTextConfig(ExpertFields, Qwen35TextConfig):
    """Qwen3.5's hybrid decoder with a sparse MoE block in every layer (``Qwen3_5MoeTextConfig``): routed experts
    and a shared expert behind a sigmoid gate (no dense MLP: ``intermediate_size`` stays unset)."""
    shared_expert_intermediate_size: Optional[int] = option(None, "the shared expert's MLP width (512)", ge=1)


@dataclass
class Qwen35MoeConfig(Section):
    type: str = option("qwen3_5_moe", "Qwen3.5-MoE at native resolution: Qwen3.5's hybrid decoder with routed and "
                       "shared experts (transformers' Qwen3_5MoeForConditionalGeneration arithmetic)")
    pretrained: Optional[str] = option(None, "hub id (org/name[@revision]) or local "
                                       "Qwen3_5MoeForConditionalGeneration save_pretrained directory (with its processor "
                                       "and tokenizer)")
    image_token_id: Optional[int] = option(None, "id of <|image_pad|>; unset = the tokenizer's")
    video_token_id: Optional[int] = option(None, "id of <|video_pad|>; unset = the tokenizer's")
    min_pixels: Optional[int] = option(None, "recorded by the run from data.min_pixels (leave unset)", ge=1)
    max_pixels: Optional[int] = option(None, "recorded by the run from data.max_pixels (leave unset)", ge=1)
    attention: str = attention_option()
    vision: Qwen3VisionConfig = field(default_factory=Qwen3VisionConfig, metadata={"help": "vision tower"})
    llm: Qwen35MoeTextConfig = field(default_factory=Qwen35MoeTextConfig, metadata={"help": "language model"})
