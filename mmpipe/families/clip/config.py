"""The ``model:`` section of a CLIP-style dual encoder (``model.type: clip``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mmpipe.config.fields import Section, option


@dataclass
class VisionConfig(Section):
    """Image tower. transformers config fields, or a local ``save_pretrained`` directory."""
    arch: str = option("clip_vit", "clip_vit (transformers CLIP ViT) or resnet (torchvision)")
    pretrained: Optional[str] = option(None, "hub id (org/name[@revision]) or local save_pretrained dir (CLIPVisionModel / CLIPModel) or resnet weights dir")
    hidden_size: Optional[int] = option(None, "transformer width (clip_vit); unset = transformers default", ge=1)
    num_hidden_layers: Optional[int] = option(None, "number of transformer blocks (clip_vit)", ge=1)
    num_attention_heads: Optional[int] = option(None, "attention heads (clip_vit)", ge=1)
    intermediate_size: Optional[int] = option(None, "MLP width (clip_vit)", ge=1)
    image_size: Optional[int] = option(None, "input resolution in pixels (square)", ge=1)
    patch_size: Optional[int] = option(None, "ViT patch size (clip_vit)", ge=1)
    variant: str = option("resnet18", "torchvision variant for arch=resnet: resnet18|resnet34|resnet50")


@dataclass
class TextConfig(Section):
    """Text tower. transformers config fields, or a local ``save_pretrained`` directory."""
    arch: str = option("clip_text", "clip_text (transformers CLIP text transformer) or bert (transformers BERT)")
    pretrained: Optional[str] = option(None, "hub id (org/name[@revision]) or local save_pretrained dir (CLIPTextModel / CLIPModel / BertModel)")
    hidden_size: Optional[int] = option(None, "transformer width; unset = transformers default", ge=1)
    num_hidden_layers: Optional[int] = option(None, "number of transformer blocks", ge=1)
    num_attention_heads: Optional[int] = option(None, "attention heads", ge=1)
    intermediate_size: Optional[int] = option(None, "MLP width", ge=1)
    vocab_size: Optional[int] = option(None, "vocabulary size; unset = the tokenizer's size", ge=1)
    max_position_embeddings: Optional[int] = option(None, "longest sequence the position table holds", ge=1)
    pooling: str = option("auto", "auto (clip_text: EOS token, bert: mean), eos, cls, mean, or pooler (bert: its "
                                  "dense+tanh pooler over [CLS], as transformers' VisionTextDualEncoderModel)")
    eos_token_id: Optional[int] = option(None, "EOS id for eos pooling; unset = the tokenizer's EOS/SEP id")
    dropout: Optional[float] = option(None, "dropout probability (clip_text: attention dropout; bert: hidden and "
                                            "attention dropout); unset = the weights' or transformers' default "
                                            "(clip_text 0, bert 0.1)", ge=0, le=1)


@dataclass
class ClipConfig(Section):
    type: str = option("clip", "model family; clip = dual encoder with symmetric contrastive loss")
    pretrained: Optional[str] = option(None, "hub id (org/name[@revision]) or local transformers CLIPModel directory: loads both towers, projections, temperature")
    projection_dim: int = option(512, "width of the shared image-text embedding space", ge=1)
    loss: str = option("softmax", "softmax: CLIP's symmetric InfoNCE; sigmoid: SigLIP's pairwise sigmoid loss with a "
                                  "learnable bias (open_clip's --siglip)")
    logit_scale_init: Optional[float] = option(None, "initial log temperature; unset = the loss's (softmax: CLIP's "
                                                     "log(1/0.07) = 2.6592, sigmoid: SigLIP's log 10)")
    logit_bias_init: float = option(-10.0, "initial logit bias of the sigmoid loss (SigLIP: -10)")
    loss_block: int = option(1024, "rows of the global batch's B x B logits its loss holds at once (a step loss is "
                                   "computed, with its gradients, in blocks of this many rows: memory O(block x B))",
                             ge=1)
    local_loss: bool = option(True, "with data parallelism, each rank computes only its own samples' rows of the "
                                    "global loss (its texts against every image) and the feature gradients are "
                                    "summed across ranks: the same loss and gradients with 1/D of its logits, "
                                    "computed and held (open_clip's --local-loss --gather-with-grad); false: every rank "
                                    "computes the whole B x B")
    negatives: str = option("global", "global: the contrastive loss of a step spans its whole global batch (every "
                                      "micro-batch of every data-parallel rank), as open_clip; micro_batch: only the "
                                      "pairs of the same micro-batch are negatives")
    vision: VisionConfig = field(default_factory=VisionConfig, metadata={"help": "image tower"})
    text: TextConfig = field(default_factory=TextConfig, metadata={"help": "text tower"})


ModelConfig = ClipConfig  # the default family's model section
