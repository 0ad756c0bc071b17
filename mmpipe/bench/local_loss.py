"""``mmpipe bench local-loss``: the global contrastive loss with each data-parallel rank computing only its
own rows (``model.local_loss``, the default) against every rank computing the whole B x B, on a loss-bound
CLIP (tiny towers, a wide projection, a large global batch): the training step at P = 1 (one process, one
micro-batch of the whole batch) and at DP = 2 both ways, measured in interleaved rounds; then the loss alone
per rank (``local_loss_worker.py``: time and peak bytes of ``StepLossCache.fill`` beside the memory model's
``step_loss_bytes``), and from its measured seconds per pair the arithmetic at 64 and 256 ranks."""
from __future__ import annotations

import json
import os
import shlex
import sys

from mmpipe.bench.common import ROOT, append_benchmarks, launch, pooled, run_worker, with_scratch
from mmpipe.config.schema import family_of, load_config
from mmpipe.data.cache import prepare
from mmpipe.data.synth import synth
from mmpipe.families.clip.losses import ClipLoss, SigmoidLoss
from mmpipe.planning.memory import STEP_LOSS_BLOCK_PAIR_BYTES, RunShape, step_loss_bytes

# for the arithmetic at many GPUs: ViT-B/16's measured rate on one H200 (BENCHMARKS.md, bench gpu: 2,007
# samples/s per GPU), and the eager sigmoid loss's cost per pair on an H100-class GPU (102 ms at 65,536^2:
# siglip-kernel's README)
TOWER_SAMPLES_PER_S = 2007.0
GPU_PAIR_S = 0.102 / 65536 ** 2


def _variants(batch: int) -> list:
    """(name, ranks, sets, environment): one device's worth of compute per rank (one thread), the one-rank run
    with the micro-batch of each DP = 2 rank (two accumulation steps), and the same with both cores."""
    half = f"parallel.micro_batch_size={batch // 2}"
    return [("P = 1, one thread", 1, ["parallel.pipeline_stages=1", half], {"OMP_NUM_THREADS": "1"}),
            ("P = 1, two threads", 1, ["parallel.pipeline_stages=1", half], {}),
            ("DP = 2, whole B x B", 2, ["parallel.pipeline_stages=1", half, "model.local_loss=false"], {}),
            ("DP = 2, own rows", 2, ["parallel.pipeline_stages=1", half, "model.local_loss=true"], {})]


def _loss_only(args, sets: list, tmp: str) -> dict:
    spec = {"config": args.config, "sets": sets, "batch": args.batch, "repeats": args.repeats,
            "out": os.path.join(tmp, "loss.json")}
    run_worker("local_loss_worker.py", 2, spec, tmp, "the loss-only run")
    ranks = []
    for r in range(2):
        with open(spec["out"] + f".{r}") as fh:
            ranks.append(json.load(fh))
    return {mode: [rk[mode] for rk in ranks if mode in rk] for mode in ranks[0]}


def predicted_bytes(m: dict, block: int, local: bool, pair_bytes: int) -> float:
    shape = RunShape(features_bytes=m["features_bytes"], loss_rows=m["rows"] // m["micro_batches"],
                     loss_pair_bytes=pair_bytes, loss_block=block,
                     loss_block_pair_bytes=STEP_LOSS_BLOCK_PAIR_BYTES, loss_local=local)
    return step_loss_bytes(shape, m["micro_batches"], m["ranks"])


