"""``mmpipe bench ...``: measured comparisons, printed as a table and appended to BENCHMARKS.md
with the exact command, the machine, and ratios against a baseline measured in the same run.

    mmpipe bench groups    # grouped clipping cost and frozen-tower memory, P = 2 demo model
    mmpipe bench data      # images/s: naive loading vs mmpipe's direct path vs its preprocessed cache
    mmpipe bench balance   # samples/s of every stage placement vs the single-process baseline
    mmpipe bench strategies  # every layout at 1, 2, 4 ranks: measured beside the layout cost model
"""
from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def machine() -> str:
    import deepspeed
    import torch
    return (f"{os.cpu_count()} cores, {torch.get_num_threads()} torch threads in this process "
            f"(1 per rank when 2 ranks share 2 cores), torch {torch.__version__}, deepspeed {deepspeed.__version__}, "
            f"python {sys.version.split()[0]}")


def launch(nprocs: int, config: str, sets: list, out: str) -> str:
    cmd = [shutil.which("deepspeed") or "deepspeed", "--num_gpus", str(nprocs), os.path.join(ROOT, "launch", "train.py"),
           "--config", config, "--set", f"train.output_dir={out}", "--set", "log.progress=false", "--overwrite"]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=os.getcwd())
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise SystemExit(f"mmpipe bench: run failed: {' '.join(cmd)}\n{tail}")
    return proc.stdout + proc.stderr


def _steps(out: str, warmup: int) -> list:
    from mmpipe.train.metrics import read_metrics
    return read_metrics(os.path.join(out, "metrics.jsonl"))[warmup:]


def pooled(outs: list, warmup: int) -> tuple:
    """Repeated runs of one variant: the median step over every run's steps after ``warmup`` (so a
    round caught in one of this machine's slow or fast spells weighs only its share), the run whose
    own median is the middle one (for its idle and memory figures), and each run's median."""
    per = {o: [r["step_time"] for r in _steps(o, warmup)] for o in outs}
    meds = {o: statistics.median(v) for o, v in per.items()}
    mid = sorted(outs, key=meds.get)[(len(outs) - 1) // 2]
    return statistics.median([t for v in per.values() for t in v]), mid, [meds[o] for o in outs]


def append_benchmarks(title: str, command: str, table: str, notes: str) -> None:
    path = os.path.join(os.getcwd(), "BENCHMARKS.md")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    with open(path, "a") as fh:
        fh.write(f"\n## {title} ({stamp})\n\n`{command}`\n\nMachine: {machine()}\n\n{table}\n\n{notes}\n")
    print(f"appended to {path}")


# (label, settings): the baseline sets no clip limit, but mmpipe takes every group's norm each step
# anyway (a non-finite one skips the step), so the rows differ by the clipping and freezing alone
GROUP_VARIANTS = [
    ("baseline: no clip limits (norms still taken for the skip check)", []),
    ("grouped clipping (4 groups + global)", [f"optim.groups.{g}.max_grad_norm=0.5" for g in
                                             ("vision", "projector", "text", "logit_scale")]
     + ["optim.max_grad_norm=1.0"]),
    ("grouped clipping + frozen vision tower", ["optim.groups.text.max_grad_norm=0.5", "optim.freeze_vision=true"]),
]


def bench_groups(args) -> int:
    """Baseline (no clip limits: the per-group norms are still taken every step, since a non-finite
    one skips the step) vs grouped clipping (4 groups + global) vs frozen vision."""
    config = args.config
    steps = args.steps
    base = [f"train.steps={steps}", "train.eval_every=0", "data.val=null", f"train.save_every={steps * 10}"]
    variants = GROUP_VARIANTS
    rows = []
    tmp = tempfile.mkdtemp(prefix="mmpipe-bench-")
    for name, sets in variants:
        out = os.path.join(tmp, re.sub(r"\W+", "_", name))
        print(f"[bench] {name} ...", flush=True)
        log = launch(args.nproc, config, base + sets, out)
        recs = _steps(out, args.warmup)
        step_t = statistics.median(r["step_time"] for r in recs)
        clip_t = statistics.median(r.get("clip_time", 0.0) for r in recs)
        wait_t = statistics.median(r.get("clip_wait", 0.0) for r in recs)
        mem = {int(m.group(1)): (float(m.group(2)), float(m.group(3)))
               for m in re.finditer(r"rank (\d+) stage \d+: .*optimizer state ([\d.]+) MB, max RSS ([\d.]+) MB", log)}
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
    json.dump([{"variant": n, "step_time": s, "clip_time": c, "clip_wait": w, "memory": m} for n, s, c, w, m in rows],
              open(os.path.join(tmp, "bench.json"), "w"), indent=2)
    return 0


def make_photos(out: str, n: int, width: int = 640, height: int = 480, seed: int = 0) -> list:
    """Photographic-ish JPEGs (smooth gradients, blobs and sensor-like noise), quality 90."""
    import numpy as np
    from PIL import Image
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    paths = []
    for i in range(n):
        c = rng.uniform(0, 255, (3, 3))
        img = (c[:, 0] * (x / width)[..., None] + c[:, 1] * (y / height)[..., None] + c[:, 2]) / 2
        for _ in range(4):
            cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(30, 150)
            img += rng.uniform(-80, 80, 3) * np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))[..., None]
        img += rng.normal(0, 12, img.shape)
        p = os.path.join(out, f"{i:05d}.jpg")
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(p, quality=90)
        paths.append(p)
    return paths


