"""``mmpipe bench balance``: measured stage placements against DeepSpeed's partition methods."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import sys

from mmpipe.bench.common import ROOT, append_benchmarks, launch, pooled, with_scratch
from mmpipe.config.registry import get_family
from mmpipe.config.schema import family_of, load_config
from mmpipe.data.cache import prepare
from mmpipe.data.synth import MIXED_SIZES, synth, synth_skewed_chat, synth_vlm
from mmpipe.parallel.plan import Plan
from mmpipe.planning.charts import write_plan_png
from mmpipe.planning.offline import median_profile, plan_all, single_process_time
from mmpipe.planning.place import layer_costs, predict
from mmpipe.train.metrics import measured_from_run, read_metrics


def _balance_rounds(args, title: str, config: str, common: list, placements: list, extra: list, vlm_vocab,
                    tmp: str, slug: str, resample) -> dict:
    """``args.rounds`` interleaved rounds of the single process and every placement (``resample()``
    before every round but the first); {variant: its run dirs, one per round}."""
    runs: dict = {}
    for rnd in range(args.rounds):
        if rnd:
            resample()
        for pl in ["single"] + placements:
            print(f"[bench] {title}: {pl} (round {rnd + 1}/{args.rounds}) ...", flush=True)
            out = os.path.join(tmp, f"{slug}_{pl}_{rnd}")
            if pl == "single":
                launch(1, config, common + ["parallel.pipeline_stages=1"], out)
            else:
                sets = common + ["parallel.pipeline_stages=2", f"parallel.placement={pl}"]
                if pl == "auto" and not extra:
                    sets.append(f"log.trace=[{args.steps - 1},{args.steps}]")
                if vlm_vocab:  # a tokenizer trained per run: the same data gives the same one
                    sets.append(f"data.tokenizer_vocab_size={vlm_vocab}")
                launch(2, config, sets, out)
            runs.setdefault(pl, []).append(out)
    return runs


def _balance_model(args, title: str, config: str, extra: list, info: dict, tmp: str, art: str) -> tuple:
    """One model of ``bench balance``: every placement and the single process, median over the rounds.
    Returns (markdown table, {variant: step seconds})."""
    import json

    cfg = load_config(config, extra)
    vlm = family_of(cfg).data_format == "chat"
    if vlm:  # chat data is read as it is (the VLM has no cache)
        common = [f"data.train={info['train']}", "data.val=null", f"train.steps={args.steps}"] + extra
    else:
        size = family_of(cfg).pixels(cfg.model, cfg.data).size
        cache = os.path.join(tmp, f"cache{size}")
        if not os.path.isdir(cache):
            prepare(info["train"], cache, size, cfg.data.max_length, vocab_size=cfg.data.tokenizer_vocab_size,
                    workers=2, progress=False)
        common = [f"data.cache={cache}", "data.train=null", "data.val=null", f"train.steps={args.steps}"] + extra
    # a fresh profile (also cached for the runs' own placement decisions), taken next to the runs, and
    # sampled again (uncached) beside every later round: the predictions use each layer's median
    run_cfg, log = load_config(config, extra + common), (lambda s: print(f"[bench] {s}", flush=True))
    plan = plan_all(run_cfg, 2, threads=1, refresh=True, repeats=9, log=log)
    samples = [plan["profile"]]
    M = plan["micro_batches"]
    batch = cfg.train.batch_size
    placements = (["modality", "balanced", "auto"] if vlm else
                  ["modality", "parameters", "uniform", "balanced", "auto"] if not extra else ["modality", "parameters", "auto"])
    slug = re.sub(r"\W+", "_", title).strip("_")
    runs = _balance_rounds(args, title, config, common, placements, extra, vlm and cfg.data.tokenizer_vocab_size,
                           tmp, slug, lambda: samples.append(plan_all(run_cfg, 2, threads=1, use_cache=False,
                                                                      repeats=9, log=log)["profile"]))
    single = pooled(runs["single"], args.warmup)[0]
    if len(samples) > 1:
        plan = plan_all(run_cfg, 2, threads=1, profile=median_profile(samples), log=log)
    rows, measured = [], {}
    for pl in placements:
        st, out, _ = pooled(runs[pl], args.warmup)
        meas = {**measured_from_run(out, skip=args.warmup), "step_time": st}
        with open(os.path.join(out, "plan.json")) as fh:
            run_plan = Plan.from_json(json.load(fh))
        parts = run_plan.parts
        sim = predict(plan["profile"], parts, M, run_plan.order)
        measured[pl] = meas["step_time"]
        rows.append((pl, parts, meas, sim))
        if pl == "auto" and not extra:
            for f in ("trace.json", "timeline.png"):
                if os.path.isfile(os.path.join(out, f)):
                    shutil.copy(os.path.join(out, f), os.path.join(art, f"balance_{slug}_auto_{f}"))
    write_plan_png(os.path.join(art, f"balance_{slug}.png"), plan, measured)
    mod = measured["modality"]
    share = ""
    if vlm:  # the vision tower's share of the profiled step (forward + backward)
        share = f"; vision tower {vision_share(plan):.0%} of the single-process step"
    lines = [f"**{title}** ({', '.join(extra) or 'all trainable'}; predicted single process "
             f"{1e3 * single_process_time(plan['profile'], M):.0f} ms, measured {1e3 * single:.0f} ms per step{share})", "",
             "| placement | stage sizes | samples/s | vs single process | vs modality | step ms predicted / measured "
             "| error | idle per stage predicted / measured |", "|---|---|---|---|---|---|---|---|"]
    lines.append(f"| single process, 1 thread | 1 stage | {batch / single:.1f} | 1.00x | | | | |")
    for pl, parts, meas, sim in rows:
        st = meas["step_time"]
        idle = ", ".join(f"{p:.0%} / {m:.0%}" for p, m in zip(sim.idle_frac, meas["idle_frac"]))
        sizes = "+".join(str(b - a) for a, b in zip(parts, parts[1:]))
        lines.append(f"| {pl} | {sizes} | {batch / st:.1f} | {single / st:.2f}x | {mod / st:.2f}x | "
                     f"{1e3 * sim.step_time:.0f} / {1e3 * st:.0f} | {100 * (sim.step_time / st - 1):+.0f}% | {idle} |")
    table = "\n".join(lines)
    print(table, flush=True)
    return table, {pl: meas["step_time"] for pl, _, meas, _ in rows} | {"single": single}


def vision_share(plan: dict) -> float:
    """The vision tower's share (forward + backward) of the profiled single-process compute."""
    costs = layer_costs(plan["profile"])
    t = [c.fwd_ms + c.bwd_ms for c in costs]
    return sum(x for n, x in zip(plan["names"], t) if n.startswith("vision.")) / sum(t)


