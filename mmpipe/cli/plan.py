"""``mmpipe plan``: one pipeline's placements with predicted stage times (and, with --run, against
a run's measured ones), or with --world every layout of N ranks."""
from __future__ import annotations

import json
import os

from mmpipe.config.schema import load_config
from mmpipe.errors import ConfigError
from mmpipe.parallel.plan import order_of_json
from mmpipe.planning.charts import write_memory_png, write_plan_png, write_png
from mmpipe.planning.layouts import format_table, layouts_json, plan_layouts, step_loss_summary
from mmpipe.planning.offline import _profile_for, format_plan, plan_all, run_memory
from mmpipe.planning.place import predict
from mmpipe.planning.simulate import recommend_micro_batches
from mmpipe.train.memory_meter import read_memory
from mmpipe.train.metrics import measured_from_run, read_metrics


def cmd_plan_world(args) -> int:
    """``mmpipe plan --world N [--memory-gb M]``: every layout of N ranks predicted, the fastest that
    fits marked; layouts.json and layouts.png. When none fits: the table, then one line."""
    cfg = load_config(args.config, args.overrides, weights=False)  # (a hub id: its config files, not its weights)
    log = lambda m: print(f"[plan] {m}", flush=True)  # noqa: E731
    res = plan_layouts(cfg, args.world, args.memory_gb, use_cache=not args.no_cache, log=log,
                       meta=True if args.meta or args.gpu_kernels else None, unfit_ok=True,
                       gpu_kernels=True if args.gpu_kernels else None)
    what = ("sized on the meta device, predicted peak memory per rank (step times not predicted)" if res["meta"] else
            f"{res['threads']} thread(s) per rank, {res['comm'].backend}; predicted per optimizer step")
    budget = res["memory_budget"] / 2**30
    print(f"{args.world} ranks, batch {cfg.train.batch_size}, micro-batch {res['micro_batch_size']}, "
          f"{cfg.train.precision}, memory budget {budget:.2f} GB per rank; {what}:")
    print(format_table(res["rows"], res["chosen"], cfg.train.batch_size, timed=not res["meta"]))
    if res["chosen"] is None:
        source = (f"--memory-gb {args.memory_gb:g}" if args.memory_gb is not None else
                  f"parallel.memory_budget_gb={cfg.parallel.memory_budget_gb:g}" if cfg.parallel.memory_budget_gb
                  else "the device's memory")
        raise ConfigError(f"mmpipe plan: no layout of {args.world} ranks fits the {budget:.2f} GB per rank of "
                          f"{source} (the table above gives each one's peak): raise it, give more ranks (--world), "
                          "or freeze/shrink the model")
    print(f"\nchosen: {res['chosen'].name} ({res['why']})")
    loss = step_loss_summary(res["profile"], cfg.train.batch_size, res["chosen"])
    if loss:
        print(loss)
    out = args.out or os.path.join(cfg.train.output_dir, "plan")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "layouts.json"), "w") as fh:
        json.dump(layouts_json(res), fh, indent=1)
    if not res["meta"]:
        write_png(os.path.join(out, "layouts.png"), res["rows"], res["chosen"],
                  title=f"{args.world} ranks: predicted step per layout (green: chosen)")
    write_memory_png(os.path.join(out, "memory.png"), res["rows"], res["chosen"], res["memory_budget"],
                     title=f"{args.world} ranks: predicted peak memory per layout")
    pngs = "memory.png" if res["meta"] else "layouts.png and memory.png"
    print(f"wrote {out}/layouts.json, {pngs} (train with --set parallel.layout=auto to use it)")
    return 0


TIMING_SKIP = 3  # steps left out of the measured step times (start-up, allocation)


