"""``mmpipe bench memory``: every stage's predicted peak (``mmpipe.planning.memory``) beside the peak
counted live in a real run (``log.memory``), on the bench models (CLIP image-heavy, the VLM), at
P = 2 and 3, with and without activation checkpointing."""
from __future__ import annotations

import os
import shlex
import sys

from mmpipe.bench.common import ROOT, append_benchmarks, launch, with_scratch
from mmpipe.config.schema import family_of, load_config
from mmpipe.data.synth import synth, synth_vlm
from mmpipe.planning.offline import run_memory
from mmpipe.train.memory_meter import read_memory

MODELS = {"clip": "bench_image_heavy.yaml", "vlm": "bench_vlm.yaml"}


def _data(tmp: str, family: str, cfg, n: int) -> list:
    size = family_of(cfg).pixels(cfg.model, cfg.data).size
    if family_of(cfg).data_format == "chat":  # one image per sample: the profiled shape
        info = synth_vlm(os.path.join(tmp, "chat"), n, val_fraction=0.0, size=size, text_only=0.0, progress=False)
    else:
        info = synth(os.path.join(tmp, "pairs"), n, val_fraction=0.0, size=size, progress=False)
    return [f"data.train={info['train']}", "data.val=null"]


@with_scratch("memory")
def bench_memory(args, tmp: str) -> int:
    rows = []
    for family in args.models:
        config = os.path.join(ROOT, "configs", MODELS[family])
        data = _data(tmp, family, load_config(config), args.n)
        for P in (2, 3):
            for ckpt in ("none", "all"):
                name = f"{family} P{P} checkpointing {ckpt}"
                print(f"[bench] memory: {name} ...", flush=True)
                out = os.path.join(tmp, name.replace(" ", "_"))
                launch(P, config, data + [f"train.steps={args.steps}", f"parallel.pipeline_stages={P}",
                                          f"parallel.activation_checkpointing={ckpt}", "log.memory=true",
                                          "data.padding=max_length", "parallel.placement=modality"], out)
                cfg = load_config(os.path.join(out, "config.yaml"))
                measured = read_memory(out)
                predicted = run_memory(cfg, out, len(measured))
                for r in measured:
                    rows.append((name, r["stage"], predicted[r["stage"]].to_dict(), r["peak"]))
    lines = ["| run | stage | predicted MB | measured MB | error | activations etc. predicted | measured | of which "
             "weights + optimizer |", "|---|---|---|---|---|---|---|---|"]
    for name, s, p, m in rows:
        dyn = p["total"] - p["weights"] - p["optimizer"]
        lines.append(f"| {name} | {s} | {p['total'] / 2**20:.1f} | {m['total'] / 2**20:.1f} | "
                     f"{100 * (p['total'] / m['total'] - 1):+.1f}% | {dyn / 2**20:.1f} | {m['dynamic'] / 2**20:.1f} | "
                     f"{(m['weights'] + m['optimizer']) / 2**20:.1f} |")
    table = "\n".join(lines)
    print(table)
    worst = max(abs(p["total"] / m["total"] - 1) for _, _, p, m in rows)
    notes = (f"Predicted: the memory model from each run's layer profile (bytes measured per layer on real tensors) "
             f"and its plan; measured: every tensor storage the rank held, counted live during {args.steps} steps "
             f"(`log.memory`), at its peak. Largest error {100 * worst:.1f}%. 'Activations etc.' is everything but the "
             "weights and optimizer state: activations of the micro-batches in flight (checkpointed: their inputs and "
             "one recomputed layer), gradients, boundary buffers, one layer's backward working set, the step's "
             "batches and CLIP's feature cache. Shapes fixed (padding to max_length, one image per chat sample), "
             "as the model predicts the configured shape. CPU: counted by a dispatch mode; on a GPU the allocator's "
             "peak (max_memory_allocated) is recorded beside it.")
    if not args.no_append:
        cmd = "mmpipe bench memory " + " ".join(shlex.quote(a) for a in sys.argv[3:])
        append_benchmarks("Memory per stage: predicted vs measured", cmd, table, notes)
    return 0


def add_arguments(p) -> None:
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--n", type=int, default=120, help="synthetic samples")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--no-append", action="store_true")
    p.set_defaults(func=bench_memory)
