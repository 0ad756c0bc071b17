"""The ``model:`` section of a SigLIP dual encoder (``model.type: siglip``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mmpipe.config.fields import Section, option


@dataclass
class SiglipVisionSection(Section):
    """SigLIP's ViT (transformers ``SiglipVisionConfig`` fields; unset = transformers' defaults)."""
    hidden_size: Optional[int] = option(None, "transformer width", ge=1)
    num_hidden_layers: Optional[int] = option(None, "number of transformer blocks", ge=1)
    num_attention_heads: Optional[int] = option(None, "attention heads", ge=1)
    intermediate_size: Optional[int] = option(None, "MLP width", ge=1)
    image_size: Optional[int] = option(None, "input resolution in pixels (square)", ge=1)
    patch_size: Optional[int] = option(None, "ViT patch size", ge=1)


@dataclass
class SiglipTextSection(Section):
    """SigLIP's text transformer (transformers ``SiglipTextConfig`` fields)."""
    hidden_size: Optional[int] = option(None, "transformer width", ge=1)
    num_hidden_layers: Optional[int] = option(None, "number of transformer blocks", ge=1)
    num_attention_heads: Optional[int] = option(None, "attention heads", ge=1)
    intermediate_size: Optional[int] = option(None, "MLP width", ge=1)
    vocab_size: Optional[int] = option(None, "vocabulary size; unset = the tokenizer's size", ge=1)
    max_position_embeddings: Optional[int] = option(None, "the tower's text length: every caption is padded to it, "
                                                          "as SigLIP's processor does (it pools the last position); "
                                                          "unset = data.max_length", ge=1)


@dataclass
class SiglipConfig(Section):
    type: str = option("siglip", "model family; siglip = SigLIP dual encoder (transformers' SiglipModel)")
    pretrained: Optional[str] = option(None, "hub id (org/name[@revision]) or local transformers SiglipModel directory: both towers, temperature, bias")
    loss: str = option("sigmoid", "sigmoid: SigLIP's pairwise sigmoid loss; softmax: CLIP's InfoNCE on SigLIP towers")
    logit_scale_init: Optional[float] = option(None, "initial log temperature; unset = log 10 (sigmoid) or 2.6592")
    logit_bias_init: float = option(-10.0, "initial logit bias of the sigmoid loss (SigLIP: -10)")
    loss_block: int = option(1024, "rows of the global batch's B x B logits its loss holds at once", ge=1)
    local_loss: bool = option(True, "with data parallelism, each rank computes only its own samples' rows of the "
                                    "global loss (its texts against every image) and the feature gradients are "
                                    "summed across ranks: the same loss and gradients with 1/D of its logits, "
                                    "computed and held (open_clip's --local-loss --gather-with-grad); false: every rank "
                                    "computes the whole B x B")
    negatives: str = option("global", "global: the loss of a step spans its whole global batch; micro_batch: only "
                                      "the pairs of the same micro-batch")
    vision: SiglipVisionSection = field(default_factory=SiglipVisionSection, metadata={"help": "SigLIP image tower"})
    text: SiglipTextSection = field(default_factory=SiglipTextSection, metadata={"help": "SigLIP text tower"})
