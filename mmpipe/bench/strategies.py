"""``mmpipe bench strategies``: every layout of N ranks, predicted against measured."""
from __future__ import annotations

import os
import re
import shlex
import sys

from mmpipe.bench.common import ROOT, append_benchmarks, launch, pooled, with_scratch
from mmpipe.config.schema import load_config
from mmpipe.data.cache import prepare
from mmpipe.data.synth import synth
from mmpipe.parallel.topology import threads_per_rank
from mmpipe.planning.charts import write_png
from mmpipe.planning.collectives import CommModel, comm_group_sizes, get_comm_model
from mmpipe.planning.layouts import plan_layouts
from mmpipe.planning.memory import optimizer_state_bytes
from mmpipe.planning.offline import median_profile
from mmpipe.planning.place import layer_costs
from mmpipe.train.metrics import measured_from_run, read_memory_record


def _layout_sets(row) -> list:
    sets = [f"parallel.pipeline_stages={row.pipeline_stages}", f"parallel.zero_stage={row.zero_stage}",
            f"parallel.expert_parallel={row.expert_parallel}"]
    if row.pipeline_stages > 1:
        sets.append(f"parallel.placement={(row.placement or 'modality').split(':')[0]}")
    return sets


def _strategies_table(world: int, res: dict, rows: list, measured: dict, mem: dict, batch: int, single: float,
                      art: str, summary: list, rounds: dict) -> list:
    """Markdown lines of one world size: predicted beside measured per layout, the ranking verdict, PNG."""
    costs, precision = layer_costs(res["profile"]), res["precision"]
    lines = [f"**{world} rank(s)** ({res['threads']} thread(s) per rank on {os.cpu_count()} cores; "
             f"chosen by the cost model: {res['chosen'].name})", "",
             "| layout | step ms predicted / measured | error | rounds: slowest / fastest | samples/s measured | "
             "vs single process | idle predicted / measured | optimizer state MB predicted / measured | max RSS MB | "
             "clipping |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: measured[r.name]["step_time"]):
        m = measured[r.name]
        st = m["step_time"]
        idle = (sum(m["idle_frac"]) / len(m["idle_frac"])) if m["idle_frac"] else 0.0
        opt_p = optimizer_state_bytes(costs, precision, r.zero_stage, r.data_parallel, r.parts) / 2**20
        mark = " **chosen**" if r.name == res["chosen"].name else ""
        lines.append(f"| {r.name}{mark} | {1e3 * r.step_time:.0f} / {1e3 * st:.0f} | "
                     f"{100 * (r.step_time / st - 1):+.0f}% | {max(rounds[r.name]) / min(rounds[r.name]):.2f}x | "
                     f"{batch / st:.1f} | {single / st:.2f}x | "
                     f"{r.bubble:.0%} / {idle:.0%} | {opt_p:.1f} / {mem[r.name][0]:.1f} | {mem[r.name][1]} | "
                     f"{r.clipping} |")
    if world == 1:
        return lines
    meas = {r.name: measured[r.name]["step_time"] for r in rows}
    pred_rank = sorted(rows, key=lambda r: r.step_time)
    swaps = [(a.name, b.name) for i, a in enumerate(pred_rank) for b in pred_rank[i + 1:]
             if meas[a.name] > meas[b.name] * 1.10]  # predicted faster, measured >10% slower
    errors = [abs(r.step_time / meas[r.name] - 1) for r in rows]
    spread = max(max(rounds[r.name]) / min(rounds[r.name]) for r in rows)
    ranking = "matches" if not swaps else "swapped pairs beyond 10%: " + ", ".join(f"{a} before {b}" for a, b in swaps)
    verdict = (f"ranking: {ranking}; chosen layout {meas[res['chosen'].name] / min(meas.values()):.2f}x the fastest "
               f"measured ({min(meas, key=meas.get)}); prediction error max {100 * max(errors):.0f}%, mean "
               f"{100 * sum(errors) / len(errors):.0f}%; the same layout's rounds differ by up to "
               f"{100 * (spread - 1):.0f}%")
    summary.append(f"{world} ranks: {verdict}")
    write_png(os.path.join(art, f"strategies_{world}ranks.png"), rows, res["chosen"], meas,
              title=f"{world} ranks: step time per layout, predicted vs measured (green: chosen)")
    return lines + ["", verdict]


@with_scratch("strategies")
def bench_strategies(args, tmp: str) -> int:
    """The same model, data and global batch on 1, 2 and 4 ranks in every layout: measured step,
    samples/s, stage idle and memory beside the cost model's predictions (``mmpipe.planning.layouts``)."""
    art = os.path.join(os.getcwd(), "benchmarks")
    os.makedirs(art, exist_ok=True)
    print(f"[bench] synthetic data and cache in {tmp} ...", flush=True)
    info = synth(os.path.join(tmp, "data"), args.n, val_fraction=0.0, size=96, seed=0, progress=False)
    config = args.config
    base = load_config(config)
    cache = os.path.join(tmp, "cache")
    prepare(info["train"], cache, base.model.vision.image_size or 96, base.data.max_length,
            vocab_size=base.data.tokenizer_vocab_size, workers=2, progress=False)
    common = [f"data.cache={cache}", "data.train=null", "data.val=null", f"train.steps={args.steps}"]
    cfg = load_config(config, common)
    batch = cfg.train.batch_size
    log = lambda m: print(f"[bench] {m}", flush=True)  # noqa: E731
    sections, summary, refreshed = [], [], set()
    for world in [1] + list(args.worlds):
        # --refresh: one fresh profile per thread count and one timing per set of group sizes
        threads, sizes = threads_per_rank(world), tuple(comm_group_sizes(world))
        res = plan_layouts(cfg, world, log=log, refresh=args.refresh and threads not in refreshed,
                           refresh_comm=args.refresh and sizes not in refreshed)
        refreshed |= {threads, sizes}
        rows = [r for r in res["rows"] if r.micro_batches and r.fits]
        runs, samples = {}, [res]
        for rnd in range(args.rounds):
            if rnd:  # the profile and the collectives sampled again beside every round's runs
                log(f"{world} rank(s): profile{'' if world == 1 else ' and collectives'} again (round {rnd + 1}/{args.rounds}) ...")
                comm = res["comm"] if world == 1 else get_comm_model(list(sizes), use_cache=False, log=log)
                samples.append(plan_layouts(cfg, world, log=log, use_cache=False, comm=comm))
            for r in rows:
                log(f"{world} rank(s): {r.name} (round {rnd + 1}/{args.rounds}) ...")
                out = os.path.join(tmp, f"w{world}_{re.sub(r'[^A-Za-z0-9]+', '_', r.name)}_{rnd}")
                launch(world, config, common + _layout_sets(r), out)
                runs.setdefault(r.name, []).append(out)
        if len(samples) > 1:  # predictions from the medians of the rounds' profiles and collectives
            res = plan_layouts(cfg, world, log=log, profile=median_profile([x["profile"] for x in samples]),
                               comm=CommModel.median([x["comm"] for x in samples]))
            ran = {r.name for r in rows}
            rows = [r for r in res["rows"] if r.name in ran]
        measured, mem, rounds = {}, {}, {}
        for r in rows:
            st, out, rounds[r.name] = pooled(runs[r.name], args.warmup)
            measured[r.name] = {**measured_from_run(out, skip=args.warmup), "step_time": st}
            ranks = read_memory_record(out)  # every rank's figures after the first step (metrics.jsonl)
            mem[r.name] = (max((x["optimizer_state_mb"] for x in ranks), default=float("nan")),
                           max((round(x["peak_mb"]) for x in ranks if x["peak_of"] == "max_rss"), default=0))
        if world == 1:
            single = measured[rows[0].name]["step_time"]
        lines = _strategies_table(world, res, rows, measured, mem, batch, single, art, summary, rounds)
        table = "\n".join(lines)
        print(table, flush=True)
        sections.append(table)
    notes = (f"Image-heavy dual encoder (`{os.path.relpath(config, ROOT)}`), global batch {batch}, micro-batch "
             f"{cfg.parallel.micro_batch_size}, {args.steps} steps per run, median step after the first {args.warmup}, "
             f"median over the steps of {args.rounds} interleaved round(s); data from the preprocessed cache. Threads per rank as training sets "
             f"them (cores / ranks, at least 1: 4 ranks on 2 cores oversubscribe 2x, which the model charges as "
             f"stretched compute). Predictions: `mmpipe.planning.layouts` from the layer profile and the collective "
             f"micro-benchmark (gloo), both sampled once per round beside that round's runs, each figure the "
             f"median of the {args.rounds} samples (this host's speed drifts over minutes; one sample carries "
             f"that drift into every prediction). Clipping: 'grouped' = mmpipe's per-group norms "
             f"(computed every step); 'DeepSpeed global' = ZeRO-2/3, where DeepSpeed owns the (here disabled) "
             f"clip. max RSS includes the Python/torch runtime (~0.7 GB per process). Charts: "
             f"benchmarks/strategies_*ranks.png. " + " ".join(summary))
    print(notes)
    if not args.no_append:
        cmd = "mmpipe bench strategies " + " ".join(shlex.quote(a) for a in sys.argv[3:])
        append_benchmarks("Layouts: data parallel vs pipeline vs both, predicted and measured", cmd,
                          "\n\n".join(sections), notes)
    return 0