def compare_with_run(cfg, run_dir: str, use_cache: bool = True, log=print) -> str:
    """Predicted (from the profile, for the run's own parts) beside measured (its metrics)."""
    import json
    with open(os.path.join(run_dir, "plan.json")) as fh:
        run_plan = json.load(fh)
    parts, M = run_plan["parts"], run_plan.get("micro_batches")
    P = len(parts) - 1
    lines = [f"{run_dir}: {P} stages, {M} micro-batches per step, parts {parts}",
             "| | predicted | measured | error |", "|---|---|---|---|"]
    metrics = os.path.join(run_dir, "metrics.jsonl")
    steps = len(read_metrics(metrics)) if os.path.isfile(metrics) else 0
    if steps > TIMING_SKIP:  # the first steps (start-up, allocation) are not timed
        _, prof = _profile_for(cfg, P, log=log, use_cache=use_cache)
        sim, meas = predict(prof, parts, M, order_of_json(run_plan)), measured_from_run(run_dir, TIMING_SKIP)
        lines.append(f"| step ms | {1e3 * sim.step_time:.1f} | {1e3 * meas['step_time']:.1f} | "
                     f"{100 * (sim.step_time / meas['step_time'] - 1):+.0f}% |")
        for s in range(P):
            lines.append(f"| stage {s} idle | {sim.idle_frac[s]:.0%} | {meas['idle_frac'][s]:.0%} | "
                         f"{100 * (sim.idle_frac[s] - meas['idle_frac'][s]):+.0f} pts |")
    else:
        note = (f"(no timing rows: the run has {steps} step(s); step times are compared after the first "
                f"{TIMING_SKIP}, so a run of more than {TIMING_SKIP} steps is needed)")
    if os.path.isdir(os.path.join(run_dir, "memory")):  # a run with log.memory: its peaks per stage
        recs = read_memory(run_dir)
        pred = run_memory(cfg, run_dir, len(recs), use_cache=use_cache)
        for r in recs:
            p, m = pred[r["stage"]].total, r["peak"]["total"]
            lines.append(f"| rank {r['rank']} (stage {r['stage']}) peak MB | {p / 2**20:.1f} | {m / 2**20:.1f} | "
                         f"{100 * (p / m - 1):+.1f}% |")
    return "\n".join(lines + ([note] if steps <= TIMING_SKIP else []))


def weighed_table(plan) -> str:
    """The (cut, schedule) pairs the planner weighed: predicted step, its fullest stage's peak, whether it fits the
    memory budget; the chosen one marked."""
    lines = ["\n(cut, schedule) pairs weighed:", "| cut | stages | schedule | step ms | fullest stage MB | fits |",
             "|---|---|---|---|---|---|"]
    for r in plan.weighed or []:
        mark = " **chosen**" if r["parts"] == plan.parts and r["schedule"] == plan.order.name else ""
        lines.append(f"| {r['cut']} | {r['parts']} | {r['schedule']}{mark} | {1e3 * r['step_time']:.1f} | "
                     f"{r['peak_bytes'] / 2**20:.1f} | {'yes' if r['fits'] else 'no'} |")
    return "\n".join(lines)


