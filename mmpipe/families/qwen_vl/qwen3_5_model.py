"""Qwen3.5's pipeline layers: transformers' modules (``Qwen3_5ForConditionalGeneration``'s arithmetic), cut
into mmpipe's layers, with what a packed row needs.

- The ViT: Qwen3's (``qwen3_vision``, shared with Qwen3-VL).
- The hybrid decoder: per ``layer_types``, a GatedDeltaNet block (linear attention: a causal depthwise
  conv and a gated delta-rule recurrence) or a gated full-attention block (q/k norm, output gate, partial
  rotary over interleaved multimodal positions). **A packed row's samples never share state**: a
  linear-attention block runs its conv and recurrence on each sample of the row separately (both start
  from zero at the sample's first token, forward and backward), and full attention stays within a sample
  (the block-diagonal mask of ``chat.masks``), as it does for Qwen2.5-VL. Padding after a row's tokens is
  causal-invisible and left as it is. Where flash-linear-attention / causal-conv1d are installed, the
  same rule is theirs (``cu_seqlens`` / ``seq_idx``); here the per-sample split is the reference path.
"""
from __future__ import annotations

from mmpipe.families.chat.masks import attention_inputs, mask_kind
from mmpipe.families.qwen_vl.qwen3_vision import vision_classes  # noqa: F401 - this family's ViT (``model_parts``)


def decoder_block_cls():
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        Qwen3_5DecoderLayer,
        Qwen3_5GatedDeltaNet,
        Qwen3_5TextRotaryEmbedding,
    )

    class SampleWiseGatedDeltaNet(Qwen3_5GatedDeltaNet):
        """A GatedDeltaNet that keeps a row's samples apart: ``attention_mask`` (the batch's: segment ids, 0 =
        padding) decides. Rows of one sample then padding run whole (the padding comes after every real token:
        a causal conv and recurrence never carry it back); left padding as transformers runs it (its inputs
        zeroed); a packed row sample by sample, each from a zero conv window and a zero state, its outputs
        written back in place (padding: zeros)."""

        def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
            kind = None if attention_mask is None or cache is not None else mask_kind(attention_mask)
            if kind == "packed" and attention_mask.is_meta:  # shapes only (the memory plan): the row whole, the
                kind = "causal"  # same output shape; a packed row's samples have no values here to split by
            if kind != "packed":
                return super().forward(hidden_states, cache=cache, attention_mask=attention_mask if kind == "dense"
                                       else None, **kwargs)
            out = hidden_states.new_zeros(hidden_states.shape[:-1] + (self.out_proj.out_features,))
            for b, row in enumerate(attention_mask.tolist()):
                for start, end in sample_spans(row):
                    out[b, start:end] = super().forward(hidden_states[b:b + 1, start:end], **kwargs)[0]
            return out

    class DecoderBlock(Qwen3_5DecoderLayer):
        """transformers' hybrid decoder layer with its interleaved M-RoPE table (non-persistent); positions
        come with the batch, the mask kind from ``attention_inputs``; a linear-attention layer keeps a packed
        row's samples apart (``SampleWiseGatedDeltaNet``)."""

        def __init__(self, config, layer_idx: int):
            super().__init__(config, layer_idx)
            if self.block_type == "linear_attention":
                self.linear_attn.__class__ = SampleWiseGatedDeltaNet  # (its parameters as built: same names)
            else:
                self.rotary = Qwen3_5TextRotaryEmbedding(config=config)

        def forward(self, hidden_states, attention_mask, position_ids):
            if self.block_type == "linear_attention":
                return super().forward(hidden_states, position_embeddings=None, attention_mask=attention_mask)
            _, mask, spans = attention_inputs(attention_mask, hidden_states.dtype, self.self_attn.config._attn_implementation)
            cos_sin = self.rotary(hidden_states, position_ids)
            return super().forward(hidden_states, position_embeddings=cos_sin, attention_mask=mask, **spans)

    return DecoderBlock


def sample_spans(segments: list) -> list:
    """[(start, end)] of each sample (a run of one segment id > 0) of a packed row."""
    out, start = [], None
    for t, s in enumerate(segments + [0]):
        if start is not None and (s != segments[start] or s == 0):
            out.append((start, t))
            start = None
        if start is None and s > 0:
            start = t
    return out
