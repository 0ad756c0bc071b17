"""Qwen3.5 (``model.type: qwen3_5``; Qwen3.5 / 3.6 / 3.8 share it): a native-resolution ViT (patch 16, a
learned position grid resampled to each image, 2-D rotary, the 2x2 merger) into a hybrid decoder of
GatedDeltaNet linear-attention blocks and gated full-attention blocks (``layer_types``, 3:1 by default)
with interleaved multimodal rotary positions. transformers' ``Qwen3_5ForConditionalGeneration`` is the
arithmetic and the export; the ViT and its processor are Qwen3's (``qwen3_vision``, shared with Qwen3-VL), the
image input, the positions, the collate and generation the Qwen vision side's (``qwen_vl``), shared, not copied.

A packed row's samples never share a linear-attention layer's conv window or recurrent state
(``qwen3_5_model``): ARCHITECTURE.md states the rule every recurrent family follows."""
from __future__ import annotations

from mmpipe.config.registry import register_family
from mmpipe.families.qwen_vl import Qwen25VLFamily
from mmpipe.families.qwen_vl import qwen3_5_model as m
from mmpipe.families.qwen_vl.hf_config import HFConfigSpec, build_hf_config
from mmpipe.families.qwen_vl.qwen3_5_config import Qwen35Config
from mmpipe.families.qwen_vl.qwen3_vision import Qwen3Vision

QWEN3_5 = HFConfigSpec(
    "qwen3_5", "Qwen3_5ForConditionalGeneration", "Qwen3_5Config",
    vision_fields=("depth", "hidden_size", "num_heads", "intermediate_size", "patch_size", "temporal_patch_size",
                   "spatial_merge_size", "num_position_embeddings"),
    text_fields=("hidden_size", "num_hidden_layers", "layer_types", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim", "intermediate_size", "max_position_embeddings"),
    rope={"rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25, "mrope_interleaved": True},
    check=lambda top: m.check_hybrid_text(top.text_config),
    # layer_types unset: full_attention_interval's pattern
    text_extra=lambda t: {"full_attention_interval": t.full_attention_interval}
    if t.full_attention_interval and not t.layer_types else {})


@register_family
class Qwen35Family(m.HybridDecoder, Qwen3Vision, Qwen25VLFamily):
    name = "qwen3_5"
    config_class = Qwen35Config
    hf_adapter = "Qwen35HF"

    @classmethod
    def hf_config(cls, model_cfg):
        return build_hf_config(model_cfg, QWEN3_5)

    def model_parts(self):
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm
        return m, Qwen3_5RMSNorm
