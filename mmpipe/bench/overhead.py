"""``mmpipe bench overhead``: what mmpipe adds to DeepSpeed's own step. The same tiny CLIP (an
overhead-bound model: a step is mostly Python, wrappers and synchronisations) trained by mmpipe
(grouped clipping, the stage clock and the metrics on; micro-batch negatives, since global negatives
change the work) and by a raw DeepSpeed engine on the same plain module, micro-batch shapes, AdamW
settings and clipping (``overhead_worker.py``), at P = 1, P = 2 and DP = 2, side by side in one run:
the ratio of their median step times."""
from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys

from mmpipe.bench.common import ROOT, append_benchmarks, launch, run_worker, with_scratch
from mmpipe.config.schema import DataConfig
from mmpipe.parallel.topology import cpu_threads
from mmpipe.train.metrics import read_metrics

# name: (ranks, stages, mmpipe's loader workers: 0 = in the training process, None = data.num_workers' default)
LAYOUTS = {"P1": (1, 1, 0), "P1-workers": (1, 1, None), "P2": (2, 2, 0), "DP2": (2, 1, 0)}


def raw_deepspeed(run: str, ranks: int, stages: int, steps: int, clip: float, tmp: str) -> list:
    """The raw DeepSpeed baseline's step times on the mmpipe run ``run``'s model and shapes (each rank at the
    CPU threads an mmpipe rank takes: ``parallel.topology.cpu_threads``, ``OMP_NUM_THREADS`` first)."""
    spec = {"run": run, "stages": stages, "steps": steps, "clip": clip, "out": os.path.join(tmp, "raw.json")}
    run_worker("overhead_worker.py", ranks, spec, tmp, "the raw DeepSpeed run")
    with open(spec["out"]) as fh:
        return json.load(fh)["step_times"]


@with_scratch("overhead")
def bench_overhead(args, tmp: str) -> int:
    from mmpipe.data.synth import synth
    info = synth(os.path.join(tmp, "data"), args.n, val_fraction=0.0, size=64, progress=False)
    cache = os.path.join(tmp, "cache")  # both sides read pre-decoded data: the step, not JPEG decoding, is measured
    subprocess.run([sys.executable, "-m", "mmpipe.cli.main", "data", "prepare", "--config", args.config,
                    "--manifest", info["train"], "--out", cache], check=True, capture_output=True)
    clip = 1.0
    sets = [f"data.train={info['train']}", f"data.cache={cache}", "data.val=null", "model.negatives=micro_batch", "data.padding=max_length",
            f"train.steps={args.steps}", "train.save=false", "train.eval_every=0", "parallel.profile=false",
            "optim.groups.vision.max_grad_norm=1.0", "optim.groups.text.max_grad_norm=1.0", f"optim.max_grad_norm={clip}",
            "log.stage_timing=true", f"train.precision={args.precision}"]
    rows = []
    for name in args.layouts:
        ranks, stages, workers = LAYOUTS[name]
        loader = [f"data.num_workers={DataConfig().num_workers if workers is None else workers}"]
        mm, raw = [], []
        for r in range(args.rounds):
            print(f"[bench] overhead {name}: mmpipe, round {r + 1} ...", flush=True)
            out = os.path.join(tmp, f"{name}_{r}")
            launch(ranks, args.config, sets + loader + [f"parallel.pipeline_stages={stages}",
                                                        "parallel.placement=parameters"], out)
            mm += [x["step_time"] for x in read_metrics(os.path.join(out, "metrics.jsonl"))][args.warmup:]
            print(f"[bench] overhead {name}: raw DeepSpeed, round {r + 1} ...", flush=True)
            raw += raw_deepspeed(out, ranks, stages, args.steps, clip, tmp)[args.warmup:]
        m, d = statistics.median(mm), statistics.median(raw)
        rows.append((name, ranks, stages, d, m))
    threads, why = cpu_threads(1, os.cpu_count() or 1)
    lines = ["| layout | ranks | raw DeepSpeed step ms | mmpipe step ms | mmpipe / DeepSpeed |", "|---|---|---|---|---|"]
    lines += [f"| {n} | {k} | {d * 1e3:.1f} | {m * 1e3:.1f} | {m / d:.2f}x |" for n, k, _, d, m in rows]
    table = "\n".join(lines)
    print(table)
    notes = (f"{os.path.basename(args.config)} in {args.precision} with micro-batch negatives, padded to data.max_length, {args.steps} steps x "
             f"{args.rounds} rounds interleaved, median step after the first {args.warmup} of each. mmpipe: grouped clipping "
             "(vision, text at 1.0, global 1.0), the stage clock and every metric on, its loader reading the "
             "pre-decoded cache (mmpipe data prepare) in the training process (num_workers 0; the read is counted "
             f"in mmpipe's step), and in P1-workers with data.num_workers' default ({DataConfig().num_workers} worker "
             f"processes, each micro-batch handed over as one buffer: mmpipe.data.handoff). Both sides at the same CPU "
             f"threads per rank (P = 1: {threads}, {why}; 2 ranks: each its share). Raw "
             "DeepSpeed: the same plain module (mmpipe.build_model of mmpipe's resolved config) or a PipelineModule "
             "of the same layers (P = 2, partitioned by parameters as mmpipe's run), torch AdamW, DeepSpeed's global "
             "clipping at 1.0, micro-batches of the same shapes made up front, a host read of the loss per step.")
    print(notes)
    if not args.no_append:
        append_benchmarks("Overhead: mmpipe's step vs a raw DeepSpeed engine",
                          "mmpipe bench overhead " + " ".join(shlex.quote(a) for a in sys.argv[3:]), table, notes)
    return 0


def add_arguments(p) -> None:
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny.yaml"))
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--n", type=int, default=400, help="synthetic pairs")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="both sides' precision (bf16 at P = 1: DeepSpeed's unfused optimizer)")
    p.add_argument("--no-append", action="store_true")
    p.set_defaults(func=bench_overhead)