@with_scratch("local-loss")
def bench_local_loss(args, tmp: str) -> int:
    sets = [f"model.projection_dim={args.projection}", f"train.batch_size={args.batch}", "model.negatives=global",
            f"model.loss={args.loss}"]
    cfg = load_config(args.config, sets)
    size = family_of(cfg).pixels(cfg.model, cfg.data).size
    info = synth(os.path.join(tmp, "data"), args.batch + 64, val_fraction=0.0, size=size, seed=0, progress=False)
    cache = os.path.join(tmp, "cache")
    prepare(info["train"], cache, size, cfg.data.max_length, vocab_size=cfg.data.tokenizer_vocab_size, workers=2,
            progress=False)
    common = sets + [f"data.cache={cache}", "data.train=null", "data.val=null", f"train.steps={args.steps}",
                     "train.eval_every=0", "train.save_every=0"]
    runs: dict = {}
    for rnd in range(args.rounds):  # interleaved: a slow spell of the machine hits every variant alike
        for name, n, vsets, env in _variants(args.batch):
            print(f"[bench] local-loss: {name} (round {rnd + 1}/{args.rounds}) ...", flush=True)
            out = os.path.join(tmp, f"run{len(runs.get(name, []))}_{name.replace(' ', '').replace(',', '_')}")
            launch(n, args.config, common + vsets, out, env)
            runs.setdefault(name, []).append(out)
    steps = {name: pooled(runs[name], args.warmup)[0] for name, *_ in _variants(args.batch)}
    one, two = steps["P = 1, one thread"], steps["P = 1, two threads"]
    lines = ["| step (training) | ranks | step ms | vs P = 1, one thread (a device per rank) | vs P = 1, two threads |",
             "|---|---|---|---|---|"]
    for name, n, *_ in _variants(args.batch):
        lines.append(f"| {name} | {n} | {1e3 * steps[name]:.0f} | {steps[name] / one:.2f}x | {steps[name] / two:.2f}x |")

    print("[bench] local-loss: the loss alone per rank (StepLossCache.fill) ...", flush=True)
    loss = _loss_only(args, sets, tmp)
    block = cfg.model.loss_block
    lines += ["", "| loss alone (fill) | rows x B per rank | ms per rank | vs one rank | peak MB per rank | "
                  "memory model MB | model error |", "|---|---|---|---|---|---|---|"]
    alone = loss["one rank, whole"][0]
    for mode, per_rank in loss.items():
        m = max(per_rank, key=lambda r: r["seconds"])
        local = mode.endswith("own rows")
        pairs_rows = m["rows"] if local else args.batch
        pred = predicted_bytes(m, block, local, (SigmoidLoss if args.loss == "sigmoid" else ClipLoss).pair_bytes)
        peak = max(r["peak_bytes"] for r in per_rank)
        lines.append(f"| {mode} | {pairs_rows} x {args.batch} | {1e3 * m['seconds']:.0f} | "
                     f"{m['seconds'] / alone['seconds']:.2f}x | {peak / 1e6:.0f} | {pred / 1e6:.0f} | "
                     f"{100 * (pred / peak - 1):+.0f}% |")
    same = abs(loss["DP2, own rows"][0]["loss"] - loss["DP2, whole B x B"][0]["loss"])
    own = loss["DP2, own rows"][0]
    pair_s = own["seconds"] / (own["rows"] * args.batch)  # a rank of two, one thread: seconds per pair
    B = 32768
    lines += ["", f"| B = {B} | pairs per rank: whole / own rows | loss per rank here ({pair_s * 1e9:.2f} ns a "
                  f"pair, proj {args.projection}): whole / own rows | share of an H200 ViT-B/16 step: whole / own "
                  "rows |", "|---|---|---|---|"]
    for W in (8, 64, 256):
        tower = B / W / TOWER_SAMPLES_PER_S
        lines.append(f"| W = {W} | {B * B / 1e9:.2f}G / {B * B / W / 1e9:.3f}G | {pair_s * B * B:.0f} s / "
                     f"{pair_s * B * B / W:.1f} s | {100 * GPU_PAIR_S * B * B / tower:.1f}% / "
                     f"{100 * GPU_PAIR_S * B * B / W / tower:.2f}% |")
    table = "\n".join(lines)
    print(table)
    notes = (f"{os.path.basename(args.config)} with model.projection_dim={args.projection}, model.loss={args.loss}, "
             f"global batch {args.batch}, {args.steps} steps per run, {args.rounds} interleaved rounds, median over "
             f"every round's steps after the first {args.warmup}. P = 1: one process over two micro-batches of B / 2 "
             "(the feature cache and the whole B x B loss in blocks), with one thread (one device's compute, as each "
             "DP = 2 rank has) and with both cores; DP = 2: two ranks of one thread each, one micro-batch of B / 2 "
             "each (one pass). The "
             f"loss alone: {args.repeats} timed repeats per mode, peak bytes counted once by LiveBytes, model.loss_block="
             f"{block}; the two DP2 modes' losses agree within {same:.1e}. The last table scales the measured CPU cost "
             "per pair to B = 32768 (the whole B x B per rank stays, the own rows fall as 1/W), and gives the share "
             "of a ViT-B/16 step per rank on an H200 (2,007 samples/s per GPU, bench gpu) that the loss takes at "
             "a GPU's cost per pair (2.4e-11 s: 102 ms for 65,536^2, siglip-kernel's README): the whole matrix's "
             "share grows with W, the own rows' stays.")
    if not args.no_append:
        cmd = "mmpipe bench local-loss " + " ".join(shlex.quote(a) for a in sys.argv[3:])
        append_benchmarks("Global contrastive loss: each rank its own rows vs the whole B x B", cmd, table, notes)
    return 0


def add_arguments(p) -> None:
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny.yaml"))
    p.add_argument("--batch", type=int, default=4096, help="global batch")
    p.add_argument("--projection", type=int, default=1024, help="model.projection_dim (the loss's width)")
    p.add_argument("--loss", choices=("softmax", "sigmoid"), default="softmax")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of the loss alone")
    p.add_argument("--no-append", action="store_true")
    p.set_defaults(func=bench_local_loss)