class _NaiveDataset:
    """The baseline users write first: full decode, resize to 224, ToTensor, normalize, pad to 512."""

    def __init__(self, samples, tokenizer):
        from torchvision import transforms
        self.samples, self.tok = samples, tokenizer
        self.tf = transforms.Compose([transforms.Resize(224), transforms.CenterCrop(224), transforms.ToTensor(),
                                      transforms.Normalize((0.481, 0.458, 0.408), (0.269, 0.261, 0.276))])

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        from PIL import Image
        s = self.samples[i]
        with Image.open(s.image) as im:
            x = self.tf(im.convert("RGB"))
        ids = self.tok(s.text, padding="max_length", max_length=512, truncation=True, return_tensors="pt")
        return x, ids["input_ids"][0]


def _images_per_sec(loader, n: int) -> float:
    import time
    t0 = time.perf_counter()
    seen = 0
    for batch in loader:
        seen += len(batch["index"]) if isinstance(batch, dict) else len(batch[0])
    assert seen == n, (seen, n)
    return n / (time.perf_counter() - t0)


def bench_data(args) -> int:
    """(a) naive per-sample path vs (b) mmpipe's direct path vs (c) its preprocessed cache, images/s
    through a DataLoader, in one run."""
    import time

    import torch
    from torch.utils.data import DataLoader

    from mmpipe.data.cache import CachedDataset, prepare
    from mmpipe.data.loader import Collate, ImageTextDataset
    from mmpipe.data.manifest import Sample
    from mmpipe.data.tokenizer import train_tokenizer
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="mmpipe-bench-data-")
    print(f"[bench] writing {args.n} JPEGs of {args.width}x{args.height} ...", flush=True)
    paths = make_photos(os.path.join(tmp, "img"), args.n, args.width, args.height)
    words = ["a", "photo", "of", "red", "blue", "gradient", "sky", "over", "the", "hills", "with", "soft", "light"]
    samples = [Sample(p, " ".join(words[j % len(words)] for j in range(i % 20 + 3))) for i, p in enumerate(paths)]
    manifest = os.path.join(tmp, "train.jsonl")
    with open(manifest, "w") as fh:
        for s in samples:
            fh.write(json.dumps({"image": s.image, "text": s.text}) + "\n")
    tok = train_tokenizer([s.text for s in samples], 200, os.path.join(tmp, "tok"))
    print("[bench] mmpipe data prepare (the cache for (c)) ...", flush=True)
    t0 = time.perf_counter()
    prepare(manifest, os.path.join(tmp, "cache"), 224, 32, tokenizer=os.path.join(tmp, "tok"), workers=args.workers)
    prepare_rate = args.n / (time.perf_counter() - t0)
    kw = dict(batch_size=32, num_workers=args.workers, persistent_workers=False)
    loaders = {
        "(a) naive: full decode, Resize/ToTensor/Normalize, pad to 512": DataLoader(_NaiveDataset(samples, tok), **kw),
        "(b) mmpipe direct: reduced-size JPEG decode, uint8, pad to batch": DataLoader(
            ImageTextDataset(samples, 224), collate_fn=Collate(tok, 32), **kw),
        "(c) mmpipe cache: memory-mapped uint8 + token ids": DataLoader(
            CachedDataset(os.path.join(tmp, "cache"), 224), collate_fn=Collate(tok, 32), **kw),
    }
    results = {name: [] for name in loaders}
    for _ in range(args.repeats):  # alternate, keep the best: less exposed to the shared machine's noise
        for name, loader in loaders.items():
            results[name].append(_images_per_sec(loader, args.n))
    base = max(next(iter(results.values())))
    lines = ["| path | images/s (best of %d) | vs (a) |" % args.repeats, "|---|---|---|"]
    for name, vals in results.items():
        lines.append(f"| {name} | {max(vals):.1f} | {max(vals) / base:.2f}x |")
    table = "\n".join(lines)
    print(table)
    notes = (f"{args.n} JPEGs {args.width}x{args.height}, quality 90 (gradients, blobs, noise), target 224x224, "
             f"batch 32, {args.workers} loader workers, 1 torch thread; JPEG decoder for (b): "
             f"{'simplejpeg (libjpeg-turbo) with DCT scaling' if _has_simplejpeg() else 'Pillow draft'}, "
             "resize: torchvision's uint8 antialiased bilinear. "
             f"Building the cache ran at {prepare_rate:.0f} images/s ({args.workers} processes), a one-time cost.")
    if not args.no_append:
        cmd = "mmpipe bench data " + " ".join(shlex.quote(a) for a in sys.argv[3:])
        append_benchmarks("Data path: images/s", cmd, table, notes)
    return 0


