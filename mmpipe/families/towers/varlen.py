"""``model.attention: varlen``: attention over spans given by their boundaries (``cu_seqlens``, ``max_seqlen``),
not through a dense mask: a packed row's samples (each causal, none seeing another) and a native-resolution
ViT's per-image / per-window spans.

One function, registered with transformers' ``AttentionInterface`` (so transformers' own attention modules
call it, with their projections, rotary tables and GQA as they are):

- with span boundaries (``cu_seq_lens_q`` / ``max_length_q``, transformers' flash-attention keyword names) the
  (B, H, T, D) query/key/value are flattened to tokens and attended span by span: on a CUDA device in bf16 /
  fp16 by torch's varlen flash kernel (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.9: no extra
  package), else by flash-attn's ``flash_attn_varlen_func`` when that is installed; elsewhere (the CPU, fp32)
  by one ``scaled_dot_product_attention`` call per span - the same arithmetic, the reference and the CPU path;
- without them (a row that is not packed, generation through transformers' model) it is transformers' sdpa,
  unchanged.

Two names for the one function: decoders take ``VARLEN``; the ViTs take ``VARLEN_SPANS``, whose name holds
"flash" because transformers' vision attention hands its ``cu_seqlens`` to the attention function whole only
for an implementation named so (otherwise it splits the spans itself and calls once per span)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

VARLEN = "mmpipe_varlen"
VARLEN_SPANS = "mmpipe_flash_varlen"

_KERNEL = {}  # device type -> the varlen kernel that ran there ("torch", "flash_attn") or "spans"


def _torch_varlen(q, k, v, cu, max_len, causal, scale):
    from torch.nn.attention.varlen import varlen_attn
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, window_size=(-1, 0) if causal else (-1, -1),
                       enable_gqa=q.shape[1] != k.shape[1])


def _flash_attn_varlen(q, k, v, cu, max_len, causal, scale):
    import importlib
    # optional: setup.py's [flash] extra (a CUDA build); ImportError where it is not installed
    fn = importlib.import_module("flash_attn").flash_attn_varlen_func
    return fn(q, k, v, cu, cu, max_len, max_len, softmax_scale=scale, causal=causal)


def span_attention(q, k, v, cu, causal: bool, scale=None):
    """The reference: one sdpa call per span of ``cu`` on (tokens, heads, dim) inputs."""
    lengths = cu.diff().tolist()
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
        o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
                                           is_causal=causal, scale=scale, enable_gqa=gqa)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


_KERNELS = {"torch": _torch_varlen, "flash_attn": _flash_attn_varlen}


def kernel_for(q: torch.Tensor) -> str:
    """Which kernel attends ``q``'s spans: on a CUDA device in bf16/fp16 the first of torch's varlen kernel and
    flash-attn's that runs there (tried once per device type), else ``spans``."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return "spans"
    return _KERNEL.get(q.device.type, "untried")


def varlen_tokens(q, k, v, cu, max_len: int, causal: bool, scale=None):
    """Attention of (tokens, heads, dim) ``q``/``k``/``v`` within each span of ``cu`` (int32 boundaries)."""
    kind = kernel_for(q)
    if kind != "spans":
        cu = cu.to(device=q.device, dtype=torch.int32)
        for name in ([kind] if kind in _KERNELS else list(_KERNELS)):
            try:
                out = _KERNELS[name](q, k, v, cu, max_len, causal, scale)
            except torch.OutOfMemoryError:
                raise
            except (ImportError, NotImplementedError, RuntimeError):  # not in this build / not for this GPU
                continue
            _KERNEL[q.device.type] = name
            return out
        _KERNEL[q.device.type] = "spans"
    return span_attention(q, k, v, cu, causal, scale)


def varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                     cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """transformers' attention-function signature: (B, H, T, D) in, (B, T, H, D) out."""
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if dropout:
        raise ValueError("model.attention=varlen: the varlen kernels take no attention dropout; set the model's "
                         "attention_dropout to 0 or use model.attention=sdpa")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    B, H, T, D = query.shape
    flat = [t.transpose(1, 2).reshape(B * T, t.shape[1], t.shape[-1]) for t in (query, key, value)]
    if max_length_q is None:
        max_length_q = int(cu_seq_lens_q.diff().max())
    out = varlen_tokens(*flat, cu_seq_lens_q, int(max_length_q), bool(causal), scaling)
    return out.view(B, T, H, out.shape[-1]), None


def register() -> None:
    """Make both names known to transformers (idempotent)."""
    from transformers import AttentionInterface
    for name in (VARLEN, VARLEN_SPANS):
        AttentionInterface.register(name, varlen_attention)


def spans_of(segments: torch.Tensor) -> tuple:
    """(cu_seqlens int32, the longest span) of a (B, T) segment-id row batch (packed rows: 1, 2, ... per sample,
    0 = padding) on the host, flattened row after row: a span is a run of one id within a row (a padding run too:
    it attends only to itself, as under the mask)."""
    flat = segments.detach().to("cpu", torch.int64).reshape(-1)
    T = segments.shape[1]
    start = torch.ones(flat.numel(), dtype=torch.bool)
    start[1:] = flat[1:] != flat[:-1]
    start[::T] = True
    cu = torch.cat([start.nonzero().flatten(), torch.tensor([flat.numel()])]).to(torch.int32)
    return cu, int(cu.diff().max())
