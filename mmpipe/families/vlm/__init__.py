"""The LLaVA-style VLM family (``model.type: vlm``): CLIP ViT features (``vision_feature_layer``)
-> projector -> a transformers causal LM (Llama or Qwen2), trained on the next-token loss of the
label tokens. Model, weights (``model.pretrained``: a local ``LlavaForConditionalGeneration``
directory) and the plain model's loss match transformers'. Trained on chat data
(``mmpipe.families.chat``) with the token-mean loss over the global batch (``token_mean``)."""
from __future__ import annotations

import torch
from torch import nn

from mmpipe.config.fields import thawed_copy
from mmpipe.config.registry import register_family
from mmpipe.errors import ConfigError
from mmpipe.families.base import Layer
from mmpipe.families.chat.export_format import PLAIN_TEMPLATE, no_added_special_tokens, set_generation_defaults
from mmpipe.families.chat.family import ChatFamily
from mmpipe.families.chat.masks import mark_mask
from mmpipe.families.chat.records import IMAGE
from mmpipe.families.products import Matmul, decoder_products
from mmpipe.families.towers import hf, siglip
from mmpipe.families.towers.common import (
    init_transformer_part,
    normalize_pixels,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    use_attention,
)
from mmpipe.families.towers.hf import image_processor
from mmpipe.families.towers.siglip import SIGLIP_MEAN, SIGLIP_STD
from mmpipe.families.towers.siglip import products as siglip_products
from mmpipe.families.towers.vision import _clip_block_cls, ClipVisionEmbed, vit_products
from mmpipe.families.vlm import model as m
from mmpipe.families.vlm.adapter import LLM_RULES, LOAD_RULES, VISION_RULES, VlmHF
from mmpipe.families.vlm.config import VlmConfig
from mmpipe.families.vlm.hf_configs import check_shapes, feature_choice, hf_configs, vision_config