def _has_simplejpeg() -> bool:
    from mmpipe.data import loader
    return loader.simplejpeg is not None


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

    from mmpipe.config.schema import load_config
    from mmpipe.data.cache import prepare
    from mmpipe.planning.measure import measured_from_run, median_profile, plan_all, single_process_time, write_plan_png
    from mmpipe.planning.place import predict
    cfg = load_config(config, extra)
    from mmpipe.config.schema import family_of
    size = family_of(cfg).image_size(cfg.model)
    vlm = cfg.model.type == "vlm"
    if vlm:  # chat data is read as it is (the VLM has no cache)
        common = [f"data.train={info['train']}", "data.val=null", f"train.steps={args.steps}"] + extra
    else:
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
            parts = json.load(fh)["parts"]
        sim = predict(plan["profile"], parts, M)
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
    from mmpipe.planning.place import layer_costs
    costs = layer_costs(plan["profile"])
    t = [c.fwd_ms + c.bwd_ms for c in costs]
    return sum(x for n, x in zip(plan["names"], t) if n.startswith("vision.")) / sum(t)


def bench_balance(args) -> int:
    """Samples/s of every placement on an image-heavy and a text-heavy dual encoder (P = 2, 1 thread
    per rank), against the single-process baseline (1 thread, same model and batch), with the
    simulator's prediction beside each measurement."""
    from mmpipe.data.synth import synth, synth_vlm
    tmp = tempfile.mkdtemp(prefix="mmpipe-bench-balance-")
    os.environ["OMP_NUM_THREADS"] = "1"  # every rank (and the baseline) computes on one thread
    print(f"[bench] synthetic data and caches in {tmp} ...", flush=True)
    art = os.path.join(os.getcwd(), "benchmarks")
    os.makedirs(art, exist_ok=True)
    if args.model == "vlm":
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


def _report_balance(args, title: str, table: str, notes: str) -> int:
    print(notes)
    if not args.no_append:
        cmd = "mmpipe bench balance " + " ".join(shlex.quote(a) for a in sys.argv[3:])
        append_benchmarks(title, cmd, table, notes)
    return 0


# ---- mmpipe bench strategies ---------------------------------------------------------------------------
_MEM_LINE = re.compile(r"rank (\d+) stage \d+: params [\d.]+M \(trainable [\d.]+M\), optimizer state ([\d.]+) MB, "
                       r"max RSS (\d+) MB")


def _layout_sets(row) -> list:
    sets = [f"parallel.pipeline_stages={row.pipeline_stages}", f"parallel.zero_stage={row.zero_stage}"]
    if row.pipeline_stages > 1:
        sets.append(f"parallel.placement={(row.placement or 'modality').split(':')[0]}")
    return sets


def _strategies_table(world: int, res: dict, rows: list, measured: dict, mem: dict, batch: int, single: float,
                      art: str, summary: list, rounds: dict) -> list:
    """Markdown lines of one world size: predicted beside measured per layout, the ranking verdict, PNG."""
    from mmpipe.planning.layouts import optimizer_state_bytes, write_png
    from mmpipe.planning.place import layer_costs
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


