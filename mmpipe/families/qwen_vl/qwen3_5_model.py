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

from functools import lru_cache

from mmpipe.errors import ConfigError
from mmpipe.families.chat.masks import attention_inputs, mask_kind, sample_spans
from mmpipe.families.qwen_vl import products
from mmpipe.families.qwen_vl.hf_config import check_mrope
from mmpipe.families.qwen_vl.qwen3_vision import vision_classes  # noqa: F401 - this family's ViT (``model_parts``)


def decoder_block_cls():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q
    return hybrid_block_cls(q.Qwen3_5DecoderLayer, q.Qwen3_5GatedDeltaNet, q.Qwen3_5TextRotaryEmbedding)


@lru_cache(maxsize=None)
def hybrid_block_cls(layer_cls, delta_net_cls, rotary_cls):
    """transformers' hybrid decoder layer ``layer_cls`` (Qwen3.5's, Qwen3.5-MoE's) as a pipeline block, its
    GatedDeltaNet (``delta_net_cls``) keeping a packed row's samples apart, its full attention with the interleaved
    M-RoPE table of ``rotary_cls``."""

    class SampleWiseGatedDeltaNet(delta_net_cls):
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

    class DecoderBlock(layer_cls):
        """transformers' hybrid decoder layer with its interleaved M-RoPE table (non-persistent); positions
        come with the batch, the mask kind from ``attention_inputs``; a linear-attention layer keeps a packed
        row's samples apart (``SampleWiseGatedDeltaNet``)."""

        def __init__(self, config, layer_idx: int):
            super().__init__(config, layer_idx)
            if self.block_type == "linear_attention":
                self.linear_attn.__class__ = SampleWiseGatedDeltaNet  # (its parameters as built: same names)
            else:
                self.rotary = rotary_cls(config=config)

        def forward(self, hidden_states, attention_mask, position_ids):
            if self.block_type == "linear_attention":
                return super().forward(hidden_states, position_embeddings=None, attention_mask=attention_mask)
            _, mask, spans = attention_inputs(attention_mask, hidden_states.dtype, self.self_attn.config._attn_implementation)
            cos_sin = self.rotary(hidden_states, position_ids)
            return super().forward(hidden_states, position_embeddings=cos_sin, attention_mask=mask, **spans)

    return DecoderBlock


class HybridDecoder:
    """What a family on Qwen3.5's hybrid decoder declares (listed before its base): each block's kind, the runs a
    packed row makes through a linear-attention block, the decoder's products."""

    def layer_kind(self, name: str) -> str:
        """A decoder block's kind (``linear_attention`` | ``full_attention``, from ``layer_types``); other layers:
        their segment."""
        if name.startswith("llm.blocks."):
            return self.text_cfg.layer_types[int(name.rsplit(".", 1)[1])]
        return self.layer(name).segment

    def micro_batch(self, batch: dict):
        return products.recurrent_shape(batch, super().micro_batch(batch))

    def matmuls(self, name: str, mb) -> list:
        return products.qwen3_5_matmuls(self, name, mb)


def check_hybrid_text(t) -> None:
    """One line for a decoder transformers would build wrong or fail on."""
    check_mrope(t, [11, 11, 10], default_factor=0.25)
    if t.linear_num_value_heads % t.linear_num_key_heads:
        raise ConfigError(f"model.llm.linear_num_value_heads={t.linear_num_value_heads} is not a multiple of "
                          f"linear_num_key_heads={t.linear_num_key_heads}")
    bad = [x for x in t.layer_types if x not in ("linear_attention", "full_attention")]
    if bad or len(t.layer_types) != t.num_hidden_layers:
        raise ConfigError(f"model.llm.layer_types: give {t.num_hidden_layers} entries, each linear_attention or "
                          f"full_attention (got {len(t.layer_types)}{', e.g. ' + repr(bad[0]) if bad else ''})")
