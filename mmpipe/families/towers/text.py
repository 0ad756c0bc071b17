"""Text towers, as named parts: ``embed`` -> ``blocks.0..N-1`` -> ``head`` (pooled features).

``clip_text``: transformers' CLIP text transformer (causal, EOS pooling; names match
``CLIPTextModel``). ``bert``: transformers' BERT encoder (bidirectional, mean or CLS pooling;
names match ``BertModel``). Blocks take the (B,T) 0/1 attention mask and build their additive
mask themselves, so only integer ids and masks travel between pipeline stages.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from mmpipe.errors import ConfigError, one_line
from mmpipe.families.products import BERT_BLOCK, CLIP_BLOCK, Matmul, block_products
from mmpipe.families.towers import hf
from mmpipe.families.towers.common import (
    causal_padding_mask,
    init_transformer_part,
    padding_mask,
    use_attention,
)

_HF_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
              "max_position_embeddings")


def pool(hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, how: str,
         eos_token_id: Optional[int]) -> torch.Tensor:
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    if how == "eos":
        if eos_token_id is None:  # transformers' legacy rule (config eos_token_id 2): highest id = EOT
            idx = input_ids.to(torch.int).argmax(dim=-1)
        else:
            idx = (input_ids.to(torch.int) == eos_token_id).int().argmax(dim=-1)
        return hidden[rows, idx]
    if how == "cls":
        return hidden[:, 0]
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)


class TokenEmbed(nn.Module):
    def __init__(self, embeddings: nn.Module):
        super().__init__()
        self.embeddings = embeddings

    def forward(self, input_ids):
        return self.embeddings(input_ids=input_ids)


class TextHead(nn.Module):
    """Pooled features: optional final layer norm (CLIP), then EOS / CLS / mean pooling, or BERT's
    own pooler (``pooler``: dense + tanh over [CLS], ``BertModel``'s ``pooler_output``)."""

    def __init__(self, how: str, eos_token_id: Optional[int], final_layer_norm: Optional[nn.Module],
                 pooler: Optional[nn.Module] = None):
        super().__init__()
        self.how, self.eos_token_id = how, eos_token_id
        if final_layer_norm is not None:
            self.final_layer_norm = final_layer_norm
        if pooler is not None:
            self.pooler = pooler

    def forward(self, hidden, input_ids, attention_mask):
        if hasattr(self, "final_layer_norm"):
            hidden = self.final_layer_norm(hidden)
        if self.how == "pooler":
            return self.pooler(hidden)
        return pool(hidden, input_ids, attention_mask, self.how, self.eos_token_id)


def _block_cls(arch: str):
    if arch == "clip_text":
        from transformers.models.clip.modeling_clip import CLIPEncoderLayer

        class ClipTextBlock(CLIPEncoderLayer):
            def forward(self, hidden_states, attention_mask):
                return super().forward(hidden_states, causal_padding_mask(attention_mask, hidden_states.dtype))

        return ClipTextBlock
    from transformers.models.bert.modeling_bert import BertLayer

    class BertBlock(BertLayer):
        def forward(self, hidden_states, attention_mask):
            return super().forward(hidden_states, padding_mask(attention_mask, hidden_states.dtype))

    return BertBlock


class TextSpec:
    """Resolved text-tower definition: parts, builders, weight source."""

    def __init__(self, cfg, clip_pretrained: Optional[str] = None, eos_token_id: Optional[int] = None,
                 pad_token_id: Optional[int] = None):
        self.cfg = cfg
        self.arch = cfg.arch
        self.weights_dir = cfg.pretrained or (clip_pretrained if cfg.arch == "clip_text" else None)
        key = "model.text.pretrained" if cfg.pretrained else "model.pretrained"
        set_fields = {f: getattr(cfg, f) for f in _HF_FIELDS if getattr(cfg, f) is not None}
        if self.weights_dir:
            c = hf.load_hf_config(self.weights_dir, key)
            c = getattr(c, "text_config", c)
            hf.check_fields_agree(cfg, list(set_fields), c, "model.text", key)
        else:
            if cfg.arch == "clip_text":
                from transformers import CLIPTextConfig as C
            else:
                from transformers import BertConfig as C
            if "vocab_size" not in set_fields:
                raise ConfigError("model.text.vocab_size is unset and no tokenizer fixed it: set data.tokenizer, "
                                  "model.text.vocab_size or model.text.pretrained")
            extra = {}
            if eos_token_id is not None and cfg.arch == "clip_text":
                extra = {"eos_token_id": eos_token_id, "bos_token_id": None}
            if pad_token_id is not None:
                extra["pad_token_id"] = pad_token_id
            try:
                c = C(**set_fields, **extra)
            except Exception as e:  # noqa: BLE001
                raise ConfigError(f"model.text: {one_line(e, last=True)}") from None
        if cfg.dropout is not None:
            names = ("attention_dropout",) if cfg.arch == "clip_text" else ("hidden_dropout_prob",
                                                                          "attention_probs_dropout_prob")
            for name in names:
                setattr(c, name, float(cfg.dropout))
        use_attention(c)
        self.hf_config = c
        self.num_blocks = c.num_hidden_layers
        self.width = c.hidden_size
        self.max_length = c.max_position_embeddings
        how = cfg.pooling
        if how == "pooler" and cfg.arch != "bert":
            raise ConfigError(f"model.text.pooling=pooler is BERT's pooler (dense + tanh over [CLS]); "
                              f"model.text.arch={cfg.arch} has none: use eos, cls or mean")
        if how == "auto":
            how = "eos" if cfg.arch == "clip_text" else "mean"
        self.pooling = how
        # pooling reads the EOS of the tokenizer actually used (model.text.eos_token_id, filled from
        # the run's tokenizer); without one, the weights' config decides as in transformers, whose
        # legacy eos_token_id 2 means "the highest id is the EOS" (argmax)
        eos = cfg.eos_token_id if cfg.eos_token_id is not None else getattr(c, "eos_token_id", None)
        self.eos_token_id = None if cfg.eos_token_id is None and eos == 2 else eos
        self.rules = hf.CLIP_TEXT_RULES if cfg.arch == "clip_text" else hf.BERT_RULES
        self._weights = None

    def part_names(self) -> list[str]:
        return ["embed"] + [f"blocks.{i}" for i in range(self.num_blocks)] + ["head"]

    def build_part(self, name: str) -> nn.Module:
        c = self.hf_config
        if name == "embed":
            if self.arch == "clip_text":
                from transformers.models.clip.modeling_clip import (
                    CLIPTextEmbeddings as E,
                )
            else:
                from transformers.models.bert.modeling_bert import BertEmbeddings as E
            m = TokenEmbed(E(c))
        elif name == "head":
            ln = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps) if self.arch == "clip_text" else None
            pooler = None
            if self.pooling == "pooler":
                from transformers.models.bert.modeling_bert import BertPooler
                pooler = BertPooler(c)
            m = TextHead(self.pooling, self.eos_token_id, ln, pooler)
        else:
            m = _block_cls(self.arch)(c)
        init_transformer_part(m)
        return m

    def matmuls(self, part: str, rows: int, seq: int) -> list:
        """The products of ``part`` on ``rows`` captions padded to ``seq`` tokens (``Family.matmuls``):
        the embedding is a lookup, the head a norm and a pooling (BERT's pooler: one dense over [CLS])."""
        c = self.hf_config
        if part == "embed":
            return []
        if part == "head":
            return [Matmul(rows, c.hidden_size, c.hidden_size, "pooler.dense", 0)] if self.pooling == "pooler" else []
        bert = self.arch == "bert"
        return block_products(rows * seq, rows, seq, BERT_BLOCK if bert else CLIP_BLOCK, c.hidden_size,
                              c.intermediate_size, c.num_attention_heads, post_norm=bert)

    def weight_source(self):
        if self.weights_dir and self._weights is None:
            self._weights = hf.WeightSource(self.weights_dir, "model.text.pretrained" if self.cfg.pretrained
                                            else "model.pretrained")
        return self._weights
