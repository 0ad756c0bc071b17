"""``mmpipe bench schedule``: the pipeline schedules side by side on one job, measured (interleaved rounds, pooled
medians) beside the simulator's prediction of each:

- the bench VLM with its vision tower and projector frozen (ms-swift's default for LoRA): ``1f1b`` against
  ``frozen_first`` at P = 2 and P = 3, and what ``parallel.schedule: auto`` picks;
- ``--zero-bubble``: the bench VLM trained whole on a balanced cut at P = 2, ``1f1b`` against ``zb_h1`` at each of
  ``--micro-batches`` (4 and 8 a step), predicted from one profile (the runs'), a timeline of each."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import statistics
import sys

from mmpipe.bench.common import ROOT, append_benchmarks, launch, pooled, with_scratch
from mmpipe.config.schema import load_config
from mmpipe.data.synth import synth_vlm
from mmpipe.parallel.plan import Plan
from mmpipe.parallel.schedules import Order
from mmpipe.planning.offline import plan_all
from mmpipe.planning.place import predict
from mmpipe.train.metrics import measured_from_run

SCHEDULES = ("1f1b", "frozen_first")
FROZEN = ["optim.freeze_vit=true", "optim.freeze_aligner=true"]


def add_arguments(p) -> None:
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "bench_vlm.yaml"))
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="interleaved repetitions; steps pooled, median kept")
    p.add_argument("--n", type=int, default=400, help="synthetic chat samples")
    p.add_argument("--no-append", action="store_true")
    p.add_argument("--zero-bubble", action="store_true", help="1f1b against zb_h1 on the VLM trained whole, balanced cut")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8], help="--zero-bubble: micro-batches a step")
    p.set_defaults(func=bench_schedule)


@with_scratch("schedule")
def bench_schedule(args, tmp: str) -> int:
    if args.zero_bubble:
        return bench_zero_bubble(args, tmp)
    info = synth_vlm(os.path.join(tmp, "chat"), args.n, val_fraction=0.0, size=64, seed=0, progress=False)
    common = [f"data.train={info['train']}", "data.val=null", f"train.steps={args.steps}", "train.save_every=0"] + FROZEN
    art = os.path.join(os.getcwd(), "benchmarks")
    os.makedirs(art, exist_ok=True)
    runs: dict = {}
    for rnd in range(args.rounds):
        for P in args.stages:
            for name in SCHEDULES:
                print(f"[bench] schedule: P = {P} {name} (round {rnd + 1}/{args.rounds}) ...", flush=True)
                out = os.path.join(tmp, f"p{P}_{name}_{rnd}")
                trace = [f"log.trace=[{args.steps - 1},{args.steps}]"] if rnd == 0 else []
                launch(P, args.config, common + [f"parallel.pipeline_stages={P}", f"parallel.schedule={name}"] + trace,
                       out)
                runs.setdefault((P, name), []).append(out)
    lines = ["| P | schedule | frozen stages | step ms measured | predicted | vs 1f1b measured | vs 1f1b predicted "
             "| idle per stage | auto picks |", "|---|---|---|---|---|---|---|---|---|"]
    for P in args.stages:
        base = pooled(runs[(P, "1f1b")], args.warmup)[0]
        for name in SCHEDULES:
            st, mid, _ = pooled(runs[(P, name)], args.warmup)
            with open(os.path.join(mid, "plan.json")) as fh:
                plan = json.load(fh)
            pred = plan["schedules"]
            auto = "frozen_first" if pred.get("frozen_first", float("inf")) <= pred["1f1b"] else "1f1b"
            idle = ", ".join(f"{x:.0%}" for x in measured_from_run(mid, skip=args.warmup)["idle_frac"])
            lines.append(f"| {P} | {name} | {plan['frozen_stages']} | {1e3 * st:.0f} | {1e3 * pred[name]:.0f} | "
                         f"{base / st:.2f}x | {pred['1f1b'] / pred[name]:.2f}x | {idle} | {auto} |")
            _keep_timeline(runs[(P, name)][0], art, f"schedule_p{P}_{name}")
    table = "\n".join(lines)
    notes = (f"bench_vlm.yaml with optim.freeze_vit and optim.freeze_aligner (fp32, ZeRO-0: the frozen stage holds "
             f"no optimizer state), modality placement, P ranks x 1 thread, {args.steps} steps per run, median step "
             f"after the first {args.warmup}, pooled over {args.rounds} interleaved rounds; 'vs 1f1b' > 1 is faster. "
             "Predicted: the simulator replaying each schedule's streams with the run's profiled layer costs. "
             "frozen_first runs the frozen stage's forwards back to back and never sends it a gradient; timelines: "
             "benchmarks/schedule_p*_*_timeline.png. The prediction does not see what frozen_first saves here: the "
             "links were not timed (modality placement profiles no transfers) and the first trained stage's input "
             "gradient is inside its profiled backward, so both schedules predict the same step and auto takes "
             "frozen_first on the tie; at P = 3 the three ranks share 2 cores (the prediction assumes a core each).")
    print(table)
    print(notes)
    if not args.no_append:
        append_benchmarks("Pipeline schedules: 1f1b vs frozen_first, frozen vision tower",
                          "mmpipe bench schedule " + " ".join(shlex.quote(a) for a in sys.argv[3:]), table, notes)
    return 0


ZERO_BUBBLE = ("1f1b", "zb_h1")


def _keep_timeline(run: str, art: str, prefix: str) -> None:
    """A traced run's trace and timeline into ``benchmarks/``."""
    for f in ("trace.json", "timeline.png"):
        if os.path.isfile(os.path.join(run, f)):
            shutil.copy(os.path.join(run, f), os.path.join(art, f"{prefix}_{f}"))


