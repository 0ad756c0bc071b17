"""``mmpipe bench gpu --pipeline``: a two-stage pipeline (P = 2) on the devices present, held to P = 1 on the same
device: the same model, data and seed, bf16, at gradient accumulation 1 and 8.

Per job (``clip``: CLIP ViT-B/16, 64 pairs a micro-batch; ``vlm_full``: the LLaVA-1.5-7B shape, its decoder cut to ``--full-layers``
blocks so both runs fit one device; ``qwen_full``: the Qwen2.5-VL-7B shape cut the same way, images of four sizes
packed into 2048-token rows, so the stages see different shapes every micro-batch):

- every step's loss (relative difference), and every trainable parameter's gradient of the first and the last
  step (``log.grads``: fp32, before clipping, by plain name; ``train.grad_dump.compare_grads``): a stage whose
  gradients are scaled (DeepSpeed's 1/GAS^2 on earlier stages, deepspeedai/DeepSpeed#8152) or taken from one
  micro-batch (NVIDIA-NeMo/Automodel#3530) is an error of order one, bf16 rounding about 1e-2;
- each stage's allocator peak (``max_memory_allocated``, the run's memory record) beside the memory model's
  prediction for that stage (``planning.offline.run_memory``, sized on the meta device);
- each stage's forward / backward / communication time and idle fraction, from the stage clock (device events
  on a GPU), and a timeline of one step (``log.trace``: trace.json for Perfetto, timeline.png);
- no hang: every run must end within ``--timeout`` seconds, else its ranks are stopped and the bench says so.

Where the two ranks run (``two_rank_plan``): two GPUs, one each; one GPU, both on it - NCCL >= 2.30 with
``NCCL_MULTI_RANK_GPU_ENABLE=1`` (both ranks take device 0: ``LOCAL_RANK=0``, which DeepSpeed and torch bind,
their ``RANK`` 0 and 1), which proves correctness, hangs and per-stage memory, not speed; the CPU, gloo (the
test's form: ``--tiny``). ``--share-device`` takes the one-device form wherever the bench runs (on the CPU: the
launch logic's twin)."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time

from mmpipe.bench.common import append_benchmarks, free_port, machine, ROOT
from mmpipe.config.schema import family_of, load_config
from mmpipe.errors import MmpipeError
from mmpipe.planning.offline import run_memory
from mmpipe.train.grad_dump import compare_grads, grad_norm_of, load_grads
from mmpipe.train.metrics import read_memory_record, read_metrics

PIPELINE_JOBS = ("clip", "vlm_full", "qwen_full")
NCCL_SHARED = (2, 30)
LOSS_RTOL = 1e-2  # bf16
GRAD_RTOL = 3e-2  # the largest per-layer relative L2 error (bf16 rounding: ~1e-3 to 1e-2)
GRAD_FLOOR = 1e-4  # a parameter's error is relative to max(its norm, this x the whole gradient's): a key bias has none


def _log(msg: str) -> None:
    print(f"[bench gpu --pipeline] {msg}", flush=True)


def two_rank_plan(device: str, devices: int, nccl, share: bool = False) -> dict:
    """How two ranks run here: ``local_ranks`` (the device index each binds), ``env`` (added to both), ``where``
    (words for the table). ``device``: the accelerator's name (``cpu``, ``cuda``), ``devices``: how many,
    ``nccl``: torch's NCCL version tuple (None without one)."""
    if device == "cpu":
        return {"local_ranks": [0, 0] if share else [0, 1], "env": {},
                "where": "2 ranks on the CPU (gloo)" + (", both LOCAL_RANK 0 (the one-device launch)" if share else "")}
    if devices >= 2 and not share:
        return {"local_ranks": [0, 1], "env": {}, "where": f"2 ranks on 2 of {devices} {device} devices (NCCL)"}
    if nccl is None or tuple(nccl[:2]) < NCCL_SHARED:
        have = ".".join(map(str, nccl)) if nccl else "none"
        raise MmpipeError(f"two ranks on one {device} device need NCCL >= {NCCL_SHARED[0]}.{NCCL_SHARED[1]} "
                          f"(NCCL_MULTI_RANK_GPU_ENABLE=1); torch has NCCL {have}: pip install -U 'nvidia-nccl-cu12>=2.30' "
                          "(or -cu13, torch's CUDA), or run where there are two devices")
    return {"local_ranks": [0, 0], "env": {"NCCL_MULTI_RANK_GPU_ENABLE": "1"},
            "where": f"2 ranks sharing one {device} device (NCCL {'.'.join(map(str, nccl))}, NCCL_MULTI_RANK_GPU_ENABLE=1)"}