def bench_strategies(args) -> int:
    """The same model, data and global batch on 1, 2 and 4 ranks in every layout: measured step,
    samples/s, stage idle and memory beside the cost model's predictions (``mmpipe.planning.layouts``)."""
    from mmpipe.config.schema import load_config
    from mmpipe.data.cache import prepare
    from mmpipe.data.synth import synth
    from mmpipe.planning.layouts import CommModel, comm_group_sizes, get_comm_model, plan_layouts
    from mmpipe.parallel.topology import threads_per_rank
    from mmpipe.planning.measure import measured_from_run, median_profile
    tmp = tempfile.mkdtemp(prefix="mmpipe-bench-strategies-")
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
        runs, texts, samples = {}, {}, [res]
        for rnd in range(args.rounds):
            if rnd:  # the profile and the collectives sampled again beside every round's runs
                log(f"{world} rank(s): profile{'' if world == 1 else ' and collectives'} again (round {rnd + 1}/{args.rounds}) ...")
                comm = res["comm"] if world == 1 else get_comm_model(list(sizes), use_cache=False, log=log)
                samples.append(plan_layouts(cfg, world, log=log, use_cache=False, comm=comm))
            for r in rows:
                log(f"{world} rank(s): {r.name} (round {rnd + 1}/{args.rounds}) ...")
                out = os.path.join(tmp, f"w{world}_{re.sub(r'[^A-Za-z0-9]+', '_', r.name)}_{rnd}")
                texts[out] = launch(world, config, common + _layout_sets(r), out)
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
            found = _MEM_LINE.findall(texts[out])
            mem[r.name] = (max((float(o) for _, o, _ in found), default=float("nan")),
                           max((int(x) for _, _, x in found), default=0))
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


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks: print a table and append it to BENCHMARKS.md")
    bs = b.add_subparsers(dest="bench_cmd", required=True)
    g = bs.add_parser("groups", help="grouped clipping cost and frozen-tower memory (P = 2)")
    g.add_argument("--config", default=os.path.join(ROOT, "configs", "demo.yaml"))
    g.add_argument("--steps", type=int, default=40)
    g.add_argument("--warmup", type=int, default=5)
    g.add_argument("--nproc", type=int, default=2)
    g.add_argument("--no-append", action="store_true", help="print only; do not write BENCHMARKS.md")
    g.set_defaults(func=bench_groups)
    d = bs.add_parser("data", help="image/text loading: naive path vs mmpipe's direct and cache paths")
    d.add_argument("--n", type=int, default=320)
    d.add_argument("--width", type=int, default=640)
    d.add_argument("--height", type=int, default=480)
    d.add_argument("--workers", type=int, default=2)
    d.add_argument("--repeats", type=int, default=2)
    d.add_argument("--no-append", action="store_true")
    d.set_defaults(func=bench_data)
    st = bs.add_parser("strategies", help="every layout (DP + ZeRO 0-3, PP, PP x DP) at 1, 2 and 4 ranks: "
                       "measured beside the cost model's prediction")
    st.add_argument("--config", default=os.path.join(ROOT, "configs", "bench_image_heavy.yaml"))
    st.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    st.add_argument("--steps", type=int, default=8)
    st.add_argument("--warmup", type=int, default=3)
    st.add_argument("--n", type=int, default=400, help="synthetic training pairs")
    st.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; steps pooled, median kept")
    st.add_argument("--refresh", action="store_true", help="profile and time the collectives again")
    st.add_argument("--no-append", action="store_true")
    st.set_defaults(func=bench_strategies)
    bb = bs.add_parser("balance", help="samples/s of every stage placement vs the single-process baseline")
    bb.add_argument("--steps", type=int, default=8)
    bb.add_argument("--warmup", type=int, default=2)
    bb.add_argument("--n", type=int, default=400, help="synthetic training pairs")
    bb.add_argument("--no-frozen", action="store_true", help="skip the frozen-vision variant")
    bb.add_argument("--model", choices=("clip", "vlm"), default="clip",
                    help="clip: image- and text-heavy dual encoders; vlm: an image-heavy LLaVA-style VLM")
    bb.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; steps pooled, median kept")
    bb.add_argument("--no-append", action="store_true")
    bb.set_defaults(func=bench_balance)
