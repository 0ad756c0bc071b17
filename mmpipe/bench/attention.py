"""``mmpipe bench attention``: the kernels a packed row's attention can take, timed forward + backward on the
device present at a job's shapes, each held to the mask path's outputs and gradients:

- ``mask``: sdpa with the block-diagonal boolean mask (``model.attention: sdpa``; the reference);
- ``spans``: one sdpa call per span (``model.attention: varlen`` off CUDA);
- ``torch_varlen``: torch's varlen flash kernel (``torch.nn.attention.varlen``; CUDA, bf16/fp16);
- ``flash_attn``: flash-attn's ``flash_attn_varlen_func`` (where the package is installed);
- ``flex``: FlexAttention with a document mask (compiled; its backward runs on CUDA only).

Rows are packed from sample lengths drawn as the chat jobs' are (``--lengths``), first-fit into ``--row`` tokens;
``--shape llava`` (32 heads of 128, LLaVA-1.5-7B's decoder), ``qwen`` (28 query and 4 key/value heads of 128,
Qwen2.5-VL-7B's), ``tiny`` (4 / 2 heads of 16: a CPU's size). ``model.attention: varlen`` takes the first of
``torch_varlen`` / ``flash_attn`` that runs; this bench says which is faster where it runs."""
from __future__ import annotations

import random
import shlex
import statistics
import sys
import time

import torch

from mmpipe.bench.common import append_benchmarks
from mmpipe.families.chat.masks import attention_inputs, packed_mask
from mmpipe.families.towers import varlen
from mmpipe.families.towers.varlen import VARLEN

SHAPES = {"llava": (32, 32, 128), "qwen": (28, 4, 128), "tiny": (4, 2, 16)}  # query heads, key/value heads, head dim
KERNELS = ("mask", "spans", "torch_varlen", "flash_attn", "flex")
_BLOCK_MASKS, _FLEX = {}, {}  # FlexAttention's document mask per segment tensor, its compiled kernel per device


def packed_rows(rows: int, row: int, lo: int, hi: int, seed: int = 0) -> torch.Tensor:
    """(rows, row) segment ids: samples of ``lo``..``hi`` tokens packed first-fit, the rest padding (0)."""
    rng = random.Random(seed)
    seg = torch.zeros(rows, row, dtype=torch.int64)
    for r in range(rows):
        t, k = 0, 1
        while True:
            n = rng.randint(lo, hi)
            if t + n > row:
                break
            seg[r, t:t + n] = k
            t, k = t + n, k + 1
    return seg


def _call(kernel: str, q, k, v, seg, spans):
    """(B, T, H, D) attention output of ``kernel`` on (B, H, T, D) inputs."""
    B, H, T, D = q.shape
    gqa = q.shape[1] != k.shape[1]
    if kernel == "mask":
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=packed_mask(seg), enable_gqa=gqa)
        return o.transpose(1, 2)
    if kernel == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        bm = _BLOCK_MASKS.get(id(seg))
        if bm is None:
            def doc(b, h, qi, ki):
                return (seg[b, qi] == seg[b, ki]) & (qi >= ki)
            bm = _BLOCK_MASKS[id(seg)] = create_block_mask(doc, B, None, T, T, device=q.device)
        if q.device.type not in _FLEX:
            _FLEX[q.device.type] = torch.compile(flex_attention) if q.is_cuda else flex_attention
        fn = _FLEX[q.device.type]
        return fn(q, k, v, block_mask=bm, enable_gqa=gqa).transpose(1, 2)
    flat = [t.transpose(1, 2).reshape(B * T, t.shape[1], D) for t in (q, k, v)]
    cu, longest = spans["cu_seq_lens_q"], spans["max_length_q"]
    if kernel == "spans":
        out = varlen.span_attention(*flat, cu, True)
    elif kernel == "torch_varlen":
        out = varlen._torch_varlen(*flat, cu.to(torch.int32), longest, True, None)
    else:
        out = varlen._flash_attn_varlen(*flat, cu.to(torch.int32), longest, True, None)
    return out.view(B, T, H, D)



def _available(kernel: str, device: torch.device, dtype) -> str:
    """'' when ``kernel`` can run forward and backward here, else why not."""
    if kernel in ("torch_varlen", "flash_attn", "flex") and device.type != "cuda":
        return f"CUDA only (here: {device.type})"
    if kernel in ("torch_varlen", "flash_attn") and dtype not in (torch.float16, torch.bfloat16):
        return "bf16 / fp16 only"
    if kernel == "flash_attn":
        import importlib.util
        if importlib.util.find_spec("flash_attn") is None:
            return "flash-attn not installed (pip install -e '.[flash]')"
    return ""


