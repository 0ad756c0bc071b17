"""Qwen3-VL (``model.type: qwen3_vl``, dense): Qwen3's native-resolution ViT (``qwen3_vision``, as Qwen3.5's:
patch 16, the learned position grid resampled to each image, 2-D rotary, the 2x2 merger) with **DeepStack**
(the features after ``deepstack_visual_indexes``' blocks, each through its own merger, added at the image
positions after decoder layers 0, 1, ...) into the Qwen3 decoder (q/k norm) with interleaved multimodal rotary positions.
transformers' ``Qwen3VLForConditionalGeneration`` is the arithmetic and the export; the image input, the
positions, the collate and generation are the Qwen vision side's (``qwen_vl``), shared.

DeepStack's features travel with the hidden states across any pipeline cut (``qwen3_vl_model``): the planner
may cut anywhere, between the decoder layers DeepStack feeds too."""
from __future__ import annotations

from mmpipe.config.registry import register_family
from mmpipe.families.qwen_vl import Qwen25VLFamily
from mmpipe.families.qwen_vl import qwen3_vl_model as q
from mmpipe.families.qwen_vl.hf_config import HFConfigSpec, build_hf_config
from mmpipe.families.qwen_vl.qwen3_vision import Qwen3Vision
from mmpipe.families.qwen_vl.qwen3_vl_config import Qwen3VLConfig

QWEN3_VL = HFConfigSpec(
    "qwen3_vl", "Qwen3VLForConditionalGeneration", "Qwen3VLConfig",
    vision_fields=("depth", "hidden_size", "num_heads", "intermediate_size", "patch_size", "temporal_patch_size",
                   "spatial_merge_size", "num_position_embeddings", "deepstack_visual_indexes"),
    text_fields=("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "intermediate_size", "max_position_embeddings"),
    rope={"rope_theta": 5_000_000.0, "mrope_interleaved": True}, check=lambda top: q.check_deepstack(top, [24, 20, 20]))


@register_family
class Qwen3VLFamily(q.DeepStack, Qwen3Vision, Qwen25VLFamily):
    name = "qwen3_vl"
    config_class = Qwen3VLConfig
    hf_adapter = "Qwen3VLHF"

    @classmethod
    def hf_config(cls, model_cfg):
        return build_hf_config(model_cfg, QWEN3_VL)

    def model_parts(self):
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRMSNorm
        return q, Qwen3VLTextRMSNorm
