"""The VLM's plain weights <-> transformers' ``LlavaForConditionalGeneration`` (transformers 5
names; ``from_hf`` also reads the older ``language_model.model.`` / ``vision_tower.vision_model.``
layout through the family's loader rules)."""
from __future__ import annotations

# mmpipe prefix -> transformers prefix (in-memory names of LlavaForConditionalGeneration)
RULES = [("vision.blocks.", "model.vision_tower.encoder.layers."), ("vision.embed.", "model.vision_tower."),
         ("projector.", "model.multi_modal_projector."), ("llm.blocks.", "model.language_model.layers."),
         ("llm.embed.", "model.language_model."), ("llm.head.norm.", "model.language_model.norm."),
         ("llm.head.lm_head.", "lm_head.")]


def _translate(name: str, rules) -> str:
    for mine, theirs in rules:
        if name.startswith(mine):
            return theirs + name[len(mine):]
    raise KeyError(f"no transformers name for {name}")


class VlmHF:
    def __init__(self, family):
        self.family = family

    def hf_config(self):
        from transformers import LlavaConfig
        f = self.family
        return LlavaConfig(vision_config=f.vision_cfg.to_dict(), text_config=f.text_cfg.to_dict(),
                           image_token_id=f.image_token_id, vision_feature_layer=f.cfg.vision_feature_layer,
                           vision_feature_select_strategy=f.cfg.vision_feature_select_strategy,
                           projector_hidden_act="gelu", multimodal_projector_bias=True, tie_word_embeddings=f.tied)

    def to_hf(self, state: dict) -> dict:
        """Plain state dict -> transformers' (the vision blocks past the feature layer, which LLaVA
        never runs, and the unused post-layernorm are not in it: ``unused_hf_keys``)."""
        return {_translate(k, RULES): v for k, v in state.items()}

    def unused_hf_keys(self, hf_keys) -> list:
        k = self.family.vision_blocks
        return [n for n in hf_keys if n.startswith("model.vision_tower.post_layernorm.") or
                (n.startswith("model.vision_tower.encoder.layers.") and int(n.split(".")[4]) >= k)]

    def from_hf(self, hf_state: dict) -> dict:
        inverse = [(theirs, mine) for mine, theirs in RULES]
        out = {}
        for k, v in hf_state.items():
            if k in self.unused_hf_keys([k]):
                continue
            out[_translate(k, inverse)] = v
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
