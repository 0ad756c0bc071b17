"""Qwen3-VL (``model.type: qwen3_vl``, dense): Qwen3.5's native-resolution ViT (patch 16, the learned position
grid resampled to each image, 2-D rotary, the 2x2 merger) with **DeepStack** (the features after
``deepstack_visual_indexes``' blocks, each through its own merger, added at the image positions after decoder
layers 0, 1, ...) into the Qwen3 decoder (q/k norm) with interleaved multimodal rotary positions.
transformers' ``Qwen3VLForConditionalGeneration`` is the arithmetic and the export; the image input, the
positions, the collate and generation are the Qwen vision side's (``qwen_vl``), shared.

DeepStack's features travel with the hidden states across any pipeline cut (``qwen3_vl_model``): the planner
may cut anywhere, between the decoder layers DeepStack feeds too."""
from __future__ import annotations

from functools import partial

from mmpipe.config.registry import register_family
from mmpipe.errors import ConfigError
from mmpipe.families.base import Layer
from mmpipe.families.qwen_vl import Qwen25VLFamily, pretrained_config, set_token_ids
from mmpipe.families.qwen_vl import products, qwen3_vl_model as q
from mmpipe.families.qwen_vl.qwen3_5 import Qwen35Family
from mmpipe.families.qwen_vl.qwen3_vl_config import Qwen3VLConfig
from mmpipe.families.towers.common import init_transformer_part, use_attention

_VISION_FIELDS = ("depth", "hidden_size", "num_heads", "intermediate_size", "patch_size", "temporal_patch_size",
                  "spatial_merge_size", "num_position_embeddings", "deepstack_visual_indexes")
_TEXT_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "max_position_embeddings")


def qwen3_vl_config(cfg):
    """The ``Qwen3VLConfig`` of a ``model:`` section: ``model.pretrained``'s (fields set beside it must agree),
    else built from the fields (transformers' defaults for the rest)."""
    from transformers import Qwen3VLConfig as HFConfig
    if cfg.pretrained:
        top = pretrained_config(cfg, "qwen3_vl", "Qwen3VLForConditionalGeneration", _VISION_FIELDS, _TEXT_FIELDS)
    else:
        v, t = cfg.vision, cfg.llm
        vision = {f: getattr(v, f) for f in _VISION_FIELDS if getattr(v, f) is not None}
        text = {f: getattr(t, f) for f in _TEXT_FIELDS if getattr(t, f) is not None}
        text.update(vocab_size=t.vocab_size, bos_token_id=None, eos_token_id=None, pad_token_id=None)
        if t.hidden_size:
            vision["out_hidden_size"] = t.hidden_size
        rope = {"rope_type": "default", "rope_theta": float(t.rope_theta or 5_000_000.0), "mrope_interleaved": True}
        if t.mrope_section:
            rope["mrope_section"] = list(t.mrope_section)
        text["rope_parameters"] = rope
        top = HFConfig(vision_config=vision, text_config=text, image_token_id=cfg.image_token_id,
                       tie_word_embeddings=bool(t.tie_word_embeddings))
    _check(top)
    set_token_ids(top, cfg)
    use_attention(top.text_config, kind=cfg.attention)
    use_attention(top.vision_config, kind=cfg.attention, spans=True)
    return top


def _check(top) -> None:
    """One line for a model transformers would build wrong or fail on."""
    t, v = top.text_config, top.vision_config
    section = t.rope_parameters.get("mrope_section", [24, 20, 20])
    if sum(section) * 2 != t.head_dim:
        raise ConfigError(f"model.llm.mrope_section={section} sums to {sum(section)}, but the rotary half of a "
                          f"{t.head_dim}-wide head is {t.head_dim // 2}: give sections that sum to {t.head_dim // 2}")
    deep = list(v.deepstack_visual_indexes or [])
    if sorted(set(deep)) != deep or any(not 0 <= i < v.depth for i in deep):
        raise ConfigError(f"model.vision.deepstack_visual_indexes={deep}: give increasing ViT block indexes below "
                          f"model.vision.depth={v.depth}")
    if len(deep) > t.num_hidden_layers:
        raise ConfigError(f"model.vision.deepstack_visual_indexes has {len(deep)} entries but the decoder has "
                          f"{t.num_hidden_layers} layers to add them into: give at most {t.num_hidden_layers}")


@register_family
class Qwen3VLFamily(Qwen25VLFamily):
    name = "qwen3_vl"
    config_class = Qwen3VLConfig
    hf_adapter = "Qwen3VLHF"
    processor_classes = ("Qwen3VLProcessor", "Qwen3VLVideoProcessor")
    # DeepStack's mergers are ms-swift's "aligner" beside the merger (its qwen3_vl model_arch)
    default_groups = {"vision": [r"^vision\."], "merger": [r"^merger\.", r"^deepstack\."], "llm": [r"^llm\."]}
    processor_defaults = classmethod(Qwen35Family.processor_defaults.__func__)
    video_style = "qwen3"  # an item per temporal patch, after its timestamp text

    @classmethod
    def hf_config(cls, model_cfg):
        return qwen3_vl_config(model_cfg)

    def model_parts(self):
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRMSNorm
        return q, Qwen3VLTextRMSNorm

    def __init__(self, model_cfg, seed: int = 0):
        super().__init__(model_cfg, seed)
        deep = list(self.vision_cfg.deepstack_visual_indexes or [])
        visual = (self.image_token_id,) + ((self.video_token_id,) if self.video_token_id is not None else ())
        block = partial(q.llm_block_step, visual_ids=visual)
        layers = [Layer("vision.embed", "vision", q.m.vision_embed_step)]
        for i in range(self.vision_cfg.depth):
            layers.append(Layer(f"vision.blocks.{i}", "vision", q.vision_block_step))
            if i in deep:
                layers.append(Layer(f"deepstack.{deep.index(i)}", "vision", q.deepstack_step))
        self._layers = (layers + [Layer("merger", "merger", q.merger_step, takes=("vision",)),
                                  Layer("llm.embed", "llm", q.llm_embed_step, takes=("merger",))]
                        + [Layer(f"llm.blocks.{i}", "llm", block) for i in range(self.text_cfg.num_hidden_layers)]
                        + [Layer("llm.head", "llm", q.m.llm_head_step)])

    def matmuls(self, name: str, mb) -> list:
        return products.qwen3_vl_matmuls(self, name, mb)

    def build_unseeded(self, name: str):
        if not name.startswith("deepstack."):
            return super().build_unseeded(name)
        module = q.deepstack_merger_cls()(self.vision_cfg)
        init_transformer_part(module, std=getattr(self.text_cfg, "initializer_range", 0.02))
        return module
