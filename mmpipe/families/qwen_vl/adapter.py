"""Qwen2.5-VL's transformers weight names, one home: plain weights <-> ``Qwen2_5_VLForConditionalGeneration``
(the names ``save_pretrained`` writes, as the hub's checkpoints hold them, and the in-memory ones),
the transformers config of a family, and the transformers model holding a plain state dict."""
from __future__ import annotations

from mmpipe.families.base import HFAdapter
from mmpipe.families.towers.common import transformers_facing
from mmpipe.families.towers.hf import translate

# mmpipe prefix -> transformers prefixes tried in order (the saved layout, then the in-memory one)
LOAD_RULES = [("vision.embed.", ["visual.patch_embed.", "model.visual.patch_embed."]),
              ("vision.blocks.", ["visual.blocks.", "model.visual.blocks."]),
              ("merger.", ["visual.merger.", "model.visual.merger."]),
              ("llm.embed.", ["model.", "model.language_model."]),
              ("llm.blocks.", ["model.layers.", "model.language_model.layers."]),
              ("llm.head.norm.", ["model.norm.", "model.language_model.norm."]),
              ("llm.head.lm_head.", ["lm_head."])]


class QwenVLHF(HFAdapter):
    """``hf_config()``, ``to_hf`` / ``from_hf`` (in-memory names), ``adapter_name`` (peft's), ``hf_model``;
    ``load_rules`` (mmpipe prefix -> the directory's names tried in order) and ``model_class`` (transformers')
    are a family's."""

    load_rules = LOAD_RULES
    model_class = "Qwen2_5_VLForConditionalGeneration"

    def __init__(self, family):
        self.family = family
        self.rules = [(mine, names[-1]) for mine, names in self.load_rules]  # -> the in-memory names

    def hf_config(self):
        return transformers_facing(self.family.hf_cfg)

    def to_hf(self, state: dict) -> dict:
        return {translate(k, self.rules, strict=True): v for k, v in state.items()}

    def from_hf(self, hf_state: dict) -> dict:
        inverse = sorted(((theirs, mine) for mine, theirs in self.rules), key=lambda r: -len(r[0]))
        return {translate(k, inverse, strict=True): v for k, v in hf_state.items()}

    def adapter_name(self, plain: str) -> str:
        """A plain LoRA parameter name -> its name inside the transformers model as peft wraps it."""
        stem, rest = plain.split(".lora_", 1)
        return translate(stem + ".weight", self.rules, strict=True)[:-len(".weight")] + ".lora_" + rest

    def unused_hf_keys(self, hf_keys) -> list:
        return []

    def hf_model(self, state: dict):
        """The family's transformers model (``model_class``) holding ``state`` (eval mode)."""
        import transformers
        model = getattr(transformers, self.model_class)(self.hf_config())
        theirs = self.to_hf(state)
        missing = [k for k in model.state_dict() if k not in theirs and not (self.family.tied and k == "lm_head.weight")]
        if missing:
            raise KeyError(f"weights missing for {missing[:3]}")
        model.load_state_dict(theirs, strict=False)
        if self.family.tied:
            model.tie_weights()
        return model.eval()


class Qwen35HF(QwenVLHF):
    """Qwen3.5's names: ``model.visual.*`` (the position grid beside the patch embedding), ``model.language_model.*``."""

    load_rules = [("vision.embed.", ["model.visual."]), ("vision.blocks.", ["model.visual.blocks."]),
                  ("merger.", ["model.visual.merger."]), ("llm.embed.", ["model.language_model."]),
                  ("llm.blocks.", ["model.language_model.layers."]),
                  ("llm.head.norm.", ["model.language_model.norm."]), ("llm.head.lm_head.", ["lm_head."])]
    model_class = "Qwen3_5ForConditionalGeneration"


class Qwen3VLHF(Qwen35HF):
    """Qwen3-VL's names: Qwen3.5's, and DeepStack's mergers (``deepstack.k`` <-> ``model.visual.deepstack_merger_list.k``)."""

    load_rules = [("deepstack.", ["model.visual.deepstack_merger_list."])] + Qwen35HF.load_rules
    model_class = "Qwen3VLForConditionalGeneration"


class Qwen35MoeHF(Qwen35HF):
    """Qwen3.5-MoE's names: Qwen3.5's (the experts, router and shared expert under each block's ``mlp``)."""

    model_class = "Qwen3_5MoeForConditionalGeneration"


class Qwen3VLMoeHF(Qwen3VLHF):
    """Qwen3-VL-MoE's names: Qwen3-VL's (the experts and router under each block's ``mlp``)."""

    model_class = "Qwen3VLMoeForConditionalGeneration"
