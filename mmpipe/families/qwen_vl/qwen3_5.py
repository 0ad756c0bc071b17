"""Qwen3.5 (``model.type: qwen3_5``; Qwen3.5 / 3.6 / 3.8 share it): a native-resolution ViT (patch 16, a
learned position grid resampled to each image, 2-D rotary, the 2x2 merger) into a hybrid decoder of
GatedDeltaNet linear-attention blocks and gated full-attention blocks (``layer_types``, 3:1 by default)
with interleaved multimodal rotary positions. transformers' ``Qwen3_5ForConditionalGeneration`` is the
arithmetic and the export; the Qwen vision side (the processor's image input, the positions, the collate,
generation) is Qwen2.5-VL's (``qwen_vl``), shared, not copied.

A packed row's samples never share a linear-attention layer's conv window or recurrent state
(``qwen3_5_model``): ARCHITECTURE.md states the rule every recurrent family follows."""
from __future__ import annotations

from mmpipe.config.registry import register_family
from mmpipe.errors import ConfigError
from mmpipe.families.qwen_vl import Qwen25VLFamily, pretrained_config, set_token_ids
from mmpipe.families.qwen_vl import products, qwen3_5_model as m
from mmpipe.families.qwen_vl.qwen3_5_config import Qwen35Config
from mmpipe.families.towers.common import use_attention

_VISION_FIELDS = ("depth", "hidden_size", "num_heads", "intermediate_size", "patch_size", "temporal_patch_size",
                  "spatial_merge_size", "num_position_embeddings")
_TEXT_FIELDS = ("hidden_size", "num_hidden_layers", "layer_types", "num_attention_heads", "num_key_value_heads",
                "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel_dim", "intermediate_size", "max_position_embeddings")


def qwen3_5_config(cfg):
    """The ``Qwen3_5Config`` of a ``model:`` section: ``model.pretrained``'s (fields set beside it must agree),
    else built from the fields (transformers' defaults for the rest)."""
    from transformers import Qwen3_5Config
    if cfg.pretrained:
        top = pretrained_config(cfg, "qwen3_5", "Qwen3_5ForConditionalGeneration", _VISION_FIELDS, _TEXT_FIELDS)
    else:
        v, t = cfg.vision, cfg.llm
        vision = {f: getattr(v, f) for f in _VISION_FIELDS if getattr(v, f) is not None}
        text = {f: getattr(t, f) for f in _TEXT_FIELDS if getattr(t, f) is not None}
        text.update(vocab_size=t.vocab_size, bos_token_id=None, eos_token_id=None, pad_token_id=None)
        if t.full_attention_interval and not t.layer_types:
            text["full_attention_interval"] = t.full_attention_interval
        if t.hidden_size:
            vision["out_hidden_size"] = t.hidden_size
        rope = {"rope_type": "default", "rope_theta": float(t.rope_theta or 10_000_000.0),
                "partial_rotary_factor": float(t.partial_rotary_factor or 0.25), "mrope_interleaved": True}
        if t.mrope_section:
            rope["mrope_section"] = list(t.mrope_section)
        text["rope_parameters"] = rope
        top = Qwen3_5Config(vision_config=vision, text_config=text, image_token_id=cfg.image_token_id,
                            tie_word_embeddings=bool(t.tie_word_embeddings))
    _check_text(top.text_config)
    set_token_ids(top, cfg)
    use_attention(top.text_config, kind=cfg.attention)
    use_attention(top.vision_config, kind=cfg.attention, spans=True)
    return top


def _check_text(t) -> None:
    """One line for a decoder transformers would build wrong or fail on."""
    rope = t.rope_parameters
    rotary = int(t.head_dim * rope.get("partial_rotary_factor", 0.25))
    section = rope.get("mrope_section", [11, 11, 10])
    if sum(section) * 2 != rotary:
        raise ConfigError(f"model.llm.mrope_section={section} sums to {sum(section)}, but the rotary half of a "
                          f"{t.head_dim}-wide head at partial_rotary_factor {rope.get('partial_rotary_factor', 0.25)} "
                          f"is {rotary // 2}: give sections that sum to {rotary // 2}")
    if t.linear_num_value_heads % t.linear_num_key_heads:
        raise ConfigError(f"model.llm.linear_num_value_heads={t.linear_num_value_heads} is not a multiple of "
                          f"linear_num_key_heads={t.linear_num_key_heads}")
    bad = [x for x in t.layer_types if x not in ("linear_attention", "full_attention")]
    if bad or len(t.layer_types) != t.num_hidden_layers:
        raise ConfigError(f"model.llm.layer_types: give {t.num_hidden_layers} entries, each linear_attention or "
                          f"full_attention (got {len(t.layer_types)}{', e.g. ' + repr(bad[0]) if bad else ''})")


@register_family
class Qwen35Family(Qwen25VLFamily):
    name = "qwen3_5"
    config_class = Qwen35Config
    hf_adapter = "Qwen35HF"
    processor_classes = ("Qwen3VLProcessor", "Qwen3VLVideoProcessor")
    video_style = "qwen3"  # an item per temporal patch, after its timestamp text

    @classmethod
    def processor_defaults(cls, model_cfg) -> dict:
        """Without a directory: the processor Qwen3.5 checkpoints save (patch 16, mean and std 0.5), at the
        model's patch and merge sizes."""
        v = model_cfg.vision
        return {"patch_size": v.patch_size or 16, "temporal_patch_size": v.temporal_patch_size or 2,
                "merge_size": v.spatial_merge_size or 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}

    @classmethod
    def hf_config(cls, model_cfg):
        return qwen3_5_config(model_cfg)

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
