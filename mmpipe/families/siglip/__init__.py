"""The SigLIP dual encoder (``model.type: siglip``): transformers' ``SiglipModel`` towers (a ViT with
an attention-pooling head, a bidirectional text transformer pooled at its last position) and SigLIP's
sigmoid loss with a trained temperature and bias, over the whole global batch in every layout (the
clip family's step loss, computed in blocks); zero-shot retrieval as its evaluation; ``SiglipModel``
+ ``SiglipProcessor`` as its HF format, in and out."""
from __future__ import annotations

import math

import torch
from torch import nn

from mmpipe.config.fields import thawed_copy
from mmpipe.config.registry import register_family
from mmpipe.data.loader import Collate
from mmpipe.errors import ConfigError, NoHFFormat, one_line
from mmpipe.families.base import HFAdapter, Layer
from mmpipe.families.clip import ClipFamily
from mmpipe.families.clip import model as m
from mmpipe.families.image_text import ImageTextFamily
from mmpipe.families.products import Matmul
from mmpipe.families.siglip.config import SiglipConfig
from mmpipe.families.towers import hf
from mmpipe.families.towers import siglip as parts
from mmpipe.families.towers.common import use_attention

_FIELDS = {"vision": ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "image_size",
                      "patch_size"),
           "text": ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                    "max_position_embeddings")}


def _tower_configs(model_cfg):
    """(vision config, text config) of transformers' Siglip classes: from ``model.pretrained`` (fields
    set beside it must agree) or from the config's fields; the text head projects to the image width."""
    from transformers import SiglipTextConfig, SiglipVisionConfig
    out = {}
    top = hf.load_hf_config(model_cfg.pretrained, "model.pretrained") if model_cfg.pretrained else None
    if top is not None and not hasattr(top, "vision_config"):
        raise ConfigError(f"model.pretrained: {model_cfg.pretrained} is not a SiglipModel directory (its config has "
                          "no vision_config)")
    for tower, cls in (("vision", SiglipVisionConfig), ("text", SiglipTextConfig)):
        section = getattr(model_cfg, tower)
        set_fields = {f: getattr(section, f) for f in _FIELDS[tower] if getattr(section, f) is not None}
        if top is not None:
            c = getattr(top, f"{tower}_config")
            hf.check_fields_agree(section, list(set_fields), c, f"model.{tower}", "model.pretrained")
        else:
            extra = {}
            if tower == "text":
                extra = {"projection_size": out["vision"].hidden_size, "bos_token_id": None, "eos_token_id": None,
                         "pad_token_id": None}
            try:
                c = cls(**set_fields, **extra)
            except Exception as e:  # noqa: BLE001
                raise ConfigError(f"model.{tower}: {one_line(e, last=True)}") from None
        use_attention(c)
        out[tower] = c
    if out["text"].projection_size != out["vision"].hidden_size:
        raise ConfigError(f"model.pretrained: the text head projects to {out['text'].projection_size} but the image "
                          f"features are {out['vision'].hidden_size} wide")
    return out["vision"], out["text"]


