"""The attention-mask kinds of chat batches (``attention_mask`` field): ``causal`` rows (tokens then
padding: no mask tensor at all, sdpa's causal kernel), ``packed`` rows (segment ids per sample:
block-diagonal attention, positions restarting per sample), ``dense`` otherwise (left padding).
Any decoder family reads its batch's mask through ``attention_inputs``."""
from __future__ import annotations

import torch

from mmpipe.families.towers.common import causal_padding_mask
from mmpipe.families.towers.varlen import VARLEN, spans_of


def mask_kind(attention_mask: torch.Tensor) -> str:
    """``causal``: every row is its tokens then padding (right padding, or none) - causal attention
    alone gives every real token exactly what a padding mask would; ``packed``: segment ids (1, 2,
    ... per sample of a packed row, 0 = padding); ``dense``: anything else (left padding). Decided
    once per mask tensor (one host read), remembered on it."""
    cached = getattr(attention_mask, "_mmpipe_kind", None)
    if cached is not None and cached[0] == attention_mask._version:  # (an in-place change decides again)
        return cached[1]
    # shapes only: the batch that made it says (example_batch), else causal
    kind = "causal" if attention_mask.is_meta else _kind_of(attention_mask)
    mark_mask(attention_mask, kind)
    return kind


def _kind_of(m: torch.Tensor) -> str:
    if bool((m > 1).any()):
        return "packed"
    return "dense" if bool((m[:, 1:] > m[:, :-1]).any()) else "causal"


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


def attention_inputs(attention_mask: torch.Tensor, dtype: torch.dtype, impl: str = None) -> tuple:
    """(position ids, the mask handed to transformers' attention, its keyword arguments): no mask at all for
    rows of tokens then padding (sdpa's causal kernel: no (B,1,T,T) tensor, the fused paths stay open), a
    block-diagonal one for packed rows (positions restart per sample), the additive causal+padding mask
    otherwise. ``impl`` (the layer's ``config._attn_implementation``) ``mmpipe_varlen``: a packed row goes by its
    span boundaries instead (``cu_seq_lens_q``, ``max_length_q``: ``towers.varlen``), no mask; derived once per
    micro-batch on each stage from the segment ids that cross it (one host read, as ``mask_kind``'s)."""
    if impl == VARLEN:
        spans = packed_spans(attention_mask)
        if spans is not None:
            return segment_positions(attention_mask), None, spans
    kind = mask_kind(attention_mask)
    if kind == "packed":
        return segment_positions(attention_mask), packed_mask(attention_mask), {}
    pos = torch.arange(attention_mask.shape[1], device=attention_mask.device).unsqueeze(0)
    if kind == "causal":
        return pos, None, {}
    return pos, causal_padding_mask(attention_mask, dtype), {}


def packed_spans(attention_mask: torch.Tensor):
    """A packed row batch's span boundaries as transformers' flash-attention keywords (``cu_seq_lens_q/k``,
    ``max_length_q/k``: ``towers.varlen``), None for rows that are not packed; one host read of the ids gives the
    mask kind and the spans, remembered on the tensor. A meta mask (the memory plan): no keywords, no mask."""
    if attention_mask.is_meta:
        return {} if mask_kind(attention_mask) == "packed" else None
    memo = getattr(attention_mask, "_mmpipe_spans", None)
    if memo is None or memo[0] != attention_mask._version:
        host = attention_mask.detach().to("cpu")
        mark_mask(attention_mask, _kind_of(host))
        cu, longest = spans_of(host)
        memo = (attention_mask._version, cu.to(attention_mask.device, non_blocking=True), longest)
        try:
            attention_mask._mmpipe_spans = memo
        except AttributeError:  # pragma: no cover
            pass
    if mask_kind(attention_mask) != "packed":
        return None
    _, cu, longest = memo
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


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