@with_scratch("balance")
def bench_balance(args, tmp: str) -> int:
    """Samples/s of every placement on an image-heavy and a text-heavy dual encoder (P = 2, 1 thread
    per rank), against the single-process baseline (1 thread, same model and batch), with the
    simulator's prediction beside each measurement."""
    os.environ["OMP_NUM_THREADS"] = "1"  # every rank (and the baseline) computes on one thread
    print(f"[bench] synthetic data and caches in {tmp} ...", flush=True)
    art = os.path.join(os.getcwd(), "benchmarks")
    os.makedirs(art, exist_ok=True)
    if getattr(args, "mix", None) == "skewed":
        return _balance_skewed(args, tmp, art)
    fam = get_family(args.model, "--model")
    if fam.data_format == "chat" and fam.pixels(fam.config_class(), None).cache_size is None:
        return _balance_native(args, tmp, art)
    if fam.data_format == "chat":
        # every sample has an image (the tower runs in every micro-batch, at its profiled cost)
        info = synth_vlm(os.path.join(tmp, "chat"), args.n, val_fraction=0.0, size=64, seed=0, text_only=0.0,
                         progress=False)
        table, s = _balance_model(args, "VLM, image-heavy", os.path.join(ROOT, "configs", "bench_vlm.yaml"), [],
                                  info, tmp, art)
        notes = (f"2 ranks x 1 thread (OMP_NUM_THREADS=1), {args.steps} steps per run, median step after the first "
                 f"{args.warmup}, pooled over {args.rounds} interleaved rounds per variant; micro-batch 4 x 8 per step; "
                 f"ms-swift JSONL chat data read as is (every sample one 64 px image = 64 image tokens, answers of "
                 f"1-4 words, padded to data.max_length = 96, the shape the profile measures). modality = vision + "
                 f"projector | decoder (what Megatron, "
                 f"torchtitan and ms-swift do before hand-tuning the first stage's decoder layers); auto = the "
                 f"simulator's faster split. auto vs modality {s['modality'] / s['auto']:.2f}x. With padding per "
                 f"micro-batch (data.padding=batch, the default) sequences are shorter than the profiled "
                 f"max_length and the decoder stages cheaper than predicted (a first run so padded measured auto "
                 f"1.02x vs modality against 1.12x predicted). Chart: "
                 f"benchmarks/balance_VLM_image_heavy.png.")
        return _report_balance(args, "Stage balance: VLM, modality vs auto", table, notes)
    info = synth(os.path.join(tmp, "data"), args.n, val_fraction=0.0, size=96, seed=0, progress=False)
    models = [("image-heavy", os.path.join(ROOT, "configs", "bench_image_heavy.yaml"), []),
              ("text-heavy", os.path.join(ROOT, "configs", "bench_text_heavy.yaml"), [])]
    if not args.no_frozen:
        models.append(("image-heavy, vision frozen", os.path.join(ROOT, "configs", "bench_image_heavy.yaml"),
                       ["optim.freeze_vision=true"]))
    sections, summary = [], {}
    for title, config, extra in models:
        table, summary[title] = _balance_model(args, title, config, extra, info, tmp, art)
        sections.append(table)
    table = "\n\n".join(sections)
    s = summary["image-heavy"]
    notes = (f"2 ranks x 1 thread (OMP_NUM_THREADS=1), {args.steps} steps per run, median step after the first "
             f"{args.warmup}, pooled over {args.rounds} interleaved rounds per variant (this VM's speed drifts by "
             f"10-40% over minutes); micro-batch 4 x 8 per step; data from the preprocessed cache (loading is not the "
             f"bottleneck). Predictions: `mmpipe plan`'s simulator replaying DeepSpeed's 1F1B instruction streams "
             f"with the profiled layer times (each layer's median over {args.rounds} profiles, one taken beside each "
             f"round); measured idle from the per-instruction stage clock. Targets "
             f"(image-heavy): auto vs modality {s['modality'] / s['auto']:.2f}x (>= 1.3), auto vs DeepSpeed parameters "
             f"{s['parameters'] / s['auto']:.2f}x (>= 1.1), best 2-stage vs single process "
             f"{s['single'] / min(s[p] for p in s if p != 'single'):.2f}x (>= 1.6; 1F1B limit 1.78). Charts: "
             f"benchmarks/balance_*.png (bars: predicted busy/idle per stage, dashes: measured step); trace of the "
             f"image-heavy auto run: benchmarks/balance_image_heavy_auto_trace.json (ui.perfetto.dev) and "
             f"_timeline.png.")
    return _report_balance(args, "Stage balance: placements vs single process", table, notes)