@register_family
class SiglipFamily(ClipFamily):
    name = "siglip"
    config_class = SiglipConfig
    default_groups = {"vision": [r"^vision\."], "text": [r"^text\."],
                      "logit_scale": [r"^loss\.logit_scale$", r"^loss\.logit_bias$"]}
    freeze_shortcuts = {"freeze_vision": "vision", "freeze_text": "text"}
    # ``mmpipe bench peers --family siglip``: open_clip_train's --siglip trains SigLIP's loss on CLIP towers
    # (its SigLIP towers are timm's, under names mmpipe's weights are not converted to, and that bench starts both
    # systems from the same weights), so both systems train that job; mmpipe bench gpu, which needs no shared
    # weights, runs open_clip's own SigLIP (open_clip_peer)
    open_clip_peer_sets = ("model.loss=sigmoid",)

    # ---- config ---------------------------------------------------------------------------------
    @classmethod
    def validate(cls, model_cfg, where: str) -> None:
        for key, choices in (("loss", ("sigmoid", "softmax")), ("negatives", ("global", "micro_batch"))):
            if getattr(model_cfg, key) not in choices:
                raise ConfigError(f"{where}: model.{key}={getattr(model_cfg, key)!r} is not one of {', '.join(choices)}")

    @classmethod
    def image_size(cls, model_cfg) -> int:
        return _tower_configs(model_cfg)[0].image_size

    @classmethod
    def tokenizer_weights(cls, model_cfg) -> tuple:
        return ("model.pretrained", model_cfg.pretrained) if model_cfg.pretrained else (None, None)

    @classmethod
    def resolve(cls, model_cfg, tokenizer, data_cfg):
        """The text tower's vocabulary from the tokenizer (or the tokenizer checked against the
        weights'), its length from ``data.max_length`` when unset."""
        out = thawed_copy(model_cfg)
        t = out.text
        if model_cfg.pretrained:
            c = _tower_configs(model_cfg)[1]
            if len(tokenizer) > c.vocab_size:
                raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the text weights in model.pretrained="
                                  f"{model_cfg.pretrained} embed {c.vocab_size}: set data.tokenizer to their tokenizer")
            return out
        if t.vocab_size is None:
            t.vocab_size = len(tokenizer)
        elif t.vocab_size < len(tokenizer):
            raise ConfigError(f"model.text.vocab_size={t.vocab_size} is smaller than the tokenizer's {len(tokenizer)} "
                              "tokens")
        if t.max_position_embeddings is None:
            t.max_position_embeddings = data_cfg.max_length
        return out

    # ---- structure ------------------------------------------------------------------------------
    def __init__(self, model_cfg, seed: int = 0):
        ImageTextFamily.__init__(self, model_cfg, seed)
        self.vision_config, self.text_config = _tower_configs(model_cfg)
        self.projection_dim = self.vision_config.hidden_size
        self.logit_scale_init = (model_cfg.logit_scale_init if model_cfg.logit_scale_init is not None
                                 else {"sigmoid": math.log(10.0), "softmax": 2.6592}[model_cfg.loss])
        stats = hf.load_preprocessor_stats(model_cfg.pretrained)
        self.mean, self.std = stats or (parts.SIGLIP_MEAN, parts.SIGLIP_STD)
        self.text_length = self.text_config.max_position_embeddings
        self._weights = hf.WeightSource(model_cfg.pretrained, "model.pretrained") if model_cfg.pretrained else None
        nv, nt = self.vision_config.num_hidden_layers, self.text_config.num_hidden_layers
        self._layers = ([Layer("vision.embed", "vision", m.vision_embed_step)]
                        + [Layer(f"vision.blocks.{i}", "vision", m.vision_step) for i in range(nv)]
                        + [Layer("vision.head", "vision", m.vision_step), Layer("text.embed", "text", m.text_embed_step)]
                        + [Layer(f"text.blocks.{i}", "text", m.text_block_step) for i in range(nt)]
                        + [Layer("text.head", "text", m.text_head_step),
                           Layer("loss", "text", m.loss_step, takes=("vision",), eval_step=m.features_step)])

    def build_unseeded(self, name: str) -> nn.Module:
        if name == "loss":
            if self.cfg.loss == "sigmoid":
                return m.SigmoidLoss(self.logit_scale_init, self.cfg.logit_bias_init)
            return m.ClipLoss(self.logit_scale_init)
        tower, part = name.split(".", 1)
        if tower not in ("vision", "text"):
            raise KeyError(name)
        c = self.vision_config if tower == "vision" else self.text_config
        return parts.build_part(tower, part, c, self.mean, self.std)

    def matmuls(self, name: str, mb) -> list:
        if name == "loss":
            return [Matmul(mb.rows, self.projection_dim, mb.negatives or mb.images, None, 0)]
        tower, part = name.split(".", 1)
        if tower == "vision":
            c = self.vision_config
            return parts.products("vision", part, c, mb.images, (c.image_size // c.patch_size) ** 2)
        return parts.products("text", part, self.text_config, mb.rows, self.text_length)

    def load_pretrained(self, module: nn.Module, name: str) -> None:
        if self._weights is not None:
            hf.load_part_weights(module, name, self._weights, parts.RULES)

    def collate(self, tokenizer, data_cfg):
        """Every caption padded to the tower's length (SigLIP pools the last position, as its processor
        pads), whatever ``data.padding`` says."""
        return Collate(tokenizer, self.text_length, "max_length", 1)

    def example_batch(self, micro_batch_size: int, max_length: int, device, packed: bool = False) -> dict:
        g = torch.Generator().manual_seed(0)
        size, vocab = self.vision_config.image_size, self.text_config.vocab_size
        pix = torch.randint(0, 256, (micro_batch_size, 3, size, size), dtype=torch.uint8, generator=g)
        ids = torch.randint(5, max(6, vocab), (micro_batch_size, self.text_length), generator=g)
        return {"pixel_values": pix.to(device), "input_ids": ids.to(device),
                "attention_mask": torch.ones_like(ids).to(device)}

    # ---- open_clip as a peer ---------------------------------------------------------------------
    def open_clip_model(self) -> tuple:
        from mmpipe.families.siglip.open_clip_format import open_clip_config, open_clip_vision
        return open_clip_config(self), f"open_clip's SigLIP: {open_clip_vision(self)}, its text transformer"

    # ---- transformers format --------------------------------------------------------------------
    def hf_export(self, state, tokenizer, data_cfg=None):
        """``SiglipModel`` + ``SiglipProcessor`` (its image processor resizes to the square size, as
        SigLIP's does; the tokenizer pads to the tower's length)."""
        if self.cfg.loss != "sigmoid":
            raise NoHFFormat("SiglipModel's loss is the sigmoid loss; this model trained the softmax loss")
        from transformers import SiglipProcessor
        tokenizer.model_max_length = self.text_length
        return self.hf.hf_model(state), SiglipProcessor(self.preprocessor(), tokenizer)

    def preprocessor(self):
        from transformers import SiglipImageProcessor
        size = self.vision_config.image_size
        return SiglipImageProcessor(size={"height": size, "width": size}, image_mean=list(self.mean),
                                    image_std=list(self.std))

    @property
    def hf(self):
        return SiglipHF(self)


class SiglipHF(HFAdapter):
    """State dicts between mmpipe's plain names and ``SiglipModel``'s (``parts.RULES``)."""

    def __init__(self, family):
        self.family = family

    def to_hf(self, state: dict) -> dict:
        out = {}
        for k, v in state.items():
            theirs = hf.translate(k, parts.RULES)
            if theirs is None:
                raise KeyError(f"no transformers name for {k}")
            out[theirs] = v
        return out

    def from_hf(self, hf_state: dict) -> dict:
        out = {}
        for name in self.family.layer_names():
            with torch.device("meta"):
                keys = self.family.build_unseeded(name).state_dict()
            for k in keys:
                theirs = hf.translate(f"{name}.{k}", parts.RULES)
                if theirs not in hf_state:
                    raise ConfigError(f"transformers state dict has no {theirs} for {name}.{k}")
                out[f"{name}.{k}"] = hf_state[theirs]
        return out

    def hf_config(self):
        from transformers import SiglipConfig as C
        f = self.family
        return C(text_config=f.text_config.to_dict(), vision_config=f.vision_config.to_dict())

    def hf_model(self, state: dict):
        from transformers import SiglipModel
        model = SiglipModel(self.hf_config())
        missing, unexpected = model.load_state_dict(self.to_hf(state), strict=False)
        missing = [k for k in missing if not k.endswith("position_ids")]
        if missing or unexpected:
            raise ConfigError(f"SiglipModel: weights do not match (missing {missing[:3]}, unexpected {unexpected[:3]})")
        return model.eval()
