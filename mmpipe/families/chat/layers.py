"""Layers every chat family's decoder shares: the token embedding that takes the image features,
the LM head, and ``through`` (a tower block given no images still runs, on one zero row)."""
from __future__ import annotations

from torch import nn


class TokenEmbed(nn.Module):
    """The LM's token embedding; image features replace the image-token positions (and a video family's video
    tokens: ``video_token_id``), in order."""

    def __init__(self, vocab: int, width: int, pad_id, image_token_id: int, video_token_id=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width, pad_id)
        self.image_token_id, self.video_token_id = image_token_id, video_token_id

    def forward(self, input_ids, image_features=None):
        h = self.embed_tokens(input_ids)
        if image_features is None:  # (an empty tensor still merges: a pipeline stage sends its gradient back)
            return h
        where = input_ids == self.image_token_id
        if self.video_token_id is not None:
            where = where | (input_ids == self.video_token_id)
        where = where.unsqueeze(-1)
        feats = image_features.reshape(-1, h.shape[-1]).to(h.dtype)
        if not where.is_meta and int(where.sum()) != feats.shape[0]:  # (meta: shapes only, for planning)
            raise ValueError(f"{int(where.sum())} image tokens but {feats.shape[0]} image features")
        return h.masked_scatter(where, feats)


class LmHead(nn.Module):
    def __init__(self, norm: nn.Module, width: int, vocab: int):
        super().__init__()
        self.norm = norm
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, hidden):
        return self.lm_head(self.norm(hidden))


def through(part, h):
    """``h`` (holding no images) passed on, with a zero-weight path through ``part`` run on one zero
    row: every layout gives its parameters a zero gradient (not none) for a micro-batch without
    images, the tensor a pipeline stage sends keeps a gradient of its own, and under ZeRO-3 every
    data-parallel rank runs the block's forward (its parameter gathers) whether its micro-batch
    holds images or not (DeepSpeed #7170: ranks on different paths hang)."""
    out = part(h.new_zeros((1,) + tuple(h.shape[1:])))
    return h + out.sum() * 0.0
