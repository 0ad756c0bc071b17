"""The one transformers-config builder of the Qwen families: ``model.pretrained``'s config, checked against
the ``model:`` fields set beside it, or one built from those fields (transformers' defaults for the rest),
then the family's checks, the tokenizer's token ids and the attention kernel. A family states what differs
as an ``HFConfigSpec``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from mmpipe.errors import ConfigError
from mmpipe.families.towers import hf
from mmpipe.families.towers.common import use_attention


@dataclass(frozen=True)
class HFConfigSpec:
    model_type: str  # config.json's model_type
    model_class: str  # transformers' model class (messages)
    config_class: str  # transformers' top-level config class
    vision_fields: tuple  # model.vision fields that are the vision config's
    text_fields: tuple  # model.llm fields that are the text config's
    rope: dict  # rope_parameters: a float default per model.llm field of that name, or a fixed value
    check: Callable  # (top config) -> None: one line for what transformers would build wrong or fail on
    text_extra: Callable = lambda llm: {}  # more text-config entries from model.llm
    top_extra: dict = field(default_factory=dict)  # more top-level config entries
    # model.llm fields that are training settings, not the architecture: set over model.pretrained's value, not
    # checked against it (a MoE's router_aux_loss_coef)
    text_settings: tuple = ()


def pretrained_config(cfg, spec: HFConfigSpec):
    """``model.pretrained``'s transformers config, checked: a ``model_type`` directory, the ``model:`` fields set
    beside it agree, the vocabulary grown to the tokens the tokenizer added."""
    top = hf.load_hf_config(cfg.pretrained, "model.pretrained")
    if getattr(top, "model_type", None) != spec.model_type:
        raise ConfigError(f"model.pretrained: {cfg.pretrained} holds a {getattr(top, 'model_type', '?')}, not a "
                          f"{spec.model_class} directory")
    hf.check_fields_agree(cfg.vision, [f for f in spec.vision_fields if getattr(cfg.vision, f) is not None],
                          top.vision_config, "model.vision", "model.pretrained")
    hf.check_fields_agree(cfg.llm, [f for f in spec.text_fields if getattr(cfg.llm, f) is not None],
                          top.text_config, "model.llm", "model.pretrained")
    if cfg.llm.vocab_size and cfg.llm.vocab_size > top.text_config.vocab_size:
        top.text_config.vocab_size = cfg.llm.vocab_size
    for f in spec.text_settings:
        if getattr(cfg.llm, f) is not None:
            setattr(top.text_config, f, getattr(cfg.llm, f))
    return top


def build_hf_config(cfg, spec: HFConfigSpec):
    """The transformers config of a ``model:`` section (see the module)."""
    if cfg.pretrained:
        top = pretrained_config(cfg, spec)
    else:
        import transformers
        v, t = cfg.vision, cfg.llm
        vision = {f: getattr(v, f) for f in spec.vision_fields if getattr(v, f) is not None}
        text = {f: getattr(t, f) for f in spec.text_fields + spec.text_settings if getattr(t, f) is not None}
        text.update(vocab_size=t.vocab_size, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                    **spec.text_extra(t))
        if t.hidden_size:
            vision["out_hidden_size"] = t.hidden_size
        rope = {"rope_type": "default"}
        for key, default in spec.rope.items():
            rope[key] = float(getattr(t, key) or default) if isinstance(default, float) else default
        if t.mrope_section:
            rope["mrope_section"] = list(t.mrope_section)
        text["rope_parameters"] = rope
        top = getattr(transformers, spec.config_class)(
            vision_config=vision, text_config=text, image_token_id=cfg.image_token_id,
            tie_word_embeddings=bool(t.tie_word_embeddings), **spec.top_extra)
    spec.check(top)
    set_token_ids(top, cfg)
    use_attention(top.text_config, kind=cfg.attention)
    use_attention(top.vision_config, kind=cfg.attention, spans=True)
    return top


def check_mrope(t, default_section: list, default_factor: float = 1.0) -> None:
    """The multimodal rotary sections sum to the rotary half of a head (``head_dim`` x
    ``partial_rotary_factor`` / 2): one line otherwise."""
    head = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    factor = t.rope_parameters.get("partial_rotary_factor", default_factor)
    half = int(head * factor) // 2
    section = t.rope_parameters.get("mrope_section", default_section)
    if sum(section) != half:
        at = f" at partial_rotary_factor {factor}" if factor != 1.0 else ""
        raise ConfigError(f"model.llm.mrope_section={section} sums to {sum(section)}, but the rotary half of a "
                          f"{head}-wide head{at} is {half}: give sections that sum to {half}")


def set_token_ids(top, cfg) -> None:
    """The resolved ``model.image_token_id`` / ``model.video_token_id`` (the tokenizer's) into transformers' config."""
    for key in ("image_token_id", "video_token_id"):
        if getattr(cfg, key, None) is not None:
            setattr(top, key, getattr(cfg, key))
