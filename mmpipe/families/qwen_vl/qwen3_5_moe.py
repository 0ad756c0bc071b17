"""Qwen3.5-MoE (``model.type: qwen3_5_moe``; Qwen3.5-35B-A3B and its larger siblings): Qwen3.5's ViT and hybrid
decoder (GatedDeltaNet and gated full attention, ``qwen3_5_model``) with a sparse MoE block in every layer: a
softmax top-k router over the routed experts plus a shared expert behind a sigmoid gate (``experts``: transformers'
blocks as they are, and the router's load-balancing loss carried across any pipeline cut). Composed, not stacked:
the experts part, the hybrid decoder and Qwen3's ViT beside Qwen2.5-VL's base; transformers'
``Qwen3_5MoeForConditionalGeneration`` is the arithmetic and the export."""
from __future__ import annotations

from types import SimpleNamespace

from mmpipe.config.registry import register_family
from mmpipe.errors import ConfigError
from mmpipe.families.qwen_vl import Qwen25VLFamily
from mmpipe.families.qwen_vl import experts as x
from mmpipe.families.qwen_vl import qwen3_5_model as m
from mmpipe.families.qwen_vl.hf_config import HFConfigSpec, build_hf_config
from mmpipe.families.qwen_vl.qwen3_5_moe_config import Qwen35MoeConfig
from mmpipe.families.qwen_vl.qwen3_vision import Qwen3Vision, vision_classes


def _check(top) -> None:
    m.check_hybrid_text(top.text_config)
    x.check_experts(top.text_config)


QWEN3_5_MOE = HFConfigSpec(
    "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeConfig",
    vision_fields=("depth", "hidden_size", "num_heads", "intermediate_size", "patch_size", "temporal_patch_size",
                   "spatial_merge_size", "num_position_embeddings"),
    text_fields=("hidden_size", "num_hidden_layers", "layer_types", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim", "max_position_embeddings",
                 "shared_expert_intermediate_size") + x.EXPERT_FIELDS,
    rope={"rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25, "mrope_interleaved": True}, check=_check,
    text_settings=x.EXPERT_SETTINGS,
    text_extra=lambda t: {"full_attention_interval": t.full_attention_interval}
    if t.full_attention_interval and not t.layer_types else {})


def decoder_block_cls():
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q
    return x.routed(m.hybrid_block_cls(q.Qwen3_5MoeDecoderLayer, q.Qwen3_5MoeGatedDeltaNet,
                                       q.Qwen3_5MoeTextRotaryEmbedding))


@register_family
class Qwen35MoeFamily(x.RoutedExperts, m.HybridDecoder, Qwen3Vision, Qwen25VLFamily):
    name = "qwen3_5_moe"
    config_class = Qwen35MoeConfig
    hf_adapter = "Qwen35MoeHF"

    @classmethod
    def validate(cls, model_cfg, where: str) -> None:
        super().validate(model_cfg, where)
        if model_cfg.llm.intermediate_size is not None:
            raise ConfigError(f"{where}: model.llm.intermediate_size: Qwen3.5-MoE has no dense MLP; give the experts' "
                              "width as model.llm.moe_intermediate_size (and shared_expert_intermediate_size)")

    @classmethod
    def hf_config(cls, model_cfg):
        top = build_hf_config(model_cfg, QWEN3_5_MOE)
        x.use_experts(top.text_config)
        return top

    def model_parts(self):
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm
        return SimpleNamespace(vision_classes=vision_classes, decoder_block_cls=decoder_block_cls), Qwen3_5MoeRMSNorm