@register_family
class VlmFamily(ChatFamily):
    name = "vlm"
    config_class = VlmConfig
    default_groups = {"vision": [r"^vision\."], "projector": [r"^projector\."], "llm": [r"^llm\."]}
    # ms-swift's names, and mmpipe's own (as for CLIP)
    freeze_shortcuts = {"freeze_vit": "vision", "freeze_aligner": "projector", "freeze_llm": "llm",
                        "freeze_vision": "vision", "freeze_projector": "projector", "freeze_text": "llm"}
    lr_shortcuts = {"vit_lr": "vision", "aligner_lr": "projector"}
    # checkpoints' "decay_split" (train/checkpoint_record.py): its decoder token table left the decayed group
    # when embedding tables were marked by type (2); a checkpoint of another split resumes by name
    decay_split = 2

    @classmethod
    def tokenizer_weights(cls, model_cfg):
        if model_cfg.pretrained:
            return "model.pretrained", model_cfg.pretrained
        if model_cfg.llm.pretrained:
            return "model.llm.pretrained", model_cfg.llm.pretrained
        return None, None

    @classmethod
    def resolve(cls, model_cfg, tokenizer, data_cfg):
        """``model.llm.vocab_size`` (at least the tokenizer's size), ``model.image_token_id`` (the
        tokenizer's ``<image>``) and the rotary table's length, when left unset."""
        out = thawed_copy(model_cfg)
        n = len(tokenizer)
        cls.resolve_image_token(out, tokenizer)
        out = feature_choice(out)
        key, weights = cls.tokenizer_weights(model_cfg)
        if weights:
            c = hf.load_hf_config(weights, key)
            size = getattr(c, "text_config", c).vocab_size
            if n > size:  # new tokens (e.g. <image>) get rows of their own, as resize_token_embeddings does
                out.llm.vocab_size = n
        elif out.llm.vocab_size is None:
            out.llm.vocab_size = n
        elif out.llm.vocab_size < n:
            raise ConfigError(f"model.llm.vocab_size={out.llm.vocab_size} is smaller than the tokenizer's {n} tokens")
        if not weights and out.llm.max_position_embeddings is None:
            out.llm.max_position_embeddings = max(2 * data_cfg.max_length, 64)
        return out

    @classmethod
    def validate(cls, model_cfg, where: str) -> None:
        super().validate(model_cfg, where)
        for key, v, choices in (("model.llm.arch", model_cfg.llm.arch, ("llama", "qwen2")),
                                ("model.vision_feature_select_strategy", model_cfg.vision_feature_select_strategy,
                                 ("default", "full", None))):
            if v not in choices:
                raise ConfigError(f"{where}: {key}={v!r} is not one of {', '.join(c for c in choices if c)}")
        try:
            check_shapes(model_cfg)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None

    @classmethod
    def pixels(cls, model_cfg, data_cfg, seed=None):
        """Square images at the CLIP tower's size (``data.decode_size`` / ``data.augment`` apply)."""
        from mmpipe.data.pixels import square_pixels
        return square_pixels(vision_config(model_cfg).image_size, data_cfg, seed)

    def __init__(self, model_cfg, seed: int = 0):
        model_cfg = feature_choice(model_cfg)  # unset: the directory's, else -2 / default (resolve records it)
        super().__init__(model_cfg, seed)
        check_shapes(model_cfg)
        self.vision_cfg, self.text_cfg, self.image_token_id = hf_configs(model_cfg)
        use_attention(self.vision_cfg)  # (CLIP / SigLIP ViT: one image a row, nothing packed)
        use_attention(self.text_cfg, kind=model_cfg.attention)
        L, k = self.vision_cfg.num_hidden_layers, model_cfg.vision_feature_layer
        self.vision_blocks = L + 1 + k if k < 0 else k  # hidden_states[i] = output after i blocks
        if not 0 <= self.vision_blocks <= L:
            raise ConfigError(f"model.vision_feature_layer={k}: the vision tower has {L} blocks")
        self.arch = "qwen2" if self.text_cfg.model_type == "qwen2" else "llama"
        self.tied = bool(getattr(self.text_cfg, "tie_word_embeddings", False))
        # (weights, name rules) in the order they are looked up
        self._sources = ([(hf.WeightSource(model_cfg.pretrained, "model.pretrained"), LOAD_RULES)]
                         if model_cfg.pretrained else [])
        if model_cfg.vision.pretrained and not model_cfg.pretrained:
            self._sources.append((hf.WeightSource(model_cfg.vision.pretrained, "model.vision.pretrained"),
                                  VISION_RULES))
        if model_cfg.llm.pretrained and not model_cfg.pretrained:
            self._sources.append((hf.WeightSource(model_cfg.llm.pretrained, "model.llm.pretrained"), LLM_RULES))
        self._layers = ([Layer("vision.embed", "vision", m.vision_embed_step)]
                        + [Layer(f"vision.blocks.{i}", "vision", m.vision_block_step)
                           for i in range(self.vision_blocks)]
                        + [Layer("projector", "projector", m.projector_step, takes=("vision",)),
                           Layer("llm.embed", "llm", m.llm_embed_step, takes=("projector",))]
                        + [Layer(f"llm.blocks.{i}", "llm", m.llm_block_step)
                           for i in range(self.text_cfg.num_hidden_layers)]
                        + [Layer("llm.head", "llm", m.llm_head_step)])

    def layers(self) -> list:
        return self._layers

    def build_unseeded(self, name: str) -> nn.Module:
        v, t = self.vision_cfg, self.text_cfg
        if name == "vision.embed":
            module = (siglip.VisionEmbed if self.siglip_tower else ClipVisionEmbed)(v, *self.pixel_stats())
        elif name.startswith("vision.blocks."):
            module = siglip.block(v) if self.siglip_tower else _clip_block_cls()(v)
        elif name == "projector":
            module = m.Projector(v.hidden_size, t.hidden_size, self.cfg.vision_feature_select_strategy)
        elif name == "llm.embed":
            module = m.TokenEmbed(t.vocab_size, t.hidden_size, getattr(t, "pad_token_id", None), self.image_token_id)
        elif name.startswith("llm.blocks."):
            module = m.decoder_block_cls(self.arch)(t, int(name.rsplit(".", 1)[1]))
        elif name == "llm.head":
            norm_cls = self._norm_cls()
            module = m.LmHead(norm_cls(t.hidden_size, eps=t.rms_norm_eps), t.hidden_size, t.vocab_size)
        else:
            raise KeyError(name)
        init_transformer_part(module, std=getattr(t, "initializer_range", 0.02))
        return module

    def matmuls(self, name: str, mb) -> list:
        """The vision tower's products on the micro-batch's images (a block given none runs on one
        zero row: ``chat.layers.through``), the projector's on their image tokens, the decoder blocks'
        and the LM head's on every (padded) token position."""
        v, t = self.vision_cfg, self.text_cfg
        if self.siglip_tower and name.startswith("vision."):
            part = "embed" if name == "vision.embed" else "blocks"
            return siglip_products("vision", part, v, mb.images if part == "embed" else max(mb.images, 1),
                            (v.image_size // v.patch_size) ** 2)
        if name == "vision.embed":
            return vit_products(v, "embed", mb.images)
        if name.startswith("vision.blocks."):
            return vit_products(v, "blocks", max(mb.images, 1))
        if name == "projector":
            tokens = mb.images * self.n_image_tokens()
            return [Matmul(tokens, v.hidden_size, t.hidden_size, "linear_1", 0),
                    Matmul(tokens, t.hidden_size, t.hidden_size, "linear_2", recomputed=False)]
        return decoder_products(name, mb, t)

    def _norm_cls(self):
        if self.arch == "llama":
            from transformers.models.llama.modeling_llama import LlamaRMSNorm as N
        else:
            from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm as N
        return N

    def hf_name(self, name: str):
        """(source, transformers tensor name) of a plain weight in the pretrained directories, or
        (None, None): the layer has no pretrained weights (e.g. a new projector)."""
        for source, rules in self._sources:
            for mine, theirs in rules:
                if name.startswith(mine):
                    for prefix in theirs:
                        if prefix + name[len(mine):] in source:
                            return source, prefix + name[len(mine):]
        if self.tied and name == "llm.head.lm_head.weight":  # a tied head is saved as the embedding
            return self.hf_name("llm.embed.embed_tokens.weight")
        return None, None

    def _covers(self, name: str):
        """The source whose rules cover layer ``name`` (None: no pretrained weights for it)."""
        for source, rules in self._sources:
            if any((name + ".").startswith(mine) or mine.startswith(name + ".") for mine, _ in rules):
                return source
        return None

    def load_pretrained(self, module: nn.Module, name: str) -> None:
        covering = self._covers(name)
        if covering is None:
            return
        sd = {}
        for k, v in module.state_dict().items():
            source, theirs = self.hf_name(f"{name}.{k}")
            if theirs is None:
                raise ConfigError(f"{covering.key}: {covering.path} has no weight for {name}.{k}")
            t = source.get(theirs)
            grown = (k in ("embed_tokens.weight", "lm_head.weight") and t.dim() == 2 and t.shape[1] == v.shape[1]
                     and t.shape[0] < v.shape[0])
            if grown:  # tokens the tokenizer added (e.g. <image>): their rows keep the seeded init
                t = torch.cat([t.to(v.dtype), v[t.shape[0]:]])
            if t.shape != v.shape:
                raise ConfigError(f"{source.key}: weight '{theirs}' in {source.path} has shape "
                                  f"{tuple(t.shape)}, the model expects {tuple(v.shape)} for {name}.{k}")
            sd[k] = t
        module.load_state_dict(sd, strict=True)

    def hf_export(self, state, tokenizer, data_cfg=None):
        """``LlavaForConditionalGeneration`` + ``LlavaProcessor`` (with the run's chat template)."""
        from transformers import LlavaProcessor

        stop = self.encoder(tokenizer, 1).end_of_turn_ids()  # before the template is set: as training rendered
        if not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = PLAIN_TEMPLATE
        no_added_special_tokens(tokenizer)  # training tokenized with add_special_tokens=False
        proc = LlavaProcessor(self.preprocessor(), tokenizer,
                              patch_size=self.vision_cfg.patch_size,
                              vision_feature_select_strategy=self.cfg.vision_feature_select_strategy,
                              chat_template=tokenizer.chat_template, image_token=IMAGE,
                              num_additional_image_tokens=0 if self.siglip_tower else 1)
        model = self.hf.hf_model(state)
        set_generation_defaults(model, tokenizer, stop)
        return model, proc

    def preprocessor(self):
        return image_processor(self.vision_cfg.image_size, *self.pixel_stats())

    @property
    def hf(self):
        """The transformers adapter: ``to_hf`` / ``from_hf``, ``hf_config()`` (LlavaConfig), ``hf_model``."""
        return VlmHF(self)

    def tied_weights(self) -> list:
        return [("llm.embed.embed_tokens.weight", "llm.head.lm_head.weight")] if self.tied else []

    @property
    def siglip_tower(self) -> bool:
        """SigLIP's ViT (no class token; 0.5 pixel mean and std) rather than CLIP's."""
        return self.vision_cfg.model_type == "siglip_vision_model"

    def pixel_stats(self) -> tuple:
        return (SIGLIP_MEAN, SIGLIP_STD) if self.siglip_tower else (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)

    def n_image_tokens(self) -> int:
        """The tower's positions (patches, and CLIP's class token), less the first under the ``default``
        strategy (transformers' LLaVA drops it, whatever it is)."""
        s, p = self.vision_cfg.image_size, self.vision_cfg.patch_size
        return (s // p) ** 2 + (not self.siglip_tower) - (self.cfg.vision_feature_select_strategy == "default")

    def image_tokens(self, image, data_cfg=None) -> int:
        return self.n_image_tokens()  # every image is the tower's square: one count

    def generation_inputs(self, images: list, data_cfg=None) -> dict:
        """``pixel_values`` (N, 3, S, S) float, normalised, of the images at generation, decoded and
        resized as training's loader did (no augmentation)."""
        px = self.pixels(self.cfg, data_cfg)
        out = []
        for path in images:
            pixels, why = px.load(path, IMAGE, 0, 0, draft=False)
            if pixels is None:
                raise ConfigError(f"{path}: {why}")
            out.append(pixels)
        return {"pixel_values": normalize_pixels(torch.stack(out), *self.pixel_stats(), torch.float32)}

    def example_batch(self, micro_batch_size: int, max_length: int, device, packed: bool = False) -> dict:
        """Rows of ``max_length`` tokens, one image each; ``packed``: each row two samples (segment
        ids in the mask, as a packed run's rows: the block-diagonal attention is what is timed)."""
        g = torch.Generator().manual_seed(0)
        n_img = self.n_image_tokens()
        ids = torch.randint(0, self.text_cfg.vocab_size, (micro_batch_size, max(max_length, n_img + 1)), generator=g)
        ids[ids == self.image_token_id] = 0
        ids[:, :n_img] = self.image_token_id
        pix = self.pixels(self.cfg, None).example(micro_batch_size, g)["pixel_values"]
        mask = torch.ones_like(ids)
        if packed:
            mask[:, ids.shape[1] // 2:] = 2
        mask = mask.to(device)
        mark_mask(mask, "packed" if packed else "causal")  # (on the meta device too)
        return {"pixel_values": pix.to(device), "input_ids": ids.to(device),
                "attention_mask": mask, "labels": ids.to(device)}