def measure(shape: str, rows: int, row: int, lengths: tuple, dtype, device, reps: int, kernels=KERNELS) -> list:
    from deepspeed.accelerator import get_accelerator

    Hq, Hk, D = SHAPES[shape]
    seg = packed_rows(rows, row, *lengths).to(device)
    _, _, spans = attention_inputs(seg, dtype, VARLEN)
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(rows, Hq, row, D, generator=g).to(device, dtype).requires_grad_()
    k, v = (torch.randn(rows, Hk, row, D, generator=g).to(device, dtype).requires_grad_() for _ in range(2))
    up = torch.randn(rows, row, Hq, D, generator=g).to(device, dtype)
    real = (seg > 0)[..., None, None]
    sync = get_accelerator().synchronize if device.type != "cpu" else (lambda: None)
    ref = None
    out = []
    for kernel in kernels:
        why = _available(kernel, device, dtype)
        if why:
            out.append({"kernel": kernel, "skipped": why})
            continue

        def step():
            for t in (q, k, v):
                t.grad = None
            o = _call(kernel, q, k, v, seg, spans)
            (o * up * real).sum().backward()
            return o

        try:
            o = step()
        except Exception as e:  # noqa: BLE001 - a kernel this build or device cannot run: said in the table
            out.append({"kernel": kernel, "skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"})
            continue
        got = [(o * real).detach().float()] + [t.grad.float() for t in (q, k, v)]
        if ref is None:
            ref = got
        err = max(float((a - b).abs().max() / max(float(b.abs().max()), 1e-12)) for a, b in zip(got, ref))
        times = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
        out.append({"kernel": kernel, "ms": 1e3 * statistics.median(times), "max_rel_err": err})
    base = next((r["ms"] for r in out if r["kernel"] == "mask" and "ms" in r), None)
    for r in out:
        if "ms" in r and base:
            r["speedup"] = base / r["ms"]
    return out


def bench_attention(args) -> int:
    from deepspeed.accelerator import get_accelerator
    device = torch.device(get_accelerator().device_name(0) if get_accelerator().device_name() != "cpu" else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    shape = "tiny" if device.type == "cpu" and args.shape != "tiny" and not args.force else args.shape
    res = measure(shape, args.rows, args.row, tuple(args.lengths), dtype, device, args.reps)
    seg = packed_rows(args.rows, args.row, *args.lengths)
    spans = [int((seg[r] == s).sum()) for r in range(seg.shape[0]) for s in range(1, int(seg[r].max()) + 1)]
    lines = ["| kernel | fwd + bwd ms | vs mask | max rel. error vs mask |", "|---|---|---|---|"]
    for r in res:
        if "skipped" in r:
            lines.append(f"| {r['kernel']} | - | - | not run: {r['skipped']} |")
        else:
            lines.append(f"| {r['kernel']} | {r['ms']:.2f} | {r.get('speedup', 1.0):.2f}x | {r['max_rel_err']:.1e} |")
    text = "\n".join(lines)
    print(text)
    Hq, Hk, D = SHAPES[shape]
    notes = (f"Device {device.type} ({torch.cuda.get_device_name(0) if device.type == 'cuda' else 'CPU'}), {args.dtype}; "
             f"shape {shape}: {Hq} query / {Hk} key-value heads of {D}; {args.rows} rows of {args.row} tokens holding "
             f"{len(spans)} samples of {min(spans)}-{max(spans)} tokens ({sum(spans) / seg.numel():.0%} of the slots); "
             f"median of {args.reps} after one warm-up. Error: the largest of output (real tokens) and q/k/v gradients, "
             "relative to the mask path's largest value.")
    if shape != args.shape:
        notes += f" (--shape {args.shape} asked; a CPU runs the tiny shape unless --force)"
    if not args.no_append:
        cmd = "mmpipe bench attention " + " ".join(shlex.quote(a) for a in sys.argv[3:])
        append_benchmarks("Attention kernels for packed rows", cmd, text, notes)
    return 0


def add_arguments(p) -> None:
    p.add_argument("--shape", choices=tuple(SHAPES), default="llava")
    p.add_argument("--rows", type=int, default=2, help="packed rows (a micro-batch)")
    p.add_argument("--row", type=int, default=2048, help="tokens per row (data.max_length)")
    p.add_argument("--lengths", type=int, nargs=2, default=[300, 1100], metavar=("LO", "HI"),
                   help="sample lengths drawn uniformly (tokens)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--force", action="store_true", help="the asked shape on a CPU too")
    p.add_argument("--no-append", action="store_true")
    p.set_defaults(func=bench_attention)