def _balance_native(args, tmp: str, art: str) -> int:
    """A native-resolution chat family (``--model qwen2_5_vl``) on chat data of mixed image sizes, one
    image per sample: modality vs the balanced and auto placements, against the single process."""
    info = synth_vlm(os.path.join(tmp, "chat"), args.n, val_fraction=0.0, size=56, seed=0, text_only=0.0,
                     progress=False, sizes=MIXED_SIZES)
    table, s = _balance_model(args, f"{args.model}, mixed image sizes",
                              os.path.join(ROOT, "configs", f"bench_{args.model}.yaml"), [], info, tmp, art)
    notes = (f"2 ranks x 1 thread (OMP_NUM_THREADS=1), {args.steps} steps per run, median step after the first "
             f"{args.warmup}, pooled over {args.rounds} interleaved rounds per variant; micro-batch 4 x 8 per step; "
             f"chat data read as is, every sample one image of {len(MIXED_SIZES)} sizes "
             f"({', '.join(f'{w}x{h}' for w, h in MIXED_SIZES)} px: 4 to 64 image tokens), padded to "
             f"data.max_length; the profile times the data's own image sizes (four groups by token count), "
             f"memory at data.max_pixels. auto vs modality {s['modality'] / s['auto']:.2f}x.")
    return _report_balance(args, f"Stage balance: {args.model} at native resolution, modality vs auto", table, notes)