def bench_zero_bubble(args, tmp: str) -> int:
    """``--zero-bubble``: see the module doc."""
    info = synth_vlm(os.path.join(tmp, "chat"), args.n, val_fraction=0.0, size=64, seed=0, progress=False)
    common = [f"data.train={info['train']}", "data.val=null", f"train.steps={args.steps}", "train.save_every=0",
              "parallel.pipeline_stages=2", "parallel.placement=balanced", "parallel.micro_batch_size=4",
              "log.progress=false"]
    art = os.path.join(os.getcwd(), "benchmarks")
    os.makedirs(art, exist_ok=True)
    plans, profs = {}, {}
    for M in args.micro_batches:  # one profile (layers timed whole and split) and its balanced cut, for both orders
        plan = plan_all(load_config(args.config, common + [f"train.batch_size={4 * M}", "parallel.schedule=auto"]), 2,
                        threads=1, log=lambda m: print(f"[bench] {m}", flush=True))
        profs[M], plans[M] = plan["profile"], os.path.join(tmp, f"cut_m{M}.json")
        with open(plans[M], "w") as fh:
            json.dump({"stages": plan["plans"]["balanced"].stages}, fh)
    runs: dict = {}
    for rnd in range(args.rounds):  # interleaved: a slow spell of the machine hits both orders alike
        for M in args.micro_batches:
            for name in ZERO_BUBBLE:
                print(f"[bench] schedule: M = {M} {name} (round {rnd + 1}/{args.rounds}) ...", flush=True)
                out = os.path.join(tmp, f"m{M}_{name}_{rnd}")
                trace = [f"log.trace=[{args.steps - 1},{args.steps}]"] if rnd == 0 else []
                launch(2, args.config, common + [f"train.batch_size={4 * M}", f"parallel.schedule={name}",
                                                 f"parallel.plan={plans[M]}"] + trace, out)
                runs.setdefault((M, name), []).append(out)
    lines = ["| micro-batches | schedule | step ms measured | predicted | error | vs 1f1b measured (per round) "
             "| vs 1f1b predicted | idle per stage |", "|---|---|---|---|---|---|---|---|"]
    for M in args.micro_batches:
        measured, predicted, rounds = {}, {}, {}
        for name in ZERO_BUBBLE:
            st, mid, rounds[name] = pooled(runs[(M, name)], args.warmup)
            with open(os.path.join(mid, "plan.json")) as fh:
                plan = Plan.from_json(json.load(fh))
            measured[name], predicted[name] = st, predict(profs[M], plan.parts, M, Order(name)).step_time
            idle = ", ".join(f"{x:.0%}" for x in measured_from_run(mid, skip=args.warmup)["idle_frac"])
            # each round ran both orders back to back: its ratio cancels a slow spell of the machine longer than a run
            paired = sorted(a / b for a, b in zip(rounds["1f1b"], rounds[name]))
            lines.append(f"| {M} | {name} | {1e3 * st:.0f} | {1e3 * predicted[name]:.0f} | "
                         f"{100 * (predicted[name] / st - 1):+.0f}% | {measured['1f1b'] / st:.2f}x (median "
                         f"{statistics.median(paired):.2f}x, {paired[0]:.2f}-{paired[-1]:.2f}x) | "
                         f"{predicted['1f1b'] / predicted[name]:.2f}x | {idle} |")
            _keep_timeline(runs[(M, name)][0], art, f"schedule_zb_m{M}_{name}")
    table = "\n".join(lines)
    notes = (f"bench_vlm.yaml trained whole (fp32, ZeRO-0), P = 2 on the balanced cut of one profile (both orders on "
             "it: parallel.plan), "
             f"micro-batches of 4, 2 ranks x 1 thread, {args.steps} steps per run, median step after the first "
             f"{args.warmup}, pooled over {args.rounds} interleaved rounds; 'vs 1f1b' > 1 is faster. zb_h1 splits each "
             "backward into the input gradient (B) and the linear layers' weight gradients (W) and runs the W's in the "
             "bubble (parallel/zero_bubble.py). Predicted: the simulator replaying each order's streams with one "
             "profile (each layer's backward timed whole and split). Timelines: "
             "benchmarks/schedule_zb_m*_*_timeline.png.")
    print(table)
    print(notes)
    if not args.no_append:
        append_benchmarks("Pipeline schedules: 1f1b vs zb_h1 (zero bubble), VLM trained whole",
                          "mmpipe bench schedule " + " ".join(shlex.quote(a) for a in sys.argv[3:]), table, notes)
    return 0
