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

import torch
from torch import nn

from mmpipe.families.towers.common import causal_padding_mask


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


class TokenEmbed(nn.Module):
    """The LM's token embedding; image features replace the image-token positions (in order)."""

    def __init__(self, vocab: int, width: int, pad_id, image_token_id: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width, pad_id)
        self.image_token_id = image_token_id

    def forward(self, input_ids, image_features=None):
        h = self.embed_tokens(input_ids)
        if image_features is None:  # (an empty tensor still merges: a pipeline stage sends its gradient back)
            return h
        where = (input_ids == self.image_token_id).unsqueeze(-1)
        feats = image_features.reshape(-1, h.shape[-1]).to(h.dtype)
        if not where.is_meta and int(where.sum()) != feats.shape[0]:  # (meta: shapes only, for planning)
            raise ValueError(f"{int(where.sum())} image tokens but {feats.shape[0]} image features")
        return h.masked_scatter(where, feats)


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
            pos, mask = attention_inputs(attention_mask, hidden_states.dtype)
            cos_sin = self.rotary(hidden_states, pos)
            out = super().forward(hidden_states, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
            return out[0] if isinstance(out, tuple) else out

    return DecoderBlock


def mask_kind(attention_mask: torch.Tensor) -> str:
    """``causal``: every row is its tokens then padding (right padding, or none) - causal attention
    alone gives every real token exactly what a padding mask would; ``packed``: segment ids (1, 2,
    ... per sample of a packed row, 0 = padding); ``dense``: anything else (left padding). Decided
    once per mask tensor (one host read), remembered on it."""
    cached = getattr(attention_mask, "_mmpipe_kind", None)
    if cached is not None and cached[0] == attention_mask._version:  # (an in-place change decides again)
        return cached[1]
    m = attention_mask
    if m.is_meta:  # shapes only: the batch that made it says (example_batch), else causal
        kind = "causal"
    elif bool((m > 1).any()):
        kind = "packed"
    else:
        kind = "dense" if bool((m[:, 1:] > m[:, :-1]).any()) else "causal"
    mark_mask(attention_mask, kind)
    return kind


def mark_mask(attention_mask: torch.Tensor, kind: str) -> None:
    """Record ``kind`` on the mask (``mask_kind``); a meta mask has no values to read it from."""
    try:
        attention_mask._mmpipe_kind = (attention_mask._version, kind)
    except AttributeError:  # pragma: no cover - a tensor type without attributes
        pass


def segment_positions(segments: torch.Tensor) -> torch.Tensor:
    """Position ids restarting at 0 at each sample of a packed row (segment ids, 0 = padding)."""
    T = segments.shape[1]
    idx = torch.arange(T, device=segments.device).expand_as(segments)
    start = torch.ones_like(segments, dtype=torch.bool)
    start[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return idx - torch.where(start, idx, torch.zeros_like(idx)).cummax(1).values


def packed_mask(segments: torch.Tensor) -> torch.Tensor:
    """(B,1,T,T) boolean: causal within a sample, nothing across samples (block-diagonal); a
    padding position sees itself only (no empty row: sdpa would return NaN there)."""
    T = segments.shape[1]
    allowed = segments[:, :, None] == segments[:, None, :]  # the one (B,T,T) tensor; the rest in place
    allowed &= torch.ones(T, T, dtype=torch.bool, device=segments.device).tril_()
    allowed &= (segments > 0)[:, None, :]
    allowed.diagonal(dim1=1, dim2=2).logical_or_(segments == 0)
    return allowed[:, None]


def attention_inputs(attention_mask: torch.Tensor, dtype: torch.dtype) -> tuple:
    """(position ids, the mask handed to transformers' attention): no mask at all for rows of
    tokens then padding (sdpa's causal kernel: no (B,1,T,T) tensor, the fused paths stay open),
    a block-diagonal one for packed rows (positions restart per sample), the additive
    causal+padding mask otherwise."""
    kind = mask_kind(attention_mask)
    if kind == "packed":
        return segment_positions(attention_mask), packed_mask(attention_mask)
    pos = torch.arange(attention_mask.shape[1], device=attention_mask.device).unsqueeze(0)
    if kind == "causal":
        return pos, None
    return pos, causal_padding_mask(attention_mask, dtype)


class LmHead(nn.Module):
    def __init__(self, norm: nn.Module, width: int, vocab: int):
        super().__init__()
        self.norm = norm
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, hidden):
        return self.lm_head(self.norm(hidden))


def shifted(labels: torch.Tensor) -> torch.Tensor:
    """The next-token targets: position t predicts labels[t + 1] (the last position: none)."""
    return nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()


def label_tokens(labels: torch.Tensor) -> int:
    """How many tokens a micro-batch's loss is over."""
    return int((shifted(labels) != -100).sum())


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, normaliser=None) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss``: the mean over label tokens (-100 ignored); with
    ``normaliser`` (a tensor), the sum over label tokens divided by it, as transformers does with
    ``num_items_in_batch``: the trainer passes the global batch's label-token count / (micro-batches
    x data-parallel ranks), so that DeepSpeed's mean over micro-batches and ranks is the token mean."""
    logits = logits.float()
    target = shifted(labels).reshape(-1).to(logits.device)
    flat = logits.reshape(-1, logits.shape[-1])
    if normaliser is None:
        return nn.functional.cross_entropy(flat, target, ignore_index=-100, reduction="mean")
    total = nn.functional.cross_entropy(flat, target, ignore_index=-100, reduction="sum")
    return total / normaliser.to(total.device, total.dtype).reshape(())


def token_stats(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[summed loss, label tokens, correctly predicted tokens] of a micro-batch (evaluation)."""
    target = shifted(labels).to(logits.device)
    keep = target != -100
    loss = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1),
                                       ignore_index=-100, reduction="sum")
    right = ((logits.argmax(-1) == target) & keep).sum()
    return torch.stack([loss.double(), keep.sum().double(), right.double()])


# ---- layer steps ---------------------------------------------------------------------------------
def vision_embed_step(part, acts):
    pixels, ids, mask = acts
    return (part(pixels) if pixels is not None else None), ids, mask


def _through(part, h):
    """``h`` (holding no images) passed on, with a zero-weight path through ``part`` run on one zero
    row: every layout gives its parameters a zero gradient (not none) for a micro-batch without
    images, the tensor a pipeline stage sends keeps a gradient of its own, and under ZeRO-3 every
    data-parallel rank runs the block's forward (its parameter gathers) whether its micro-batch
    holds images or not (DeepSpeed #7170: ranks on different paths hang)."""
    out = part(h.new_zeros((1,) + tuple(h.shape[1:])))
    return h + out.sum() * 0.0


def vision_block_step(part, acts):
    h, ids, mask = acts
    if h is None:
        return None, ids, mask
    return (part(h) if h.shape[0] else _through(part, h)), ids, mask


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