def _here(share: bool) -> dict:
    import torch
    from deepspeed.accelerator import get_accelerator
    name = get_accelerator().device_name()
    if name == "cpu":
        return two_rank_plan("cpu", 0, None, share)
    nccl = torch.cuda.nccl.version() if name == "cuda" else None
    return two_rank_plan(name, get_accelerator().device_count(), nccl, share)


def run_ranks(local_ranks: list, config: str, sets: list, out: str, env: dict, timeout: float) -> None:
    """``launch/train.py`` as ``len(local_ranks)`` ranks (RANK i, LOCAL_RANK ``local_ranks[i]``) into ``out``; a
    rank that fails stops the others; past ``timeout`` seconds every rank is stopped: a hang."""
    n = len(local_ranks)
    argv = [sys.executable, "-u", os.path.join(ROOT, "launch", "train.py"), "--config", config, "--overwrite",
            "--set", f"train.output_dir={out}", "--set", "log.progress=false"]
    for s in sets:
        argv += ["--set", s]
    base = dict(os.environ, **env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(n),
                LOCAL_WORLD_SIZE=str(n), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    os.makedirs(out, exist_ok=True)
    log_path = os.path.join(out, "ranks.log")
    with open(log_path, "w") as log:
        procs = [subprocess.Popen(argv, env=dict(base, RANK=str(r), LOCAL_RANK=str(lr)), stdout=log,
                                  stderr=subprocess.STDOUT, cwd=os.getcwd(), start_new_session=True)
                 for r, lr in enumerate(local_ranks)]
        deadline, why = time.monotonic() + timeout, None
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                why = "failed"
            elif time.monotonic() > deadline:
                why = f"hang: still running after {timeout:.0f} s"
            if why:
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGTERM)
                for p in procs:
                    try:
                        p.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        os.killpg(p.pid, signal.SIGKILL)
                break
            time.sleep(0.2)
    if why or any(p.returncode for p in procs):
        with open(log_path) as fh:
            tail = "\n".join(fh.read().splitlines()[-25:])
        raise MmpipeError(f"{os.path.basename(out)}: {why or 'failed'} ({n} ranks; log {log_path})\n{tail}")


def _specs(args, specs: dict) -> dict:
    """The pipeline jobs of ``specs`` (``gpu.job_specs``: their configs and data), trained in full."""
    out = {}
    for job in args.jobs:
        if job not in PIPELINE_JOBS:
            raise MmpipeError(f"mmpipe bench gpu --pipeline: job {job!r} is not one of {', '.join(PIPELINE_JOBS)}")
        out[job] = specs[job]
    return out


def _compare(p1: str, p2: str, steps: int) -> dict:
    a = [r["loss"] for r in read_metrics(os.path.join(p1, "metrics.jsonl"))]
    b = [r["loss"] for r in read_metrics(os.path.join(p2, "metrics.jsonl"))]
    if len(a) != steps or len(b) != steps:
        raise MmpipeError(f"{p1} / {p2}: {len(a)} and {len(b)} steps logged, {steps} expected")
    loss_err = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))
    with open(os.path.join(p2, "plan.json")) as fh:
        layers = json.load(fh)["layers"]
    grads = {}
    for step in sorted({1, steps}):
        want, got = load_grads(p1, step), load_grads(p2, step)
        c = compare_grads(got, want, floor=GRAD_FLOOR * grad_norm_of(want), layers=layers)
        grads[step] = {k: c[k] for k in ("worst", "worst_layer", "global", "count", "missing", "extra")}
        grads[step].update(norm_p1=grad_norm_of(want), norm_p2=grad_norm_of(got))
    ok = loss_err <= LOSS_RTOL and all(g["worst_layer"][1] <= GRAD_RTOL and not g["missing"] and not g["extra"]
                                       for g in grads.values())
    return {"losses_p1": a, "losses_p2": b, "loss_rel": loss_err, "grads": grads, "ok": ok}


