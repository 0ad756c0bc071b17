"""Qwen3-VL (``model.type: qwen3_vl``, dense): Qwen3's native-resolution ViT (``qwen3_vision``, as Qwen3.5's:
patch 16, the learned position grid resampled to each image, 2-D rotary, the 2x2 merger) with **DeepStack**
(the features after ``deepstack_visual_indexes``' blocks, each through its own merger, added at the image
positions after decoder layers 0, 1, ...) into the Qwen3 decoder (q/k norm) with interleaved multimodal rotary positions.
transformers' ``Qwen3VLForConditionalGeneration`` is the arithmetic and the export; the image input, the
positions, the collate and generation are the Qwen vision side's (``qwen_vl``), shared.

DeepStack's features travel with the hidden states across any pipeline cut (``qwen3_vl_model``): the planner
may cut anywhere, between the decoder layers DeepStack feeds too."""
from __future__ import annotations

from functools import partial

from mmpipe.config.registry import register_family
from mmpipe.errors import ConfigError
from mmpipe.families.base import Layer
from mmpipe.families.qwen_vl import Qwen25VLFamily
from mmpipe.families.qwen_vl import products, qwen3_vl_model as q
from mmpipe.families.qwen_vl.hf_config import HFConfigSpec, build_hf_config, check_mrope
from mmpipe.families.qwen_vl.qwen3_vision import Qwen3Vision
from mmpipe.families.qwen_vl.qwen3_vl_config import Qwen3VLConfig
from mmpipe.families.towers.common import init_transformer_part

QWEN3_VL = HFConfigSpec(
    "qwen3_vl", "Qwen3VLForConditionalGeneration", "Qwen3VLConfig",
    vision_fields=("depth", "hidden_size", "num_heads", "intermediate_size", "patch_size", "temporal_patch_size",
                   "spatial_merge_size", "num_position_embeddings", "deepstack_visual_indexes"),
    text_fields=("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "intermediate_size", "max_position_embeddings"),
    rope={"rope_theta": 5_000_000.0, "mrope_interleaved": True}, check=lambda top: _check(top))


def _check(top) -> None:
    """One line for a model transformers would build wrong or fail on."""
    t, v = top.text_config, top.vision_config
    check_mrope(t, [24, 20, 20])
    deep = list(v.deepstack_visual_indexes or [])
    if sorted(set(deep)) != deep or any(not 0 <= i < v.depth for i in deep):
        raise ConfigError(f"model.vision.deepstack_visual_indexes={deep}: give increasing ViT block indexes below "
                          f"model.vision.depth={v.depth}")
    if len(deep) > t.num_hidden_layers:
        raise ConfigError(f"model.vision.deepstack_visual_indexes has {len(deep)} entries but the decoder has "
                          f"{t.num_hidden_layers} layers to add them into: give at most {t.num_hidden_layers}")


@register_family
class Qwen3VLFamily(Qwen3Vision, Qwen25VLFamily):
    name = "qwen3_vl"
    config_class = Qwen3VLConfig
    hf_adapter = "Qwen3VLHF"
    # DeepStack's mergers are ms-swift's "aligner" beside the merger (its qwen3_vl model_arch)
    default_groups = {"vision": [r"^vision\."], "merger": [r"^merger\.", r"^deepstack\."], "llm": [r"^llm\."]}

    @classmethod
    def hf_config(cls, model_cfg):
        return build_hf_config(model_cfg, QWEN3_VL)

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
