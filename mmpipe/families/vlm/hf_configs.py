"""The VLM's transformers configs from its ``model:`` section: a LLaVA directory's
(``model.pretrained``), a CLIP vision tower's and a Llama / Qwen2 decoder's, or built from the
configured sizes; the vision feature choice and the shape checks, each mistake in one line."""
from __future__ import annotations

from mmpipe.config.fields import thawed_copy
from mmpipe.errors import ConfigError
from mmpipe.families.towers import hf


_VISION_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "image_size",
                  "patch_size")
_LLM_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
               "vocab_size", "max_position_embeddings", "tie_word_embeddings")
VISION_TYPES = ("clip_vision_model", "siglip_vision_model")  # transformers' model_type of the towers it takes
# unset, by the tower: LLaVA-1.5's CLIP ViT (the second-to-last block, its class token dropped); a SigLIP tower
# has no class token, so its last block in full (LLaVA-OneVision's)
FEATURE_DEFAULTS = {"clip_vision_model": {"vision_feature_layer": -2, "vision_feature_select_strategy": "default"},
                    "siglip_vision_model": {"vision_feature_layer": -1, "vision_feature_select_strategy": "full"}}


def feature_choice(model_cfg):
    """A copy with ``vision_feature_layer`` / ``vision_feature_select_strategy`` decided: unset, a
    LLaVA directory's own (``model.pretrained``), else the tower's (``FEATURE_DEFAULTS``); set, it must
    agree with the directory's (one line if not). ``default`` (drop the class token) with a SigLIP tower,
    which has none, would drop a real patch of every image: one line."""
    out = thawed_copy(model_cfg)
    top = llava_config(out) if out.pretrained else None
    tower = vision_config(out).model_type
    if tower == "siglip_vision_model" and out.vision_feature_select_strategy == "default":
        raise ConfigError("model.vision_feature_select_strategy=default drops the class token, and a SigLIP vision "
                          "tower has none (it would drop the first patch of every image): use full, or leave it unset")
    for key, default in FEATURE_DEFAULTS[tower].items():
        theirs, mine = getattr(top, key, None), getattr(out, key)
        if isinstance(theirs, (list, tuple)):
            raise ConfigError(f"model.pretrained: {out.pretrained} reads several vision layers ({key}={theirs}); mmpipe's "
                              "VLM reads one")
        if mine is not None and theirs is not None and mine != theirs:
            raise ConfigError(f"model.{key}={mine!r} but model.pretrained ({out.pretrained}) was trained with {theirs!r}: "
                              f"unset model.{key} to use the directory's")
        setattr(out, key, mine if mine is not None else theirs if theirs is not None else default)
    return out


def llava_config(cfg):
    top = hf.load_hf_config(cfg.pretrained, "model.pretrained")
    if not hasattr(top, "text_config") or not hasattr(top, "vision_config"):
        raise ConfigError(f"model.pretrained: {cfg.pretrained} is not a LlavaForConditionalGeneration directory")
    return top


def vision_config(cfg):
    if cfg.pretrained:
        return llava_config(cfg).vision_config
    if cfg.vision.pretrained:
        c = hf.load_hf_config(cfg.vision.pretrained, "model.vision.pretrained")
        c = getattr(c, "vision_config", c)
        if c.model_type not in VISION_TYPES:
            raise ConfigError(f"model.vision.pretrained: {cfg.vision.pretrained} holds a {c.model_type}, not a CLIP "
                              "or SigLIP vision model (CLIPVisionModel, CLIPModel, SiglipVisionModel, SiglipModel)")
        return c
    from transformers import CLIPVisionConfig, SiglipVisionConfig
    if cfg.vision.arch not in ("clip_vit", "siglip_vit"):
        raise ConfigError(f"model.vision.arch={cfg.vision.arch!r} is not one of clip_vit, siglip_vit")
    cls = SiglipVisionConfig if cfg.vision.arch == "siglip_vit" else CLIPVisionConfig
    return cls(**{f: getattr(cfg.vision, f) for f in _VISION_FIELDS if getattr(cfg.vision, f) is not None})


