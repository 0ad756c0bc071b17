"""``mmpipe bench packing``: samples/s of a VLM run on a length-skewed chat set (half short text
questions, image questions with a short answer, some long text conversations) with ``data.packing`` against the same
samples padded per micro-batch, at P = 2 on 2 ranks; every sample's label tokens are learned in
both, so samples/s compares equal work. Also the padding fraction each run reports."""
from __future__ import annotations

import json
import os
import random
import shlex
import statistics
import sys

from mmpipe.bench.common import ROOT, append_benchmarks, launch, with_scratch
from mmpipe.data.synth import TEXT_QA, synth_vlm
from mmpipe.families.towers.common import causal_padding_mask, use_attention
from mmpipe.families.vlm import model as m
from mmpipe.parallel.live_bytes import LiveBytes
from mmpipe.train.metrics import read_metrics


def skewed_chat(out: str, n: int, long_fraction: float, seed: int = 0) -> str:
    """ms-swift JSONL with the spread of lengths real chat data has: half short text questions (one
    turn, ~12 tokens), image questions with a short answer (the image's tokens + ~12), and a
    ``long_fraction`` of text conversations of 12-20 turns (~150-250 tokens)."""
    info = synth_vlm(out, n, val_fraction=0.0, size=64, seed=seed, text_only=0.0, progress=False)
    rng = random.Random(seed)
    rows = [json.loads(line) for line in open(info["train"])]
    for i in range(len(rows)):
        r = rng.random()
        if r < long_fraction:
            msgs = []
            for _ in range(rng.randint(12, 20)):
                q, a = rng.choice(TEXT_QA)
                msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            rows[i] = {"messages": msgs}
        elif r < long_fraction + 0.5:
            q, a = rng.choice(TEXT_QA)
            rows[i] = {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        else:
            rows[i]["messages"] = rows[i]["messages"][:2]
    with open(info["train"], "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    return info["train"]


def attention_memory(seq: int = 2048, width: int = 256, heads: int = 4, batch: int = 2) -> list:
    """Peak bytes of one decoder block's forward + backward (live tensor count, ``LiveBytes``) at
    ``seq`` tokens, per way of masking: (name, peak bytes of the step, bytes of the mask tensor)."""
    import torch
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=width, intermediate_size=2 * width, num_attention_heads=heads,
                      num_key_value_heads=heads, max_position_embeddings=seq)
    use_attention(cfg)
    block = m.decoder_block_cls("llama")(cfg, 0)
    base = type(block).__mro__[1]
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, seq // 2:] = 0  # right padding
    packed = torch.ones(batch, seq, dtype=torch.long)
    packed[:, seq // 3:] = 2
    pos = torch.arange(seq)[None]
    out = []
    for name, run, mask_bytes in (
            ("dense additive mask (before)", lambda h: base.forward(
                block, h, attention_mask=causal_padding_mask(mask, h.dtype), position_ids=pos,
                position_embeddings=block.rotary(h, pos)), batch * seq * seq * 4),
            ("sdpa causal, no mask (right padding)", lambda h: block(h, mask), 0),
            ("block-diagonal bool mask (packed)", lambda h: block(h, packed), batch * seq * seq)):
        h = torch.randn(batch, seq, width, requires_grad=True)
        counter = LiveBytes()
        with counter:
            y = run(h)
            (y[0] if isinstance(y, tuple) else y).float().sum().backward()
        out.append((name, counter.peak, mask_bytes))
    return out


@with_scratch("packing")
def bench_packing(args, tmp: str) -> int:
    train = skewed_chat(os.path.join(tmp, "data"), args.n, args.long_fraction)
    common = [f"data.train={train}", "data.val=null", f"data.max_length={args.max_length}",
              "model.llm.max_position_embeddings=512", f"train.steps={args.steps}", "parallel.pipeline_stages=2",
              "parallel.placement=balanced", "data.tokenizer_vocab_size=200", "data.padding=batch"]
    # the same number of micro-batches per step (the same pipeline fill): packs are several samples long
    variants = [("padded per micro-batch", [f"parallel.micro_batch_size={args.micro_batch}",
                                            f"train.batch_size={args.batch}"]),
                ("packed", ["data.packing=true", f"parallel.micro_batch_size={args.packed_micro_batch}",
                            f"train.batch_size={args.packed_batch}"])]
    runs: dict = {}
    for rnd in range(args.rounds):
        for name, sets in variants:
            print(f"[bench] packing: {name} (round {rnd + 1}/{args.rounds}) ...", flush=True)
            out = os.path.join(tmp, f"{name.split()[0]}_{rnd}")
            launch(2, args.config, common + sets, out)
            runs.setdefault(name, []).append(out)
    rows = []
    for name, _ in variants:
        recs = [r for o in runs[name] for r in read_metrics(os.path.join(o, "metrics.jsonl"))[args.warmup:]]
        rows.append((name, statistics.median(r["samples_per_sec"] for r in recs),
                     statistics.mean(r["pad_fraction"] for r in recs)))
    base = rows[0][1]
    lines = ["| variant | samples/s (median) | vs padded | padding fraction |", "|---|---|---|---|"]
    lines += [f"| {name} | {sps:.1f} | {sps / base:.2f}x | {100 * pad:.0f}% |" for name, sps, pad in rows]
    mem = attention_memory()
    lines += ["", "| one decoder block, 2 x 2048 tokens, fwd + bwd | peak live bytes | of which the mask |", "|---|---|---|"]
    lines += [f"| {name} | {peak / 2**20:.0f} MB | {mb / 2**20:.0f} MB |" for name, peak, mb in mem]
    table = "\n".join(lines)
    print(table)
    notes = (f"{os.path.basename(args.config)} (max_length {args.max_length}) at P = 2 (balanced placement), 2 ranks, "
             f"{args.n} samples: 50% one short text question, {100 * (0.5 - args.long_fraction):.0f}% one image + one "
             f"short answer, {100 * args.long_fraction:.0f}% text conversations of 12-20 turns. Padded: global batch {args.batch} "
             f"samples in micro-batches of {args.micro_batch}, each padded to its longest. Packed: global batch "
             f"{args.packed_batch} packs in micro-batches of {args.packed_micro_batch} (the same micro-batch count), packs of up to {args.max_length} tokens (first-fit decreasing; attention within a "
             f"sample). samples/s counts real samples, so both learn the same label tokens per sample; "
             f"{args.steps} steps per run, {args.rounds} interleaved rounds, median after the first {args.warmup}. Attention memory: one Llama decoder block (width 256) "
             "forward and backward at 2 x 2048 tokens, tensors counted live by mmpipe's LiveBytes (CPU, sdpa): the "
             "additive float mask mmpipe built before is 2 x 2048 x 2048 x 4 bytes per layer call; right-padded rows "
             "now pass no mask (sdpa's causal path); a packed row passes a boolean block-diagonal mask (a quarter of "
             "the float one; on a GPU a varlen/flash kernel needs none - not measured here).")
    if not args.no_append:
        cmd = "mmpipe bench packing " + " ".join(shlex.quote(a) for a in sys.argv[3:])
        append_benchmarks("VLM sequence packing vs padding", cmd, table, notes)
    return 0


def add_arguments(p) -> None:
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "bench_vlm.yaml"))
    p.add_argument("--n", type=int, default=400, help="synthetic chat samples")
    p.add_argument("--long-fraction", type=float, default=0.15)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--batch", type=int, default=32, help="global batch of the padded run (samples)")
    p.add_argument("--packed-micro-batch", type=int, default=2, help="packs per micro-batch")
    p.add_argument("--packed-batch", type=int, default=16, help="global batch of the packed run (packs)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-append", action="store_true")
    p.set_defaults(func=bench_packing)
