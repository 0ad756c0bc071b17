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
from mmpipe.errors import ConfigError
from mmpipe.families.qwen_vl import Qwen25VLFamily
from mmpipe.families.qwen_vl import products, qwen3_5_model as m
from mmpipe.families.qwen_vl.hf_config import HFConfigSpec, build_hf_config, check_mrope
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
    check=lambda top: _check_text(top.text_config),
    # layer_types unset: full_attention_interval's pattern
    text_extra=lambda t: {"full_attention_interval": t.full_attention_interval}
    if t.full_attention_interval and not t.layer_types else {})


def _check_text(t) -> None:
    """One line for a decoder transformers would build wrong or fail on."""
    check_mrope(t, [11, 11, 10], default_factor=0.25)
    if t.linear_num_value_heads % t.linear_num_key_heads:
        raise ConfigError(f"model.llm.linear_num_value_heads={t.linear_num_value_heads} is not a multiple of "
                          f"linear_num_key_heads={t.linear_num_key_heads}")
    bad = [x for x in t.layer_types if x not in ("linear_attention", "full_attention")]
    if bad or len(t.layer_types) != t.num_hidden_layers:
        raise ConfigError(f"model.llm.layer_types: give {t.num_hidden_layers} entries, each linear_attention or "
                          f"full_attention (got {len(t.layer_types)}{', e.g. ' + repr(bad[0]) if bad else ''})")


@register_family
class Qwen35Family(Qwen3Vision, Qwen25VLFamily):
    name = "qwen3_5"
    config_class = Qwen35Config
    hf_adapter = "Qwen35HF"

    @classmethod
    def hf_config(cls, model_cfg):
        return build_hf_config(model_cfg, QWEN3_5)

    def model_parts(self):
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm
        return m, Qwen3_5RMSNorm

    def layer_kind(self, name: str) -> str:
        """A decoder block's kind (``linear_attention`` | ``full_attention``, from ``layer_types``); other layers:
        their segment."""
        if name.startswith("llm.blocks."):
            return self.text_cfg.layer_types[int(name.rsplit(".", 1)[1])]
        return self.layer(name).segment

    def micro_batch(self, batch: dict):
        return products.recurrent_shape(batch, super().micro_batch(batch))

    def matmuls(self, name: str, mb) -> list:
        return products.qwen3_5_matmuls(self, name, mb)
