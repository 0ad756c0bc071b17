"""The ``model:`` section of a LLaVA-style VLM (``model.type: vlm``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mmpipe.config.fields import Section, option
from mmpipe.families.towers.common import attention_option


@dataclass
class VlmVisionConfig(Section):
    """Vision tower: transformers' CLIP ViT or SigLIP ViT, from config fields or a local directory."""
    arch: str = option("clip_vit", "clip_vit (CLIP's ViT, LLaVA-1.5) or siglip_vit (SigLIP's, as LLaVA-OneVision and "
                                   "PaliGemma ship: no class token; use vision_feature_layer -1, strategy full); a "
                                   "pretrained directory's own type decides")
    pretrained: Optional[str] = option(None, "hub id (org/name[@revision]) or local CLIPVisionModel / CLIPModel / SiglipVisionModel / SiglipModel "
                                             "save_pretrained dir")
    hidden_size: Optional[int] = option(None, "transformer width; unset = transformers default", ge=1)
    num_hidden_layers: Optional[int] = option(None, "transformer blocks", ge=1)
    num_attention_heads: Optional[int] = option(None, "attention heads", ge=1)
    intermediate_size: Optional[int] = option(None, "MLP width", ge=1)
    image_size: Optional[int] = option(None, "input resolution in pixels (square)", ge=1)
    patch_size: Optional[int] = option(None, "ViT patch size", ge=1)


@dataclass
class LlmConfig(Section):
    """Language model: a transformers decoder, from config fields or a local directory."""
    arch: str = option("llama", "llama or qwen2 (transformers' decoder layers)")
    pretrained: Optional[str] = option(None, "hub id (org/name[@revision]) or local LlamaForCausalLM / Qwen2ForCausalLM save_pretrained dir")
    hidden_size: Optional[int] = option(None, "width", ge=1)
    num_hidden_layers: Optional[int] = option(None, "decoder blocks", ge=1)
    num_attention_heads: Optional[int] = option(None, "attention heads", ge=1)
    num_key_value_heads: Optional[int] = option(None, "key/value heads (grouped-query attention)", ge=1)
    intermediate_size: Optional[int] = option(None, "MLP width", ge=1)
    vocab_size: Optional[int] = option(None, "vocabulary size (required without pretrained weights)", ge=1)
    max_position_embeddings: Optional[int] = option(None, "longest sequence (rotary table)", ge=1)
    tie_word_embeddings: Optional[bool] = option(None, "share the input embedding and the LM head (Qwen2 small models)")


@dataclass
class VlmConfig(Section):
    type: str = option("vlm", "LLaVA-style VLM: vision tower -> projector -> causal LM (transformers' "
                       "LlavaForConditionalGeneration arithmetic)")
    pretrained: Optional[str] = option(None, "hub id (org/name[@revision]) or local LlavaForConditionalGeneration save_pretrained directory")
    vision_feature_layer: Optional[int] = option(None, "vision hidden state fed to the projector (-2: output of "
                                                 "the second-to-last block, no post-layernorm); unset = "
                                                 "model.pretrained's, else -2")
    vision_feature_select_strategy: Optional[str] = option(None, "default (drop CLS) or full; unset = "
                                                           "model.pretrained's, else default")
    image_token_id: Optional[int] = option(None, "id of the image placeholder token (required without "
                                           "model.pretrained, which names its own)")
    attention: str = attention_option()
    vision: VlmVisionConfig = field(default_factory=VlmVisionConfig, metadata={"help": "vision tower"})
    llm: LlmConfig = field(default_factory=LlmConfig, metadata={"help": "language model"})
