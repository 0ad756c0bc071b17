"""LLaVA-style VLM layers, matching transformers' ``LlavaForConditionalGeneration`` arithmetic:

    vision: vision.embed, vision.blocks.0 .. vision.blocks.K-1   (K = blocks up to the feature layer)
    projector: projector   (CLS dropped for ``default``; linear_1 -> GELU -> linear_2)
    llm: llm.embed (token embedding; image features replace the image-token positions),
         llm.blocks.0 .. llm.blocks.N-1, llm.head (final norm + LM head -> logits)

Activation contract::

    data        (pixel_values | None, input_ids, attention_mask)
    vision      (vision_hidden | None, input_ids, attention_mask)
    projector   (image_features | None, input_ids, attention_mask)
    llm         (hidden, input_ids, attention_mask)
    llm.head    logits; the loss (shifted next-token cross-entropy, labels -100 ignored) takes the
                ``labels`` field on the last stage
"""
from __future__ import annotations

from torch import nn

from mmpipe.families.chat.layers import LmHead, TokenEmbed, through  # noqa: F401 - LmHead, TokenEmbed: the VLM's layers
from mmpipe.families.chat.masks import attention_inputs


class Projector(nn.Module):
    def __init__(self, vision_width: int, llm_width: int, feature_strategy: str):
        super().__init__()
        self.linear_1 = nn.Linear(vision_width, llm_width, bias=True)
        self.act = nn.GELU()
        self.linear_2 = nn.Linear(llm_width, llm_width, bias=True)
        self.drop_cls = feature_strategy == "default"

    def forward(self, vision_hidden):
        h = vision_hidden[:, 1:] if self.drop_cls else vision_hidden
        return self.linear_2(self.act(self.linear_1(h)))


def decoder_block_cls(arch: str):
    """transformers' decoder layer that computes its own rotary table and causal+padding mask."""
    if arch == "llama":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer as Base
        from transformers.models.llama.modeling_llama import (
            LlamaRotaryEmbedding as Rotary,
        )
    else:
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer as Base
        from transformers.models.qwen2.modeling_qwen2 import (
            Qwen2RotaryEmbedding as Rotary,
        )

    class DecoderBlock(Base):
        def __init__(self, config, layer_idx: int):
            super().__init__(config, layer_idx)
            self.rotary = Rotary(config=config)  # inv_freq is a non-persistent buffer: not in checkpoints

        def forward(self, hidden_states, attention_mask):
            pos, mask, spans = attention_inputs(attention_mask, hidden_states.dtype, self.self_attn.config._attn_implementation)
            cos_sin = self.rotary(hidden_states, pos)
            out = super().forward(hidden_states, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin,
                                  **spans)
            return out[0] if isinstance(out, tuple) else out

    return DecoderBlock


# ---- layer steps ---------------------------------------------------------------------------------
def vision_embed_step(part, acts):
    pixels, ids, mask = acts
    return (part(pixels) if pixels is not None else None), ids, mask


def vision_block_step(part, acts):
    h, ids, mask = acts
    if h is None:
        return None, ids, mask
    return (part(h) if h.shape[0] else through(part, h)), ids, mask


def projector_step(part, acts):
    h, ids, mask = acts
    return (part(h) if h is not None else None), ids, mask


def llm_embed_step(part, acts):
    feats, ids, mask = acts
    return part(ids, feats), ids, mask


def llm_block_step(part, acts):
    h, ids, mask = acts
    return part(h, mask), ids, mask


def llm_head_step(part, acts):
    h, _, _ = acts
    return part(h)
