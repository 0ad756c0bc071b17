"""``mmpipe bench groups``: grouped clipping's cost against DeepSpeed's global clipping."""
from __future__ import annotations

import os
import re
import shlex
import statistics
import sys

from mmpipe.bench.common import _steps, append_benchmarks, launch, with_scratch
from mmpipe.train.metrics import read_memory_record


@with_scratch("groups")
def bench_groups(args, tmp: str) -> int:
    """Baseline (no clip limits: the per-group norms are still taken every step, since a non-finite
    one skips the step) vs grouped clipping (4 groups + global) vs frozen vision."""
    config = args.config
    steps = args.steps
    base = [f"train.steps={steps}", "train.eval_every=0", "data.val=null", f"train.save_every={steps * 10}"]
    variants = GROUP_VARIANTS
    rows = []
    for name, sets in variants:
        out = os.path.join(tmp, re.sub(r"\W+", "_", name))
        print(f"[bench] {name} ...", flush=True)
        launch(args.nproc, config, base + sets, out)
        recs = _steps(out, args.warmup)
        step_t = statistics.median(r["step_time"] for r in recs)
        clip_t = statistics.median(r.get("clip_time", 0.0) for r in recs)
        wait_t = statistics.median(r.get("clip_wait", 0.0) for r in recs)
        mem = {r["rank"]: (r["optimizer_state_mb"], r["peak_mb"]) for r in read_memory_record(out)}
        rows.append((name, step_t, clip_t, wait_t, mem))
    b = rows[0][1]
    lines = ["| variant | median step (s) | step time vs baseline | norms + scaling (s) | share of step "
             "| norm all-reduce incl. stage wait (s) | optimizer state per rank (MB) | max RSS per rank (MB) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, st, ct, wt, mem in rows:
        opt = " / ".join(f"{mem[r][0]:.1f}" for r in sorted(mem))
        rss = " / ".join(f"{mem[r][1]:.0f}" for r in sorted(mem))
        lines.append(f"| {name} | {st:.4f} | {st / b:.3f}x | {ct:.5f} | {100 * ct / st:.2f}% | {wt:.5f} | {opt} | {rss} |")
    table = "\n".join(lines)
    print(table)
    cmd = "mmpipe bench groups " + " ".join(shlex.quote(a) for a in sys.argv[3:])
    notes = (f"{steps} steps each, median over steps after the first {args.warmup}; {args.nproc} ranks (P = 2: "
             "stage 0 = image tower, stage 1 = text tower + loss); per-rank columns list rank 0 / rank 1. Clipping "
             "columns are the reporting rank's (last stage): the compute of mmpipe's clipping (per-group norms and "
             "scaling) as a share of its step time, and apart from it the one 4-element all-reduce, which also "
             "absorbs the last stage waiting for stage 0 to finish its last backward (pipeline skew that without "
             "the hook shows up at the next step's first receive instead). The step-time ratio also carries the "
             "run-to-run noise of this shared machine (about +-5%).")
    if not args.no_append:
        append_benchmarks("Grouped clipping and frozen towers", cmd, table, notes)
    return 0


# (label, settings): the baseline sets no clip limit, but mmpipe takes every group's norm each step
# anyway (a non-finite one skips the step), so the rows differ by the clipping and freezing alone
GROUP_VARIANTS = [
    ("baseline: no clip limits (norms still taken for the skip check)", []),
    ("grouped clipping (4 groups + global)", [f"optim.groups.{g}.max_grad_norm=0.5" for g in
                                             ("vision", "projector", "text", "logit_scale")]
     + ["optim.max_grad_norm=1.0"]),
    ("grouped clipping + frozen vision tower", ["optim.groups.text.max_grad_norm=0.5", "optim.freeze_vision=true"]),
]