def cmd_plan(args) -> int:
    log = lambda s: print(f"[plan] {s}", flush=True)  # noqa: E731
    if args.run:  # the run's own resolved config: its model, micro-batch, precision
        saved = os.path.join(args.run, "config.yaml")
        if not os.path.isfile(saved) or not os.path.isfile(os.path.join(args.run, "plan.json")):
            raise ConfigError(f"mmpipe plan --run {args.run}: no config.yaml/plan.json there (a pipelined run's output_dir)")
        cfg = load_config(args.config or saved, args.overrides)
        print(compare_with_run(cfg, args.run, use_cache=not args.no_cache, log=log))
        return 0
    cfg = load_config(args.config, args.overrides, weights=False)
    stages = args.stages or cfg.parallel.pipeline_stages
    if stages < 2:
        raise ConfigError("mmpipe plan: parallel.pipeline_stages is 1; give --stages P (P >= 2) to plan a pipeline")
    plan = plan_all(cfg, stages, args.dp, args.threads, use_cache=not args.no_cache, log=log)
    chosen = cfg.parallel.placement if cfg.parallel.placement in plan["placements"] else "auto"
    print(format_plan(plan, chosen, cfg.train.batch_size))
    t = plan["placements"][chosen]["stage_times"]
    per_rank = cfg.train.batch_size // args.dp
    M = plan["micro_batches"]
    scale = M  # stage times are per micro-batch of the configured size; rescale to the whole per-rank batch
    chosen_plan = plan["plans"][chosen]
    rec = recommend_micro_batches([f * scale for f in t["F"]], [b * scale for b in t["B"]],
                                  [c * scale for c in t["comm"]], t["opt"], per_rank, args.target_bubble,
                                  W=[w * scale for w in t["W"]], order=chosen_plan.order)
    if rec["best"]:
        b = rec["best"]
        print(f"\nrecommended: {b['micro_batches']} micro-batches of {b['micro_batch_size']} "
              f"(bubble {b['bubble']:.0%} <= {args.target_bubble:.0%}, by the simulator with linearly scaled times)")
    else:
        print("\n" + rec["why"])
    out = args.out or os.path.join(cfg.train.output_dir, "plan")
    os.makedirs(out, exist_ok=True)
    chosen_plan.predicted = {k: v["sim"] for k, v in plan["placements"].items()}
    print(f"\npipeline schedule: {chosen_plan.order.name}" + (" (parallel.schedule=auto)" if cfg.parallel.schedule
                                                              == "auto" else "") + "; predicted step " + ", ".join(
        f"{k} {1e3 * v:.1f} ms" for k, v in (chosen_plan.schedules or {}).items()))
    print(weighed_table(chosen_plan))
    chosen_plan.write(os.path.join(out, "plan.json"))
    write_plan_png(os.path.join(out, "plan.png"), plan)
    print(f"\nwrote {out}/plan.json (train with --set parallel.plan={out}/plan.json) and {out}/plan.png")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="profile the layers, place the pipeline stages, predict the schedule")
    p.add_argument("--config", "-c")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--stages", type=int, help="P (default: parallel.pipeline_stages)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree the run will use")
    p.add_argument("--world", type=int, help="instead: predict every layout of N ranks (data parallel with ZeRO "
                   "0-3, every pipeline P dividing N, P x DP) and mark the fastest that fits")
    p.add_argument("--memory-gb", type=float, help="with --world: per-rank memory budget (default: "
                   "parallel.memory_budget_gb, else the device's memory; CPU: RAM / N)")
    p.add_argument("--meta", action="store_true", help="with --world: size the model on the meta device (memory "
                   "only; the default above 100M parameters)")
    p.add_argument("--gpu-kernels", action="store_true", help="sized on the meta device: price dropout and AdamW's "
                   "step as a GPU runs them (a one-byte mask; optim.fused's default) when planning on a CPU host for "
                   "GPUs (default: as this host runs them); implies --meta")
    p.add_argument("--threads", type=int, help="threads per rank (default: cores / ranks, as training sets)")
    p.add_argument("--target-bubble", type=float, default=0.15, help="bubble the micro-batch recommendation aims under")
    p.add_argument("--run", help="a finished run's output dir: print predicted beside measured")
    p.add_argument("--out", help="where plan.json and plan.png go (default: OUTPUT_DIR/plan)")
    p.add_argument("--no-cache", action="store_true", help="profile again even if a cached profile matches")
    p.set_defaults(func=cmd_plan)
    return p


def cmd_plan_any(args) -> int:
    """``mmpipe plan``: one pipeline's placements (``mmpipe.planning.measure``), or with --world every layout
    of N ranks (``mmpipe.planning.layouts``)."""
    if args.world is not None and args.world < 1:
        raise ConfigError(f"mmpipe plan --world {args.world}: give the number of ranks, 1 or more")
    if args.memory_gb is not None and args.memory_gb <= 0:
        raise ConfigError(f"mmpipe plan --memory-gb {args.memory_gb:g}: give the memory per rank in GB, more than 0 "
                          "(or leave it out: parallel.memory_budget_gb, else the device's memory)")
    if args.world and not args.run:
        return cmd_plan_world(args)
    return cmd_plan(args)
