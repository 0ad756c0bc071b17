"""The CLIP-style dual-encoder family (``model.type: clip``): image tower (CLIP ViT or ResNet) and
text tower (CLIP text transformer or BERT), linear projections, symmetric InfoNCE loss with a
learnable temperature; zero-shot retrieval as its evaluation; transformers' ``CLIPModel`` as its
HF format."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from mmpipe.config.fields import thawed_copy
from mmpipe.config.registry import register_family
from mmpipe.data.tokenizer import eos_id as eos_of
from mmpipe.errors import ConfigError, NoHFFormat
from mmpipe.families.base import Layer
from mmpipe.families.clip import model as m
from mmpipe.families.clip.config import ClipConfig
from mmpipe.families.image_text import ImageTextFamily
from mmpipe.families.products import Matmul
from mmpipe.families.towers import hf
from mmpipe.families.towers.hf import image_processor
from mmpipe.families.towers.text import TextSpec
from mmpipe.families.towers.vision import VisionSpec

_CHOICES = {"vision.arch": ("clip_vit", "resnet"), "vision.variant": ("resnet18", "resnet34", "resnet50"),
            "text.arch": ("clip_text", "bert"), "text.pooling": ("auto", "eos", "cls", "mean", "pooler"),
            ".loss": ("softmax", "sigmoid"), ".negatives": ("global", "micro_batch")}
_SCALE_INIT = {"softmax": 2.6592, "sigmoid": math.log(10.0)}  # CLIP's log(1/0.07); SigLIP's log 10


@register_family
class ClipFamily(ImageTextFamily):
    name = "clip"
    config_class = ClipConfig
    inputs = ("pixel_values", "input_ids", "attention_mask")
    min_micro_batch = 2
    min_micro_batch_why = "its contrastive loss has no negatives with 1 and is identically 0"
    default_groups = {"vision": [r"^vision\."], "projector": [r"^visual_projection\.", r"^text_projection\."],
                      "text": [r"^text\."], "logit_scale": [r"^loss\.logit_scale$", r"^loss\.logit_bias$"]}
    freeze_shortcuts = {"freeze_vision": "vision", "freeze_projector": "projector", "freeze_text": "text"}
    plain_api = m.DualEncoder  # encode_image / encode_text on the plain model, as open_clip's

    # ---- config ---------------------------------------------------------------------------------
    @classmethod
    def validate(cls, model_cfg, where: str) -> None:
        for key, choices in _CHOICES.items():
            section, field = key.split(".")
            v = getattr(getattr(model_cfg, section) if section else model_cfg, field)
            if v not in choices:
                raise ConfigError(f"{where}: model.{key.lstrip('.')}={v!r} is not one of {', '.join(choices)}")

    @classmethod
    def image_size(cls, model_cfg) -> int:
        """The image tower's input size (from a pretrained config if there is one)."""
        return VisionSpec(model_cfg.vision, model_cfg.pretrained).image_size

    @classmethod
    def tokenizer_weights(cls, model_cfg) -> tuple:
        if model_cfg.text.pretrained:
            return "model.text.pretrained", model_cfg.text.pretrained
        if model_cfg.pretrained:
            return "model.pretrained", model_cfg.pretrained
        return None, None

    @classmethod
    def resolve(cls, model_cfg, tokenizer, data_cfg):
        """Text-tower fields a config may leave to the tokenizer. With pretrained text weights the
        tokenizer must fit their vocabulary, and pooling reads the EOS of the tokenizer actually used."""
        num_tokens, eos_id = len(tokenizer), eos_of(tokenizer)
        out = thawed_copy(model_cfg)
        t = out.text
        key, weights_dir = cls.tokenizer_weights(model_cfg)
        if weights_dir:
            c = hf.load_hf_config(weights_dir, key)
            c = getattr(c, "text_config", c)
            if num_tokens > c.vocab_size:
                raise ConfigError(f"the tokenizer has {num_tokens} tokens but the text weights in {key}={weights_dir} "
                                  f"embed {c.vocab_size}: it is not their tokenizer; set data.tokenizer to the one "
                                  "they were trained with")
        else:
            if t.vocab_size is None:
                t.vocab_size = num_tokens
            elif t.vocab_size < num_tokens:
                raise ConfigError(f"model.text.vocab_size={t.vocab_size} is smaller than the tokenizer's {num_tokens} "
                                  "tokens")
            if t.max_position_embeddings is None:
                t.max_position_embeddings = max(data_cfg.max_length, 16)
        if t.eos_token_id is None:
            t.eos_token_id = eos_id
        return out

    # ---- the contrastive loss over the global batch ------------------------------------------------
    @property
    def step_loss(self) -> bool:
        return self.cfg.negatives == "global"

    @property
    def local_step_loss(self) -> bool:
        return self.cfg.local_loss

    def batch_loss(self, loss_module, features, rows=None, cols=None):
        """The loss (``model.loss``) over every pair of ``features`` (image and text features side by
        side, as the loss layer's ``eval_step`` gives them), with the loss module's parameters; with
        ``rows``, a function whose parameter gradient is those rows' share (``losses.rows_surrogate``)."""
        img, txt = features.split(features.shape[-1] // 2, dim=-1)
        return loss_module(img, txt) if rows is None else loss_module(img, txt, rows=rows, cols=cols)

    def batch_loss_grads(self, loss_module, features, params: list, rows=None, combine=None) -> tuple:
        """``batch_loss`` and its gradients for ``features`` and ``params``, ``model.loss_block`` rows
        of the B x B logits at a time (``losses.loss_and_grads``): (loss, feature grad, param grads);
        with ``rows`` only their share (its texts against every image), ``combine`` completing the
        softmax columns' log-sum-exp over the other shares."""
        if rows is None and features.shape[0] <= self.cfg.loss_block:  # one block: autograd through the whole
            return super().batch_loss_grads(loss_module, features, params)  # loss, as the loss layer
        from mmpipe.families.clip.losses import loss_and_grads
        img, txt = features.split(features.shape[-1] // 2, dim=-1)
        loss, gi, gt, gp = loss_and_grads(loss_module, img, txt, params, self.cfg.loss_block, rows, combine)
        return loss, torch.cat([gi, gt], dim=-1), gp

    @property
    def step_loss_block_rows(self) -> int:
        return self.cfg.loss_block

    @property
    def step_loss_pair_bytes(self) -> int:
        """Bytes per pair autograd holds through the whole loss (``planning.memory``; LiveBytes counted)."""
        from mmpipe.families.clip.losses import ClipLoss, SigmoidLoss
        return (SigmoidLoss if self.cfg.loss == "sigmoid" else ClipLoss).pair_bytes

    # ---- structure ------------------------------------------------------------------------------
    def __init__(self, model_cfg, seed: int = 0):
        super().__init__(model_cfg, seed)
        clip_dir = model_cfg.pretrained
        if clip_dir:
            top = hf.load_hf_config(clip_dir, "model.pretrained")
            if not hasattr(top, "vision_config"):
                raise ConfigError(f"model.pretrained: {clip_dir} is not a CLIPModel directory "
                                  "(use model.vision.pretrained / model.text.pretrained for single towers)")
            self.projection_dim, self.logit_scale_init = top.projection_dim, top.logit_scale_init_value
        else:
            self.projection_dim, self.logit_scale_init = model_cfg.projection_dim, model_cfg.logit_scale_init
        if self.logit_scale_init is None or (model_cfg.loss == "sigmoid" and clip_dir):
            # (a CLIPModel's softmax temperature is no start for the sigmoid loss)
            self.logit_scale_init = _SCALE_INIT[model_cfg.loss]
        self.vision = VisionSpec(model_cfg.vision, clip_dir)
        self.text = TextSpec(model_cfg.text, clip_dir, eos_token_id=getattr(model_cfg.text, "eos_token_id", None))
        self._top_weights = hf.WeightSource(clip_dir, "model.pretrained") if clip_dir else None
        self._layers = self._make_layers()

    def _make_layers(self) -> list:
        nv, nt = self.vision.num_blocks, self.text.num_blocks
        return ([Layer("vision.embed", "vision", m.vision_embed_step)]
                + [Layer(f"vision.blocks.{i}", "vision", m.vision_step) for i in range(nv)]
                + [Layer("vision.head", "vision", m.vision_step), Layer("visual_projection", "vision", m.vision_step),
                   Layer("text.embed", "text", m.text_embed_step)]
                + [Layer(f"text.blocks.{i}", "text", m.text_block_step) for i in range(nt)]
                + [Layer("text.head", "text", m.text_head_step),
                   Layer("text_projection", "text", m.text_projection_step),
                   Layer("loss", "text", m.loss_step, takes=("vision",), eval_step=m.features_step)])

    def layers(self) -> list:
        return self._layers

    def build_unseeded(self, name: str) -> nn.Module:
        if name.startswith("vision."):
            return self.vision.build_part(name[len("vision."):])
        if name.startswith("text."):
            return self.text.build_part(name[len("text."):])
        if name == "loss":
            if self.cfg.loss == "sigmoid":
                return m.SigmoidLoss(self.logit_scale_init, self.cfg.logit_bias_init)
            return m.ClipLoss(self.logit_scale_init)
        if name not in ("visual_projection", "text_projection"):
            raise KeyError(name)
        width = self.vision.width if name == "visual_projection" else self.text.width
        lin = nn.Linear(width, self.projection_dim, bias=False)
        nn.init.normal_(lin.weight, std=lin.in_features ** -0.5)
        return lin

    def matmuls(self, name: str, mb) -> list:
        """The towers' products (``VisionSpec`` / ``TextSpec``), the projections, and the loss's
        logits: each caption against ``mb.negatives`` images (the global batch under a step loss)."""
        if name.startswith("vision."):
            return self.vision.matmuls(name[len("vision."):], mb.images)
        if name.startswith("text."):
            return self.text.matmuls(name[len("text."):], mb.rows, mb.seq_len)
        if name in ("visual_projection", "text_projection"):
            rows, width = (mb.images, self.vision.width) if name == "visual_projection" else (mb.rows, self.text.width)
            return [Matmul(rows, width, self.projection_dim, "", 0, recomputed=False)]
        return [Matmul(mb.rows, self.projection_dim, mb.negatives or mb.images, None, 0)]  # the loss

    def load_pretrained(self, module: nn.Module, name: str) -> None:
        if name.startswith("vision."):
            source, rules = self.vision.weight_source(), self.vision.rules
        elif name.startswith("text."):
            source, rules = self.text.weight_source(), self.text.rules
        elif self.cfg.loss == "sigmoid":
            return  # a CLIPModel's softmax temperature is no start for the sigmoid loss: SigLIP's init
        else:
            source, rules = self._top_weights, hf.CLIP_TOP_RULES
        if source is not None:
            # BERT's pooler is optional in saved BERTs (sentence encoders drop it): fresh when absent
            hf.load_part_weights(module, name, source, rules, optional=("text.head.pooler.",))

    # ---- open_clip as a peer ---------------------------------------------------------------------
    def open_clip_peer(self) -> tuple:
        """(open_clip's model config, open_clip_train's flags for this model's loss, what open_clip's towers
        are where they are not this model's, else None): the peer run of ``mmpipe bench gpu``."""
        config, towers = self.open_clip_model()
        return config, ["--siglip"] if self.cfg.loss == "sigmoid" else [], towers

    def open_clip_model(self) -> tuple:
        """(open_clip's model config of this model's architecture, None: its towers are this model's)."""
        from mmpipe.families.clip.open_clip_format import open_clip_config
        return open_clip_config(self), None

    # ---- evaluation and profiling ---------------------------------------------------------------
    def evaluate(self, outputs: list, labels: list, samples: list) -> dict:
        """Zero-shot retrieval both ways over the val pairs; pairs sharing a caption match too."""
        from mmpipe.families.clip.retrieval import retrieval_metrics
        feats = torch.cat([o.float() for o in outputs]).cpu()[:len(samples)]
        d = feats.shape[1] // 2
        return retrieval_metrics(feats[:, :d], feats[:, d:], captions=[s.text for s in samples])

    def eval_line(self, record: dict) -> str:
        return ("eval step {step}: image->text R@1 {i2t_r1:.3f} R@5 {i2t_r5:.3f} | text->image R@1 {t2i_r1:.3f} "
                "R@5 {t2i_r5:.3f} (n={n}, chance R@1 {chance_r1:.3f})".format(**record)
                + ("" if record.get("finite", True) else
                   f" -- NOT FINITE: {record['nonfinite']} feature rows hold NaN/inf (scored as misses)"))

    def example_batch(self, micro_batch_size: int, max_length: int, device, packed: bool = False) -> dict:
        g = torch.Generator().manual_seed(0)
        size, vocab = self.vision.image_size, self.text.hf_config.vocab_size
        pix = torch.randint(0, 256, (micro_batch_size, 3, size, size), dtype=torch.uint8, generator=g)
        ids = torch.randint(5, max(6, vocab), (micro_batch_size, min(max_length, self.text.max_length)), generator=g)
        return {"pixel_values": pix.to(device), "input_ids": ids.to(device),
                "attention_mask": torch.ones_like(ids).to(device)}

    def hf_export(self, state, tokenizer, data_cfg=None):
        """``CLIPModel`` + ``CLIPProcessor`` (CLIP ViT + CLIP text) or ``VisionTextDualEncoderModel`` +
        its processor (CLIP ViT + BERT with its pooler); other towers raise ``NoHFFormat``."""
        from mmpipe.families.clip.adapter import format_of
        kind, why = format_of(self)
        if kind is None:
            raise NoHFFormat(why)
        if kind == "CLIPModel":
            from transformers import CLIPProcessor as P
        else:
            from transformers import VisionTextDualEncoderProcessor as P
        return self.hf.hf_model(state), P(self.preprocessor(), tokenizer)

    def preprocessor(self):
        return image_processor(self.vision.image_size, self.vision.mean, self.vision.std)

    @property
    def hf(self):
        """The transformers adapter: ``to_hf`` / ``from_hf`` state dicts, ``hf_config()`` (CLIPConfig)."""
        from mmpipe.families.clip.adapter import ClipHF
        return ClipHF(self)