def _stages(run_dir: str, cfg) -> list:
    """Per stage: predicted MB (the memory model), allocator peak MB (a GPU's; None on the CPU), and the stage
    clock's medians over the steps after the first."""
    predicted = run_memory(cfg, run_dir, 2, meta=True)
    mem = {r["stage"]: r for r in read_memory_record(run_dir)}
    recs = read_metrics(os.path.join(run_dir, "metrics.jsonl"))[1:] or read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    out = []
    for s, pred in enumerate(predicted):
        r = mem.get(s) or {}
        med = {k: statistics.median(x[f"stage{s}.{k}"] for x in recs if f"stage{s}.{k}" in x) if any(
            f"stage{s}.{k}" in x for x in recs) else None for k in ("fwd_ms", "bwd_ms", "comm_ms", "idle")}
        out.append({"stage": s, "predicted_mb": pred.to_dict()["total"] / 2**20,
                    "peak_mb": r.get("peak_mb") if r.get("peak_of") == "device" else None, **med})
    return out


def bench_gpu_pipeline(args, tmp: str, specs: dict, data_for, device: tuple) -> int:
    """``specs``: ``gpu.job_specs``; ``data_for``: ``gpu._data`` (a job's synthetic data); ``device``: (accelerator
    name, its description)."""
    plan = _here(args.share_device)
    on_cpu, device = device[0] == "cpu", device[1]
    _log(f"{plan['where']}; jobs {', '.join(args.jobs)}; accumulation {', '.join(map(str, args.accumulation))}")
    steps = max(2, args.steps)
    results, failures = [], []
    for job, spec in _specs(args, specs).items():
        cfg = load_config(spec["config"], spec["sets"])
        if args.attention and family_of(cfg).data_format == "chat":  # the chat jobs' kernel (--attention)
            spec = dict(spec, sets=spec["sets"] + [f"model.attention={args.attention[0]}"])
        pairs = family_of(cfg).data_format == "captions"
        if pairs and not args.tiny:  # 64 pairs a micro-batch (512 a step at accumulation 8), not the throughput job's 256
            spec = dict(spec, sets=spec["sets"] + ["parallel.micro_batch_size=64"])
        micro = 64 if pairs and not args.tiny else int(cfg.parallel.micro_batch_size)
        # pairs: one epoch's worth; chat samples: about three a packed row, with room
        n = args.n or (micro * max(args.accumulation) * steps if pairs else 4 * micro * max(args.accumulation) * steps)
        data = data_for(tmp, job, cfg, n, spec.get("image_sizes"))
        for gas in args.accumulation:
            runs = {}
            for P in (1, 2):
                out = os.path.join(tmp, f"{job}_gas{gas}_p{P}")
                sets = spec["sets"] + data + [f"train.steps={steps}", f"train.batch_size={micro * gas}",
                                              f"parallel.pipeline_stages={P}", f"log.grads=[1,{steps}]",
                                              "parallel.profile=false"] + list(args.sets)
                if P == 2:
                    sets.append(f"log.trace=[{steps},{steps}]")
                t0 = time.time()
                try:
                    run_ranks(plan["local_ranks"][:P], spec["config"], sets, out, plan["env"], args.timeout)
                except MmpipeError as e:
                    failures.append(str(e).splitlines()[0])
                    _log(str(e))
                    break
                runs[P] = out
                _log(f"{job} accumulation {gas} P={P}: {time.time() - t0:.0f} s")
            if len(runs) < 2:
                continue
            cmp = _compare(runs[1], runs[2], steps)
            stages = _stages(runs[2], load_config(os.path.join(runs[2], "config.yaml")))
            results.append({"job": job, "accumulation": gas, "micro_batch": micro, "steps": steps, **cmp,
                            "stages": stages})
            last = cmp["grads"][steps]
            _log(f"{job} accumulation {gas}: loss rel {cmp['loss_rel']:.1e}, gradients: worst layer "
                 f"{last['worst_layer'][1]:.1e} ({last['worst_layer'][0]}), worst parameter {last['worst'][1]:.1e} "
                 f"({last['worst'][0]}), all {last['global']:.1e} -> "
                 f"{'ok' if cmp['ok'] else 'DIFFERENT'}")
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                for f in ("trace.json", "timeline.png"):
                    if os.path.isfile(os.path.join(runs[2], f)):
                        shutil.copy(os.path.join(runs[2], f), os.path.join(args.out, f"pipeline_{job}_gas{gas}_{f}"))
    text = table(results)
    print(text)
    if args.out:
        with open(os.path.join(args.out, "pipeline_results.json"), "w") as fh:
            json.dump({"where": plan["where"], "device": device, "machine": machine(), "results": results,
                       "failures": failures}, fh, indent=1)
    notes = (f"{plan['where']}. Each job trained {steps} steps at P = 1 and at P = 2 on the same device from the "
             "same seed and data, bf16; loss: the largest relative difference over the steps; gradients: every "
             "trainable parameter's (fp32, before clipping, `log.grads`) at the first and last step: the largest "
             "relative L2 error of a layer's gradients, and of one parameter's (informative: a small-gradient norm bias "
             f"is a few percent off in bf16 while its layer agrees) (pass: loss <= {LOSS_RTOL:g}, every layer <= "
             f"{GRAD_RTOL:g}). Memory: the allocator's "
             "peak per stage beside the memory model's prediction; time: the stage clock's medians (device events "
             "on a GPU; ranks sharing one device share its time, so not a speed-up).")
    if failures:
        notes += " Failed: " + "; ".join(failures)
    if not args.no_append and results:
        cmd = "mmpipe bench gpu " + " ".join(shlex.quote(a) for a in sys.argv[3:])
        append_benchmarks(f"Pipeline P = 2 vs P = 1 ({device})" if not on_cpu else "Pipeline P = 2 vs P = 1 (tiny, CPU)",
                          cmd, text, notes)
    return 0 if results and not failures and all(r["ok"] for r in results) else 1


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(results: list) -> str:
    lines = ["| job | accumulation | loss rel. diff | gradients rel. error, step 1 / last: worst layer | worst parameter "
             "| stage | memory model MB | allocator peak MB | error | fwd / bwd / comm ms | idle | result |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        steps = sorted(r["grads"])
        gl, gp = ([r["grads"][s][key] for s in steps] for key in ("worst_layer", "worst"))
        gtext = " / ".join(f"{w:.1e}" for _, w in gl) + f" ({gl[-1][0]}) | " + \
            " / ".join(f"{w:.1e}" for _, w in gp) + f" ({gp[-1][0]})"
        for st in r["stages"]:
            err = (st["predicted_mb"] / st["peak_mb"] - 1) * 100 if st["peak_mb"] else None
            first = st["stage"] == 0
            lines.append(f"| {r['job'] if first else ''} | {r['accumulation'] if first else ''} | "
                         f"{_fmt(r['loss_rel'], '.1e') if first else ''} | {gtext if first else ' | '} | {st['stage']} | "
                         f"{st['predicted_mb']:.0f} | {_fmt(st['peak_mb'], '.0f')} | {_fmt(err, '+.1f')}% | "
                         f"{_fmt(st['fwd_ms'], '.0f')} / {_fmt(st['bwd_ms'], '.0f')} / {_fmt(st['comm_ms'], '.0f')} | "
                         f"{_fmt(st['idle'] and 100 * st['idle'], '.0f')}% | "
                         f"{('ok' if r['ok'] else 'DIFFERENT') if first else ''} |")
    return "\n".join(lines).replace("| -% |", "| - |")
