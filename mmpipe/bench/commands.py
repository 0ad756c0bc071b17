"""``mmpipe bench ...``: measured comparisons, printed as a table and written to BENCHMARKS.md (the
latest of each bench; every run in docs/benchmarks/history.md) with the exact command, the machine,
and ratios against a baseline measured in the same run.

    mmpipe bench groups    # grouped clipping cost and frozen-tower memory, P = 2 demo model
    mmpipe bench data      # images/s: naive loading vs mmpipe's direct path vs its preprocessed cache
    mmpipe bench balance   # samples/s of every stage placement vs the single-process baseline
    mmpipe bench strategies  # every layout at 1, 2, 4 ranks: measured beside the layout cost model
    mmpipe bench memory      # predicted vs measured memory per stage (P = 2, 3; checkpointing on and off)
    mmpipe bench local-loss  # the global contrastive loss: each rank its own rows vs the whole B x B (DP = 2)
    mmpipe bench negatives   # CLIP's global-batch negatives vs per-micro-batch: step time measured and predicted
    mmpipe bench peers --family clip  # the same CLIP job by open_clip_train and by mmpipe: samples/s, recall
    mmpipe bench packing     # VLM samples/s with sequence packing vs padding per micro-batch (length-skewed chat)
    mmpipe bench overhead    # mmpipe's step vs a raw DeepSpeed engine on the same module (P = 1, P = 2, DP = 2)
    mmpipe bench schedule    # pipeline schedules side by side (1f1b vs frozen_first, frozen vision tower)
    mmpipe bench gpu         # real sizes on one GPU: samples/s, MFU, memory vs open_clip_train and the Trainer
    mmpipe bench gpu --pipeline  # P = 2 vs P = 1 on the devices present: losses, every gradient, memory per stage
    mmpipe bench attention   # packed rows' attention kernels (mask, spans, torch varlen, flash-attn, flex): fwd + bwd
"""
from __future__ import annotations

import os

from mmpipe.bench.attention import add_arguments as add_attention
from mmpipe.bench.balance import bench_balance
from mmpipe.bench.common import ROOT
from mmpipe.bench.data import bench_data
from mmpipe.bench.gpu import add_arguments as add_gpu
from mmpipe.bench.groups import bench_groups
from mmpipe.bench.local_loss import add_arguments as add_local_loss
from mmpipe.bench.memory import add_arguments as add_memory
from mmpipe.bench.negatives import add_arguments as add_negatives
from mmpipe.bench.overhead import add_arguments as add_overhead
from mmpipe.bench.packing import add_arguments as add_packing
from mmpipe.bench.peers import add_arguments as add_peers
from mmpipe.bench.schedule import add_arguments as add_schedule
from mmpipe.bench.strategies import bench_strategies
from mmpipe.config.registry import BUILTIN


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks: print a table and append it to BENCHMARKS.md")
    bs = b.add_subparsers(dest="bench_cmd", required=True)
    g = bs.add_parser("groups", help="grouped clipping cost and frozen-tower memory (P = 2)")
    g.add_argument("--config", default=os.path.join(ROOT, "configs", "demo.yaml"))
    g.add_argument("--steps", type=int, default=40)
    g.add_argument("--warmup", type=int, default=5)
    g.add_argument("--nproc", type=int, default=2)
    g.add_argument("--no-append", action="store_true", help="print only; do not write BENCHMARKS.md")
    g.set_defaults(func=bench_groups)
    d = bs.add_parser("data", help="image/text loading: naive path vs mmpipe's direct and cache paths")
    d.add_argument("--n", type=int, default=320)
    d.add_argument("--width", type=int, default=640)
    d.add_argument("--height", type=int, default=480)
    d.add_argument("--workers", type=int, default=2)
    d.add_argument("--repeats", type=int, default=2)
    d.add_argument("--no-append", action="store_true")
    d.set_defaults(func=bench_data)
    st = bs.add_parser("strategies", help="every layout (DP + ZeRO 0-3, PP, PP x DP) at 1, 2 and 4 ranks: "
                       "measured beside the cost model's prediction")
    st.add_argument("--config", default=os.path.join(ROOT, "configs", "bench_image_heavy.yaml"))
    st.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    st.add_argument("--steps", type=int, default=8)
    st.add_argument("--warmup", type=int, default=3)
    st.add_argument("--n", type=int, default=400, help="synthetic training pairs")
    st.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; steps pooled, median kept")
    st.add_argument("--refresh", action="store_true", help="profile and time the collectives again")
    st.add_argument("--no-append", action="store_true")
    st.set_defaults(func=bench_strategies)
    bb = bs.add_parser("balance", help="samples/s of every stage placement vs the single-process baseline")
    bb.add_argument("--steps", type=int, default=8)
    bb.add_argument("--warmup", type=int, default=2)
    bb.add_argument("--n", type=int, default=400, help="synthetic training pairs")
    bb.add_argument("--no-frozen", action="store_true", help="skip the frozen-vision variant")
    bb.add_argument("--model", choices=tuple(BUILTIN), default="clip",
                    help="clip: image- and text-heavy dual encoders; qwen2_5_vl: native resolution, mixed image "
                         "sizes; vlm: an image-heavy LLaVA-style VLM")
    bb.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; steps pooled, median kept")
    bb.add_argument("--mix", choices=("skewed",), default=None,
                    help="skewed: the VLM on a skewed chat mix, data.balance none vs cost at P = 2, DP = 2 and P2 x DP2")
    bb.add_argument("--no-append", action="store_true")
    bb.set_defaults(func=bench_balance)
    add_schedule(bs.add_parser("schedule", help="pipeline schedules side by side: 1f1b vs frozen_first on the VLM with a "
                               "frozen vision tower, measured and predicted (P = 2, 3)"))
    add_memory(bs.add_parser("memory", help="every stage's predicted peak memory beside the live count of a real run "
                             "(CLIP and VLM, P = 2 and 3, with and without activation checkpointing)"))
    add_negatives(bs.add_parser("negatives", help="CLIP's global-batch negatives vs per-micro-batch: measured and "
                                "predicted step time (P = 2, vision trained and frozen)"))
    add_local_loss(bs.add_parser("local-loss", help="the global contrastive loss, each data-parallel rank its own rows "
                                 "vs the whole B x B: step time at P = 1 and DP = 2, the loss's time and peak memory "
                                 "per rank beside the memory model"))
    add_packing(bs.add_parser("packing", help="VLM samples/s with data.packing vs padding per micro-batch, on a "
                              "length-skewed chat set (P = 2)"))
    add_peers(bs.add_parser("peers", help="the same job by a peer (open_clip_train) and by mmpipe's chosen layout: "
                            "samples/s and retrieval recall"))
    add_gpu(bs.add_parser("gpu", help="real model sizes on one accelerator (CLIP ViT-B/16, LLaVA-7B-shaped LoRA and "
                          "full): samples/s, MFU and peak memory beside open_clip_train and transformers' Trainer; --pipeline: "
                          "P = 2 against P = 1 on the devices present"))
    add_attention(bs.add_parser("attention", help="the attention kernels of packed rows (block-diagonal mask, one sdpa "
                                "per span, torch's varlen, flash-attn's, FlexAttention) at a job's shapes: forward + "
                                "backward time and their difference from the mask path"))
    add_overhead(bs.add_parser("overhead", help="mmpipe's step time vs a raw DeepSpeed engine on the same module and "
                               "micro-batches (P = 1, P = 2, DP = 2)"))