def _report_balance(args, title: str, table: str, notes: str) -> int:
    print(notes)
    if not args.no_append:
        cmd = "mmpipe bench balance " + " ".join(shlex.quote(a) for a in sys.argv[3:])
        append_benchmarks(title, cmd, table, notes)
    return 0


SKEWED_LAYOUTS = (("P = 2", 2, ["parallel.pipeline_stages=2"]), ("DP = 2", 2, ["parallel.pipeline_stages=1"]),
                  ("P2 x DP2", 4, ["parallel.pipeline_stages=2"]),
                  ("P = 2, packed", 2, ["parallel.pipeline_stages=2", "data.packing=true"]),
                  # the objective weighing evenness 16x more: its data.balance=none is the P = 2 row's
                  ("P = 2, evenness 4", 2, ["parallel.pipeline_stages=2", "data.balance_evenness=4"]))
SAME_NONE = {"P = 2, evenness 4": "P = 2"}


def _balance_skewed(args, tmp: str, art: str) -> int:
    """``--mix skewed``: the VLM on a skewed chat mix (``synth_skewed_chat``), ``data.balance`` none vs
    cost at P = 2, DP = 2 and P2 x DP2, side by side in interleaved rounds: samples/s, measured stage idle, the
    predicted slot spread and step over the balanced ideal; a timeline of a step of each at P = 2."""
    import statistics

    info = synth_skewed_chat(os.path.join(tmp, "skewed"), args.n, size=64, seed=0)
    config = os.path.join(ROOT, "configs", "bench_vlm.yaml")
    common = [f"data.train={info['train']}", "data.val=null", f"train.steps={args.steps}", "data.padding=batch",
              "data.max_length=288", "parallel.placement=auto"]
    runs: dict = {}
    for rnd in range(args.rounds):
        for name, n, sets in SKEWED_LAYOUTS:
            for bal in ("none", "cost"):
                if bal == "none" and name in SAME_NONE:
                    continue
                print(f"[bench] skewed mix, {name}, data.balance={bal} (round {rnd + 1}/{args.rounds}) ...", flush=True)
                out = os.path.join(tmp, re.sub(r"\W+", "_", f"skewed_{n}_{name}_{bal}_{rnd}"))
                extra = ([f"log.trace=[{args.steps - 1},{args.steps - 1}]"] if rnd == 0 and name == "P = 2" else [])
                refit = ["data.balance_refit=3"] if bal == "cost" else []  # (8 steps: refit at steps 3 and 6)
                launch(n, config, common + sets + [f"data.balance={bal}"] + refit + extra, out)
                runs.setdefault((name, bal), []).append(out)
                if extra and os.path.isfile(os.path.join(out, "timeline.png")):
                    shutil.copy(os.path.join(out, "timeline.png"), os.path.join(art, f"balance_skewed_{bal}_timeline.png"))
    lines = ["| layout | data.balance | samples/s | vs none | step ms | measured idle per stage | predicted slot "
             "spread (max / mean) | predicted step / balanced ideal | padding |", "|---|---|---|---|---|---|---|---|---|"]
    gains, errors = {}, {}
    for name, _, sets in SKEWED_LAYOUTS:
        base = pooled(runs[(SAME_NONE[name], "none")], args.warmup)[0] if name in SAME_NONE else None
        for bal in ("none", "cost"):
            if bal == "none" and name in SAME_NONE:
                continue
            st, out, _ = pooled(runs[(name, bal)], args.warmup)
            base = base or st
            recs = [r for d in runs[(name, bal)] for r in read_metrics(os.path.join(d, "metrics.jsonl"))[args.warmup:]]
            meas = measured_from_run(runs[(name, bal)][0], skip=args.warmup)
            idle = ", ".join(f"{x:.0%}" for x in meas["idle_frac"]) or "-"
            pad = statistics.mean(r.get("pad_fraction", 0.0) for r in recs)
            if bal == "cost":
                spread = f"{statistics.mean(r['spread_before'] for r in recs):.2f} -> " \
                         f"{statistics.mean(r['spread_after'] for r in recs):.2f}"
                fits = [r for d in runs[(name, bal)] for r in read_metrics(os.path.join(d, "metrics.jsonl"), "refit")]
                if fits:  # the prices' prediction error per micro-batch, profile vs refit (the last fit of each run)
                    last = [f for f in fits if f["step"] == max(x["step"] for x in fits)]
                    errors[name] = (statistics.mean(sum(f["error_before"]) / len(f["error_before"]) for f in last),
                                    statistics.mean(sum(f["error_after"]) / len(f["error_after"]) for f in last))
                ideal = f"{statistics.mean(r['over_ideal'] for r in recs):.2f}"
                gains[name] = base / st
            else:
                spread = ideal = "-"
            sps = statistics.median(r["samples_per_sec"] for r in recs)  # (a packed step: its packs' samples)
            lines.append(f"| {name} | {bal} | {sps:.1f} | {base / st:.2f}x | {1e3 * st:.0f} | {idle} | {spread} "
                         f"| {ideal} | {pad:.0%} |")
    rtable, rnote = _replan_side_by_side(args, tmp, art)
    table = "\n".join(lines) + "\n\n" + rtable
    print(table, flush=True)
    notes = (f"configs/bench_vlm.yaml (LLaVA-style: CLIP ViT over 64 patches, Llama decoder) with data.padding=batch, "
             f"data.max_length=288, parallel.placement=auto; {args.n} samples of a skewed chat mix: 10% one text "
             f"question, 30% text conversations of 6-10 turns, 35% one image, 25% 2-4 images (64 image tokens each). "
             f"2 ranks x 1 thread (P2 x DP2: 4 ranks on the 2 cores), {args.steps} steps per run, median step after the first {args.warmup}, pooled over "
             f"{args.rounds} interleaved rounds; global batch 32 of micro-batch 4 (packed: 32 rows of up to 288 tokens, "
             f"samples/s counts the samples in them). data.balance=cost regroups each "
             f"step's samples (the same samples: the same loss; micro-batches of any size, none heavier than the "
             f"step's heaviest plain one) by the plan's per-layer prices, refit every 3 steps from the stage clock "
             f"(data.balance_refit=3; mean prediction error per micro-batch, profile -> refit: "
             + ", ".join(f"{k} {a:.2f} -> {b:.2f}" for k, (a, b) in errors.items()) + "); gains: "
             + ", ".join(f"{k} {v:.2f}x" for k, v in gains.items()) + ". The spread at DP = 2 (one stage, ZeRO-0) is the "
             "ranks' (a rank's micro-batches run back to back; the ranks meet at the gradient reduction); the "
             "evenness 4 row weighs the spread 16x more than the default 0.25 (data.balance_evenness), against the "
             "P = 2 none runs. Timelines of one P = 2 step: "
             "benchmarks/balance_skewed_none_timeline.png and _cost_timeline.png. " + rnote)
    return _report_balance(args, "Cost-balanced micro-batches and re-planning: skewed VLM mix, none vs cost; "
                                 "a poor cut with replan off vs auto", table, notes)


