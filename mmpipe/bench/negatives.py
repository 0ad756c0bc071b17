"""``mmpipe bench negatives``: the step-time cost of CLIP's contrastive loss over the whole global
batch (``model.negatives: global``: one more forward of every stage and the features' all-gather)
against per-micro-batch negatives, measured at P = 2 beside the cost model's prediction, with the
vision tower trained and frozen."""
from __future__ import annotations

import json
import os
import shlex
import sys

from mmpipe.bench.common import ROOT, append_benchmarks, launch, pooled, with_scratch
from mmpipe.config.schema import family_of, load_config
from mmpipe.data.cache import prepare
from mmpipe.data.synth import synth
from mmpipe.parallel.plan import Plan
from mmpipe.planning.offline import plan_all
from mmpipe.planning.place import predict

VARIANTS = [("micro_batch", ["model.negatives=micro_batch"]), ("global", ["model.negatives=global"]),
            ("micro_batch, frozen vision", ["model.negatives=micro_batch", "optim.freeze_vision=true"]),
            ("global, frozen vision", ["model.negatives=global", "optim.freeze_vision=true"])]


@with_scratch("negatives")
def bench_negatives(args, tmp: str) -> int:
    cfg = load_config(args.config)
    size = family_of(cfg).pixels(cfg.model, cfg.data).size
    info = synth(os.path.join(tmp, "data"), args.n, val_fraction=0.0, size=size, seed=0, progress=False)
    cache = os.path.join(tmp, "cache")
    prepare(info["train"], cache, size, cfg.data.max_length, vocab_size=cfg.data.tokenizer_vocab_size, workers=2,
            progress=False)
    common = [f"data.cache={cache}", "data.train=null", "data.val=null", f"train.steps={args.steps}",
              "parallel.pipeline_stages=2", "parallel.placement=modality"]
    runs: dict = {}
    for rnd in range(args.rounds):  # interleaved: a slow spell of the machine hits every variant alike
        for name, sets in VARIANTS:
            print(f"[bench] negatives: {name} (round {rnd + 1}/{args.rounds}) ...", flush=True)
            out = os.path.join(tmp, f"{name.replace(', ', '_').replace(' ', '_')}_{rnd}")
            launch(2, args.config, common + sets, out)
            runs.setdefault(name, []).append(out)
    log = lambda s: print(f"[bench] {s}", flush=True)  # noqa: E731
    rows = []
    for name, sets in VARIANTS:
        measured, out, _ = pooled(runs[name], args.warmup)
        # profiled now, after the runs: a profile cached at another time of this shared machine can be 20% off
        plan = plan_all(load_config(args.config, common + sets), 2, threads=1, log=log, refresh=True)
        with open(os.path.join(out, "plan.json")) as fh:
            run_plan = Plan.from_json(json.load(fh))
        rows.append((name, measured, predict(plan["profile"], run_plan.parts, plan["micro_batches"],
                                             run_plan.order).step_time))
    base = {False: rows[0], True: rows[2]}
    lines = ["| negatives | step ms measured | predicted | error | vs micro_batch measured | predicted |",
             "|---|---|---|---|---|---|"]
    for name, meas, pred in rows:
        _, bm, bp = base["frozen" in name]
        lines.append(f"| {name} | {1e3 * meas:.0f} | {1e3 * pred:.0f} | {100 * (pred / meas - 1):+.0f}% | "
                     f"{meas / bm:.2f}x | {pred / bp:.2f}x |")
    table = "\n".join(lines)
    print(table)
    batch = cfg.train.batch_size
    notes = (f"{os.path.basename(args.config)} at P = 2 (modality placement), 2 ranks, global batch {batch}, "
             f"{args.steps} steps per run, {args.rounds} interleaved rounds, median over every round's steps after the "
             f"first {args.warmup}. `global` runs every stage's forward twice (a forward-only pass for the "
             "features, then 1F1B) and gathers the features on the last stage; a frozen tower runs in the first "
             "pass only (the training pass takes its recorded output). Predicted: the simulator replaying "
             "the step loss's forward-only pass then 1F1B (parallel.schedules) with layer costs profiled in this run.")
    if not args.no_append:
        cmd = "mmpipe bench negatives " + " ".join(shlex.quote(a) for a in sys.argv[3:])
        append_benchmarks("Contrastive negatives: global batch vs micro-batch", cmd, table, notes)
    return 0


def add_arguments(p) -> None:
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "demo.yaml"))
    p.add_argument("--n", type=int, default=400, help="synthetic training pairs")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-append", action="store_true")
    p.set_defaults(func=bench_negatives)