def hf_configs(cfg):
    """(vision config, text config, image token id) from ``model.pretrained`` or the config fields."""
    if cfg.pretrained:
        top = llava_config(cfg)
        text = top.text_config
        if cfg.llm.vocab_size and cfg.llm.vocab_size > text.vocab_size:  # tokens the tokenizer added
            text.vocab_size = cfg.llm.vocab_size
        return top.vision_config, text, top.image_token_id
    from transformers import LlamaConfig, Qwen2Config
    vision = vision_config(cfg)
    if cfg.llm.pretrained:
        text = hf.load_hf_config(cfg.llm.pretrained, "model.llm.pretrained")
        text = getattr(text, "text_config", text)
        if text.model_type not in ("llama", "qwen2"):
            raise ConfigError(f"model.llm.pretrained: {cfg.llm.pretrained} holds a {text.model_type} model; "
                              "model.type=vlm takes llama or qwen2 decoders")
        if cfg.llm.vocab_size and cfg.llm.vocab_size > text.vocab_size:
            text.vocab_size = cfg.llm.vocab_size
        if cfg.image_token_id is None:
            raise ConfigError("model.image_token_id is unset: set it (or data.tokenizer with an <image> token)")
        return vision, text, cfg.image_token_id
    if cfg.llm.vocab_size is None:
        raise ConfigError("model.llm.vocab_size is unset and no tokenizer fixed it: set data.tokenizer, "
                          "model.llm.vocab_size or model.pretrained")
    text_cls = LlamaConfig if cfg.llm.arch == "llama" else Qwen2Config
    text = text_cls(**{f: getattr(cfg.llm, f) for f in _LLM_FIELDS if getattr(cfg.llm, f) is not None})
    if cfg.image_token_id is None:
        raise ConfigError("model.image_token_id is unset: set it (or data.tokenizer with an <image> token)")
    return vision, text, cfg.image_token_id


def check_shapes(cfg) -> None:
    """The shape mistakes transformers' configs and layers would stop at (a traceback, or one at the
    first step), in one line each; unset sizes are transformers' defaults, a pretrained directory's
    own sizes are its own."""
    if cfg.pretrained:
        return
    from transformers import CLIPVisionConfig, LlamaConfig, Qwen2Config
    dv = CLIPVisionConfig()
    v = {f: getattr(cfg.vision, f) or getattr(dv, f) for f in ("hidden_size", "num_attention_heads", "image_size",
                                                                 "patch_size")}
    if not cfg.vision.pretrained:
        if v["hidden_size"] % v["num_attention_heads"]:
            raise ConfigError(f"model.vision.hidden_size={v['hidden_size']} is not divisible by "
                              f"model.vision.num_attention_heads={v['num_attention_heads']}")
        if v["patch_size"] > v["image_size"]:
            raise ConfigError(f"model.vision.patch_size={v['patch_size']} is larger than model.vision.image_size="
                              f"{v['image_size']}: no patch fits the image")
    if cfg.llm.pretrained:
        return
    dt = (Qwen2Config if cfg.llm.arch == "qwen2" else LlamaConfig)()
    hidden, heads = cfg.llm.hidden_size or dt.hidden_size, cfg.llm.num_attention_heads or dt.num_attention_heads
    kv = cfg.llm.num_key_value_heads or heads
    if heads % kv:
        raise ConfigError(f"model.llm.num_key_value_heads={kv} does not divide model.llm.num_attention_heads={heads}")
    if hidden % heads:
        raise ConfigError(f"model.llm.hidden_size={hidden} is not divisible by model.llm.num_attention_heads={heads}")
    if (hidden // heads) % 2:
        raise ConfigError(f"model.llm: head size {hidden // heads} (hidden_size / num_attention_heads) is odd; the "
                          "rotary embedding rotates pairs of dimensions: make it even")