def _replan_side_by_side(args, tmp: str, art: str) -> tuple:
    """The text-heavy dual encoder started on ``modality`` (its text stage paces every step) with
    ``parallel.replan`` off and auto, interleaved rounds: where auto moved, its steps after the move
    against the same steps of the run that stayed, and the two runs' losses."""
    import statistics

    info = synth(os.path.join(tmp, "replan_data"), args.n, val_fraction=0.0, size=32, seed=0, progress=False)
    config = os.path.join(ROOT, "configs", "bench_text_heavy.yaml")
    cfg = load_config(config)
    cache = os.path.join(tmp, "replan_cache")
    prepare(info["train"], cache, 32, cfg.data.max_length, vocab_size=cfg.data.tokenizer_vocab_size, workers=2,
            progress=False)
    steps = max(args.steps, 16)
    common = [f"data.cache={cache}", "data.train=null", "data.val=null", f"train.steps={steps}",
              "parallel.placement=modality", "parallel.pipeline_stages=2"]
    runs: dict = {}
    for rnd in range(args.rounds):
        for mode in ("off", "auto"):
            print(f"[bench] re-plan from modality (text-heavy), replan={mode} (round {rnd + 1}/{args.rounds}) ...",
                  flush=True)
            out = os.path.join(tmp, f"replan_{mode}_{rnd}")
            launch(2, config, common + [f"parallel.replan={mode}"], out)
            runs.setdefault(mode, []).append(out)
    rows, after, stayed, diffs, moved_at = [], [], [], [], []
    for a, b in zip(runs["auto"], runs["off"]):
        moves = read_metrics(os.path.join(a, "metrics.jsonl"), "replan")
        ra, rb = read_metrics(os.path.join(a, "metrics.jsonl")), read_metrics(os.path.join(b, "metrics.jsonl"))
        diffs.append(max(abs(x["loss"] / y["loss"] - 1) for x, y in zip(ra, rb)))
        if moves:
            k = moves[0]["step"]
            moved_at.append((k, moves[0]["old_parts"], moves[0]["new_parts"]))
            after += [r["step_time"] for r in ra if r["step"] > k + 2]  # the first steps of the new processes warm up
            stayed += [r["step_time"] for r in rb if r["step"] > k + 2]
    cfg_b = load_config(config, common).train.batch_size
    lines = ["| replan | moved at step (cut) | samples/s after the move | vs off | losses vs off (max rel. diff) |",
             "|---|---|---|---|---|"]
    if after:
        ta, tb = statistics.median(after), statistics.median(stayed)
        where = "; ".join(f"{k} ({o} -> {n})" for k, o, n in moved_at)
        lines += [f"| off | - | {cfg_b / tb:.1f} | 1.00x | - |",
                  f"| auto | {where} | {cfg_b / ta:.1f} | {tb / ta:.2f}x | {max(diffs):.1e} |"]
        note = (f"Re-planning: configs/bench_text_heavy.yaml (CLIP, 10 text blocks vs 2 vision) from "
                f"parallel.placement=modality, {steps} steps, replan off vs auto in {args.rounds} interleaved rounds; "
                f"the steps after the move (skipping the new processes' first two) against the same steps of the run "
                f"that stayed: {tb / ta:.2f}x; losses max relative difference {max(diffs):.1e}.")
    else:
        lines.append(f"| auto | never moved | - | - | {max(diffs):.1e} |")
        note = "Re-planning: the auto runs never moved."
    return "\n".join(lines), note
