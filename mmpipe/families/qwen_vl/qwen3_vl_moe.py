"""Qwen3-VL-MoE (``model.type: qwen3_vl_moe``; Qwen3-VL-30B-A3B, -235B-A22B): Qwen3's ViT with DeepStack
(``qwen3_vl_model``) into the Qwen3 decoder whose blocks are sparse MoE blocks (a softmax top-k router over the
routed experts, no shared expert; ``mlp_only_layers`` / ``decoder_sparse_step`` leave dense ones): the experts
part (``experts``: the router's load-balancing loss carried across any cut), DeepStack and Qwen3's ViT composed
beside Qwen2.5-VL's base; transformers' ``Qwen3VLMoeForConditionalGeneration`` is the arithmetic and the export."""
from __future__ import annotations

from types import SimpleNamespace

from mmpipe.config.registry import register_family
from mmpipe.errors import ConfigError
from mmpipe.families.qwen_vl import Qwen25VLFamily
from mmpipe.families.qwen_vl import experts as x
from mmpipe.families.qwen_vl import qwen3_vl_model as q
from mmpipe.families.qwen_vl.hf_config import HFConfigSpec, build_hf_config
from mmpipe.families.qwen_vl.qwen3_vision import Qwen3Vision, vision_classes
from mmpipe.families.qwen_vl.qwen3_vl_moe_config import Qwen3VLMoeConfig


def _check(top) -> None:
    q.check_deepstack(top, [24, 20, 20])
    x.check_experts(top.text_config)
    t = top.text_config
    bad = [i for i in (t.mlp_only_layers or []) if not 0 <= i < t.num_hidden_layers]
    if bad:
        raise ConfigError(f"model.llm.mlp_only_layers={t.mlp_only_layers}: {bad[0]} is not a decoder block (0 .. "
                          f"{t.num_hidden_layers - 1})")
    if not any(routed_block(t, i) for i in range(t.num_hidden_layers)):
        raise ConfigError(f"model.llm.mlp_only_layers={t.mlp_only_layers} / decoder_sparse_step={t.decoder_sparse_step} "
                          "leave no block with experts: use model.type=qwen3_vl for a dense decoder")


def routed_block(t, index: int) -> bool:
    """transformers' rule (``Qwen3VLMoeTextDecoderLayer``): sparse unless in ``mlp_only_layers``, every
    ``decoder_sparse_step``-th block."""
    return (index not in (t.mlp_only_layers or []) and t.num_experts > 0
            and (index + 1) % t.decoder_sparse_step == 0)


QWEN3_VL_MOE = HFConfigSpec(
    "qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeConfig",
    vision_fields=("depth", "hidden_size", "num_heads", "intermediate_size", "patch_size", "temporal_patch_size",
                   "spatial_merge_size", "num_position_embeddings", "deepstack_visual_indexes"),
    text_fields=("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "intermediate_size", "max_position_embeddings", "decoder_sparse_step", "mlp_only_layers")
    + x.EXPERT_FIELDS,
    rope={"rope_theta": 5_000_000.0, "mrope_interleaved": True}, check=_check, text_settings=x.EXPERT_SETTINGS)


def decoder_block_cls():
    from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as t
    return x.routed(q.qwen3_block_cls(t.Qwen3VLMoeTextDecoderLayer, t.Qwen3VLMoeTextRotaryEmbedding))


@register_family
class Qwen3VLMoeFamily(x.RoutedExperts, q.DeepStack, Qwen3Vision, Qwen25VLFamily):
    name = "qwen3_vl_moe"
    config_class = Qwen3VLMoeConfig
    hf_adapter = "Qwen3VLMoeHF"

    @classmethod
    def hf_config(cls, model_cfg):
        top = build_hf_config(model_cfg, QWEN3_VL_MOE)
        x.use_experts(top.text_config)
        return top

    def model_parts(self):
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextRMSNorm
        return SimpleNamespace(vision_classes=vision_classes, decoder_block_cls=decoder_block_cls), Qwen3VLMoeTextRMSNorm

    def routed_block(self, index: int) -> bool:
        return routed_block(self.text_cfg, index)
