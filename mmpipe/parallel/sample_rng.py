"""Dropout keyed on the sample, not on the micro-batch it sits in.

A mask drawn for a whole micro-batch in one call depends on which samples share it and where: regroup
the step's samples (``data.balance: cost``), pack them, or pad them to another length, and every
sample gets another sample's mask. Here each sample draws its own: a micro-batch carries two integer
tensors naming its samples (``mmpipe.data.sample_keys``, made by the collate on the host), and while a layer runs
in training, ``KeyedDropout`` (a torch function mode) replaces ``F.dropout`` and SDPA's ``dropout_p``
by masks drawn per sample from ``(seed, step, layer, call, sample key)``: the same numbers whatever the
micro-batch, its padding, the packing, the rank or the stage.

- ``row_keys`` (rows, segments, 2): per row, its samples in order as (key, tokens); a row of one
  sample holds one segment, a packed row several; unused segments are (-1, 0). A tensor whose first
  dimension is the rows (hidden states ``(rows, T, ...)``, a LoRA input, attention probabilities
  ``(rows, heads, T, T)``) draws each sample's block from its key, at the sample's own shape: its
  real tokens only, so padding never shifts a mask. Padding positions are left undropped (nothing
  real reads them: causal and padding masks keep them out of every real token).
- ``image_keys`` (images, 2): per image (key, patches): ``patches`` -1 for a tower that takes one row
  per image (``(images, ...)``), else its patch count for a tower that takes every image's patches in
  one flat sequence (``(patches, ...)``; Qwen-VL's ViT, whose merger divides it by a constant).

Which of the two a layer uses is its segment's ``cost_driver`` (``vision``: the images; ``tokens``: the
rows). A dropout this cannot map to samples (another shape) draws from the micro-batch's slot, as
before (``Replay``), and is named once. The mode reads the keys on the host (one read of a small
integer tensor per micro-batch and stage where they arrive on a device); a stochastic model only.
"""
from __future__ import annotations

import hashlib
import math
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ROW_KEYS, IMAGE_KEYS = "row_keys", "image_keys"
KEY_FIELDS = (ROW_KEYS, IMAGE_KEYS)
_MASK63 = (1 << 63) - 1


def mix(*parts: int) -> int:
    """63-bit seed of integers (deterministic, process-independent)."""
    h = hashlib.blake2b(b"/".join(str(int(p)).encode() for p in parts), digest_size=8).digest()
    return int.from_bytes(h, "little") & _MASK63


class Layout:
    """The host lists of a micro-batch's key tensors (read once per tensor: memoised on it)."""

    def __init__(self, row_keys: torch.Tensor, image_keys: torch.Tensor):
        self.rows = _host(row_keys, lambda v: [[(k, n) for k, n in r if k >= 0] for r in v])
        self.images = _host(image_keys, lambda v: [(k, n) for k, n in v])


def _host(t: torch.Tensor, parse):
    memo = getattr(t, "_mmpipe_keys", None)
    if memo is None:
        memo = parse(t.tolist())
        try:
            t._mmpipe_keys = memo
        except AttributeError:  # pragma: no cover
            pass
    return memo


_UNMAPPED: set = set()


class KeyedDropout(TorchFunctionMode):
    """``F.dropout`` and SDPA's ``dropout_p`` drawn per sample while a layer runs (module docstring).
    ``base``: the (seed, step, layer) seed; ``axis``: ``vision`` (image keys) or ``tokens`` (row keys)."""

    def __init__(self, base: int, layout: Layout, axis: str, layer: str = ""):
        super().__init__()
        self.base, self.layout, self.axis, self.layer, self.calls = base, layout, axis, layer, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            return self._dropout(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            if p > 0:
                return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    def _dropout(self, input, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return input
        mask = self.mask(input, p)
        if mask is None:
            return F.dropout(input, p, training, inplace)
        return input.mul_(mask) if inplace else input * mask

    def _attention(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        """Attention as torch's math reference computes it, its probabilities dropped out per sample."""
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        w = (q * scale) @ k.transpose(-2, -1)
        L, S = q.shape[-2], k.shape[-2]
        if is_causal:
            w = w.masked_fill(~torch.ones(L, S, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        if attn_mask is not None:
            w = w.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else w + attn_mask
        w = torch.softmax(w.float(), dim=-1).to(q.dtype)
        return self._dropout(w, dropout_p) @ v

    def mask(self, x: torch.Tensor, p: float) -> Optional[torch.Tensor]:
        """The scaled keep-mask of ``x`` (1 where nothing is drawn), or None where ``x`` does not map."""
        call = self.calls
        self.calls += 1
        blocks = self._blocks(x)
        if blocks is None:
            key = (self.layer, self.axis, x.dim())
            if key not in _UNMAPPED:
                _UNMAPPED.add(key)
                warnings.warn(f"dropout on a {tuple(x.shape)} tensor in layer {self.layer} does not map to the "
                              "micro-batch's samples: its masks follow the micro-batch (data.balance: cost regroups "
                              "them)")
            return None
        mask = torch.ones_like(x)
        for where, shape, key in blocks:
            g = torch.Generator(device=x.device)
            g.manual_seed(mix(self.base, call, key))
            mask[where] = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p, generator=g) / (1 - p)
        return mask

    def _blocks(self, x: torch.Tensor) -> Optional[list]:
        """[(index into x, block shape, sample key)], or None."""
        if self.axis == "vision":
            return self._image_blocks(x)
        rows = self.layout.rows
        if x.dim() < 2 or x.shape[0] != len(rows):
            return None
        out = []
        square = x.dim() == 4 and x.shape[2] == x.shape[3]  # attention probabilities: (rows, heads, T, T)
        for r, segs in enumerate(rows):
            start = 0
            for k, n in segs:
                if x.dim() == 2:  # a row's pooled features: one sample per row
                    if len(segs) != 1:
                        return None
                    out.append(((r,), tuple(x.shape[1:]), k))
                    continue
                if start + n > (x.shape[2] if square else x.shape[1]):
                    return None
                span = slice(start, start + n)
                if square:
                    out.append(((r, slice(None), span, span), (x.shape[1], n, n), k))
                else:
                    out.append(((r, span), (n,) + tuple(x.shape[2:]), k))
                start += n
        return out

    def _image_blocks(self, x: torch.Tensor) -> Optional[list]:
        images = self.layout.images
        if not images or x.dim() < 1:
            return None
        if all(n < 0 for _, n in images):  # one row per image
            if x.shape[0] != len(images):
                return None
            return [((i,), tuple(x.shape[1:]), k) for i, (k, _) in enumerate(images)]
        total = sum(n for _, n in images)
        if total <= 0 or (total % x.shape[0] and x.shape[0] % total):
            return None
        out, start = [], 0
        for k, n in images:  # a flat sequence of every image's patches (or a constant multiple / divisor)
            m = n * x.shape[0] // total
            if m * total != n * x.shape[0]:
                return None
            out.append(((slice(start, start + m),), (m,) + tuple(x.shape[1:]), k))
            start += m
        return out
