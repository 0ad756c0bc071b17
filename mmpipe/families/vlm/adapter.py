"""The VLM's Hugging Face weight tables, one home: plain weights <-> transformers'
``LlavaForConditionalGeneration`` (transformers 5 names), the names a pretrained directory is read
by (today's ``save_pretrained`` layout, llava-hf's older one, the in-memory names), and those of a
vision-only (CLIP) or LM-only (Llama, Qwen2) directory."""
from __future__ import annotations

from mmpipe.families.base import HFAdapter
from mmpipe.families.towers.hf import translate

# mmpipe name prefix -> transformers names tried in order (the layout save_pretrained writes today,
# then llava-hf's older one, then the in-memory names)
LOAD_RULES = [("vision.embed.", ["vision_tower.", "vision_tower.vision_model.", "model.vision_tower."]),
              ("vision.blocks.", ["vision_tower.encoder.layers.", "vision_tower.vision_model.encoder.layers.",
                                  "model.vision_tower.encoder.layers."]),
              ("projector.", ["multi_modal_projector.", "model.multi_modal_projector."]),
              ("llm.embed.", ["language_model.model.", "model.language_model."]),
              ("llm.blocks.", ["language_model.model.layers.", "model.language_model.layers."]),
              ("llm.head.norm.", ["language_model.model.norm.", "model.language_model.norm."]),
              ("llm.head.lm_head.", ["language_model.lm_head.", "lm_head."])]
# the same for a vision-only directory (CLIPVisionModel or CLIPModel) and an LM-only one
# (LlamaForCausalLM / Qwen2ForCausalLM)
VISION_RULES = [("vision.embed.", ["vision_model.", ""]),
                ("vision.blocks.", ["vision_model.encoder.layers.", "encoder.layers."])]
LLM_RULES = [("llm.embed.", ["model."]), ("llm.blocks.", ["model.layers."]), ("llm.head.norm.", ["model.norm."]),
             ("llm.head.lm_head.", ["lm_head."])]


# mmpipe prefix -> the in-memory name of LlavaForConditionalGeneration (the last name tried above)
RULES = [(mine, names[-1]) for mine, names in LOAD_RULES]


class VlmHF(HFAdapter):
    def hf_config(self):
        from transformers import LlavaConfig
        f = self.family
        return LlavaConfig(vision_config=f.vision_cfg.to_dict(), text_config=f.text_cfg.to_dict(),
                           image_token_id=f.image_token_id, vision_feature_layer=f.cfg.vision_feature_layer,
                           vision_feature_select_strategy=f.cfg.vision_feature_select_strategy,
                           projector_hidden_act="gelu", multimodal_projector_bias=True, tie_word_embeddings=f.tied)

    def to_hf(self, state: dict) -> dict:
        """Plain state dict -> transformers' (the vision blocks past the feature layer, which LLaVA
        never runs, and the unused post-layernorm and SigLIP pooling head are not in it: ``unused_hf_keys``)."""
        return {translate(k, RULES, strict=True): v for k, v in state.items()}

    def adapter_name(self, plain: str) -> str:
        """A plain LoRA parameter name -> its name inside ``LlavaForConditionalGeneration`` as peft
        wraps it (``...q_proj.lora_A.default.weight``)."""
        stem, rest = plain.split(".lora_", 1)
        return translate(stem + ".weight", RULES, strict=True)[:-len(".weight")] + ".lora_" + rest

    def unused_hf_keys(self, hf_keys) -> list:
        k = self.family.vision_blocks
        return [n for n in hf_keys if n.startswith(("model.vision_tower.post_layernorm.", "model.vision_tower.head.")) or
                (n.startswith("model.vision_tower.encoder.layers.") and int(n.split(".")[4]) >= k)]

    def from_hf(self, hf_state: dict) -> dict:
        inverse = sorted(((theirs, mine) for mine, theirs in RULES), key=lambda r: -len(r[0]))  # longest first
        out = {}
        for k, v in hf_state.items():
            if k in self.unused_hf_keys([k]):
                continue
            out[translate(k, inverse, strict=True)] = v
        return out

    def hf_model(self, state: dict):
        """A ``LlavaForConditionalGeneration`` holding ``state`` (eval mode)."""
        from transformers import LlavaForConditionalGeneration
        model = LlavaForConditionalGeneration(self.hf_config())  # (buffers such as rotary tables built for real)
        theirs = self.to_hf(state)
        unused = set(self.unused_hf_keys(model.state_dict()))
        missing = [k for k in model.state_dict() if k not in theirs and k not in unused
                   and not (self.family.tied and k == "lm_head.weight")]
        if missing:
            raise KeyError(f"weights missing for {missing[:3]}")
        for k in unused:  # never run by LLaVA; zeros rather than uninitialised memory
            model.get_parameter(k).data.zero_()
        model.load_state_dict(theirs, strict=False)
        if self.family.tied:
            model.tie_weights()
        return model.eval()
