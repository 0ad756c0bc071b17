#!/usr/bin/env python
"""GPU checks for mmpipe (run from a snapshot of the repository: ``cd .gpusnap; PYTHONPATH=$PWD``).

  python gpu_checks.py data  --root data            # the data sets (also done here, on the CPU)
  python gpu_checks.py smoke --out $OUT             # versions + a 3-step fp16 tiny CLIP run (P = 1)
  python gpu_checks.py full  --out $OUT [--parts precision,speed] [--runs clip_fp32,clip_fp16,...]
  python gpu_checks.py train ARGS...                # = launch/train.py ARGS, with the fp16 loss scale
                                                    #   added to every metrics.jsonl record (loss_scale);

``full`` writes $OUT/results.json, $OUT/summary.md and $OUT/runs.tar.gz (metrics, logs, configs).

1. precision: the tiny CLIP and VLM configs at P = 1 with per-group gradient clipping, fp32 / bf16 /
   fp16 (ZeRO-0, ZeRO-1, and ZeRO-0 with the loss scaled in backward) from the same seed and data;
   per-step losses and per-group pre-clip gradient norms from metrics.jsonl, max relative
   difference of each against fp32, the saved weights compared (mmpipe.load_weights).
   Overflow: fp16 with a DeepSpeed JSON starting the dynamic loss scale at 2**32 (every step
   overflows until the scale is down, if the scale is applied) and a scale window of 8 steps (the
   scale grows again, so overflows recur mid-run): skipped steps, loss scale, training after the
   scale settles; with train.max_bad_steps=0 and with the default (3).
2. speed: configs/demo.yaml and configs/demo_vlm.yaml at P = 1 in fp32, bf16 and fp16: median
   samples/s after warm-up and the peak device memory line of the log.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = HERE  # the script is copied into the snapshot's root
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
TINY_VLM = os.path.join(ROOT, "configs", "tiny_vlm.yaml")

# per-group limits: chosen below the groups' typical fp32 norms for some groups (so the clip acts)
# and above them for others, plus a global limit (see RESULTS.md)
CLIP_SETS = ["optim.groups.vision.max_grad_norm=0.5", "optim.groups.text.max_grad_norm=1.0",
             "optim.groups.projector.max_grad_norm=0.2", "optim.max_grad_norm=2.0"]
VLM_SETS = ["optim.groups.vision.max_grad_norm=0.3", "optim.groups.projector.max_grad_norm=0.5",
            "optim.groups.llm.max_grad_norm=1.0", "optim.max_grad_norm=2.0"]


# --------------------------------------------------------------------------------------------
# patched training entry (loss scale in the metrics)
# --------------------------------------------------------------------------------------------
def train_entry(argv) -> int:
    sys.path.insert(0, ROOT)
    import mmpipe.config.groups as optim
    original = optim.GradClipper.record

    def record(self):
        out = original(self)
        opt = self.engine.optimizer
        scale = None
        lsc = getattr(opt, "loss_scale_config", None)
        if lsc is not None and getattr(lsc, "use_grad_scaling", False):
            scale = float(lsc.cur_scale)
        elif hasattr(opt, "cur_scale") and not callable(opt.cur_scale):
            scale = float(opt.cur_scale)
        # recheck: mmpipe now logs loss_scale itself; keep its value and add DeepSpeed's own beside it
        out["ds_loss_scale"] = scale
        out["ds_skipped_steps"] = int(getattr(self.engine, "skipped_steps", 0) or 0)
        from deepspeed.runtime.engine import DeepSpeedEngine
        out["fp16_backward_patched"] = bool(getattr(DeepSpeedEngine.backward, "_mmpipe_fp16_scaling", False))
        return out

    optim.GradClipper.record = record
    for k in ("GPU_CHECKS_FIX_FP16_BACKWARD", "GPU_CHECKS_FP32_NORMS"):  # the stand-ins are mmpipe's now
        if os.environ.get(k):
            raise SystemExit(f"gpu_checks: {k} is gone: mmpipe itself scales fp16's loss and takes norms in fp32")
    from mmpipe.cli.main import train_main
    return train_main(argv)


def make_data(root: str) -> dict:
    sys.path.insert(0, ROOT)
    from mmpipe.data.synth import synth, synth_vlm
    out = {}
    jobs = [("tiny", lambda d: synth(d, 420, val_fraction=0.05, size=48, seed=1, progress=False)),
            ("tiny_vlm", lambda d: synth_vlm(d, 260, val_fraction=0.05, size=32, seed=1, text_only=0.3,
                                             progress=False)),
            ("synth", lambda d: synth(d, 4200, val_fraction=0.0477, size=96, seed=0, progress=False)),  # = make demo
            ("synth_vlm", lambda d: synth_vlm(d, 4000, val_fraction=0.1, size=32, seed=0, progress=False))]  # = make demo-vlm
    for name, fn in jobs:
        d = os.path.join(root, name)
        if not os.path.isfile(os.path.join(d, "train.jsonl")):
            fn(d)
        out[name] = {"train": os.path.join(d, "train.jsonl"), "val": os.path.join(d, "val.jsonl")}
    return out


# --------------------------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------------------------
def launch(config: str, out_dir: str, sets: list, log: str, env_extra=None):
    """Start ``gpu_checks.py train`` (one process, P = 1) in the background."""
    cmd = [sys.executable, os.path.abspath(__file__), "train", "--config", config, "--overwrite"]
    for s in sets + [f"train.output_dir={out_dir}"]:
        cmd += ["--set", s]
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(k, None)
    env.update(env_extra or {})
    fh = open(log, "w")
    fh.write("$ " + " ".join(cmd) + "\n")
    fh.flush()
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
    return p, fh, t0, cmd


def wait_all(jobs: dict, timeout: float) -> dict:
    out = {}
    deadline = time.time() + timeout
    for name, (p, fh, t0, cmd) in jobs.items():
        try:
            rc = p.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = "timeout"
        fh.close()
        out[name] = {"rc": rc, "wall_s": round(time.time() - t0, 1), "cmd": " ".join(cmd)}
    return out


def metrics(run_dir: str) -> list:
    from mmpipe.train.metrics import read_metrics
    path = os.path.join(run_dir, "metrics.jsonl")
    return read_metrics(path) if os.path.isfile(path) else []


def rel(a, b):
    if a is None or b is None:
        return None
    if not (math.isfinite(a) and math.isfinite(b)):
        return float("inf")
    return abs(a - b) / max(abs(b), 1e-12)


def maxrel(xs, ys):
    vals = [rel(a, b) for a, b in zip(xs, ys)]
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


def weight_diff(a_dir: str, b_dir: str) -> dict:
    import torch

    import mmpipe
    a, b = mmpipe.load_weights(a_dir), mmpipe.load_weights(b_dir)
    num = den = 0.0
    worst, worst_key, max_abs = 0.0, None, 0.0
    for k in b:
        if not torch.is_tensor(b[k]) or not b[k].is_floating_point():
            continue
        x, y = a[k].double(), b[k].double()
        d = (x - y).norm().item()
        n = y.norm().item()
        num += d * d
        den += n * n
        r = d / max(n, 1e-12)
        max_abs = max(max_abs, (x - y).abs().max().item())
        if n > 1e-2 * math.sqrt(y.numel()) and r > worst:  # (tensors near zero, e.g. k_proj biases: no ratio)
            worst, worst_key = r, k
    return {"rel_l2_all": math.sqrt(num) / max(math.sqrt(den), 1e-12), "worst_tensor_rel_l2": worst,
            "worst_tensor": worst_key, "max_abs": max_abs, "dtype": str(next(iter(a.values())).dtype)}


def peak_memory(log: str):
    if not os.path.isfile(log):
        return None
    with open(log, errors="replace") as fh:
        m = re.findall(r"(rank \d+ stage \d+: .*peak device memory (\d+) MB)", fh.read())
    return {"line": m[-1][0], "mb": int(m[-1][1])} if m else None


def tail(path: str, n: int = 15) -> str:
    if not os.path.isfile(path):
        return ""
    with open(path, errors="replace") as fh:
        return "".join(fh.readlines()[-n:])


# --------------------------------------------------------------------------------------------
# parts
# --------------------------------------------------------------------------------------------
# variant -> (extra --set values, environment (patches in train_entry), overflow JSON + 60 steps);
# a run is FAMILY_VARIANT (clip: configs/tiny.yaml, vlm: configs/tiny_vlm.yaml)
FP16, Z1, NOSTOP = ["train.precision=fp16"], ["parallel.zero_stage=1"], ["train.max_bad_steps=0"]
VARIANTS = {
    "fp32": (["train.precision=fp32"], {}, False), "bf16": (["train.precision=bf16"], {}, False),
    "fp16": (FP16, {}, False),                      # ZeRO-0: FP16_UnfusedOptimizer
    "fp16_z1": (FP16 + Z1, {}, False),              # DeepSpeedZeroOptimizer
    "fp16_overflow": (FP16 + NOSTOP, {}, True),
    "fp16_z1_overflow": (FP16 + Z1 + NOSTOP, {}, True),
    "fp16_z1_overflow_default_max_bad_steps": (FP16 + Z1, {}, True),
    "fp16_overflow_default_max_bad_steps": (FP16, {}, True),  # recheck: stock ZeRO-0, 2**32 start, default 3
}
DEFAULT_RUNS = ",".join(f"{f}_{v}" for f in ("clip", "vlm") for v in VARIANTS)


def precision_and_overflow(data: dict, runs: str, logs: str, steps: int, names: list, wait_s: float = 360) -> dict:
    common = ["log.progress=false", "train.save_every=0", "train.keep_checkpoints=1", "train.eval_every=0"]
    fam = {"clip": (TINY, data["tiny"], CLIP_SETS), "vlm": (TINY_VLM, data["tiny_vlm"], VLM_SETS)}
    ds_json = os.path.join(runs, "fp16_overflow.json")
    os.makedirs(runs, exist_ok=True)
    with open(ds_json, "w") as fh:  # dynamic loss scale from 2**32; grows again after 8 clean steps
        json.dump({"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 32, "loss_scale_window": 8,
                            "min_loss_scale": 1}}, fh)
    jobs = {}
    for name in names:
        f, variant = name.split("_", 1)
        cfg, d, sets = fam[f]
        extra, env_extra, overflow = VARIANTS[variant]
        n = 60 if overflow else steps
        s = common + [f"data.train={d['train']}", "parallel.pipeline_stages=1", f"train.steps={n}"] + sets + extra
        if overflow:
            s.append(f"train.deepspeed_config={ds_json}")
        env = {"OMP_NUM_THREADS": "1", **env_extra}
        jobs[name] = launch(cfg, os.path.join(runs, name), s, os.path.join(logs, name + ".log"), env)
    status = wait_all(jobs, wait_s)
    res = {"status": status, "runs": {}}
    for name in jobs:
        res["runs"][name] = {"metrics": metrics(os.path.join(runs, name)),
                             "log_tail": tail(os.path.join(logs, name + ".log"))}
    cmp = {}
    for name in jobs:  # every non-overflow run against fp32 of its family
        f, variant = name.split("_", 1)
        if variant == "fp32" or VARIANTS[variant][2] or f"{f}_fp32" not in jobs:
            continue
        ref, got = res["runs"][f"{f}_fp32"]["metrics"], res["runs"][name]["metrics"]
        if not ref or not got:
            cmp[name] = {"error": "missing metrics"}
            continue
        keys = sorted(k for k in ref[0] if k.startswith("grad_norm.") or k.startswith("clip_coef."))
        c = {"steps": min(len(ref), len(got)),
             "loss_maxrel": maxrel([r["loss"] for r in got], [r["loss"] for r in ref]),
             "loss_step1_rel": rel(got[0]["loss"], ref[0]["loss"]),
             "loss_last": [got[-1]["loss"], ref[-1]["loss"]],
             "grad_norm_maxrel": maxrel([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref]),
             "grad_norm_step1": [got[0]["grad_norm"], ref[0]["grad_norm"]],
             "skipped_steps": got[-1].get("skipped_steps"),
             "per_key_maxrel": {k: maxrel([r.get(k) for r in got], [r.get(k) for r in ref]) for k in keys},
             "per_key_step1_rel": {k: rel(got[0].get(k), ref[0].get(k)) for k in keys}}
        # a norm of scaled gradients would show a ratio of ~loss scale, one of doubly unscaled ones ~1/scale
        ratios = [r["grad_norm"] / q["grad_norm"] for r, q in zip(got, ref) if r.get("grad_norm") and q.get("grad_norm")]
        c["grad_norm_ratio_min_max"] = [min(ratios), max(ratios)] if ratios else None
        try:
            c["weights"] = weight_diff(os.path.join(runs, name), os.path.join(runs, f"{f}_fp32"))
        except Exception as e:  # noqa: BLE001
            c["weights"] = {"error": repr(e)}
        cmp[name] = c
    res["compare"] = cmp
    return res


def speed(data: dict, runs: str, logs: str, steps: int, warmup: int, budget_s: float,
          names=("demo_fp32", "demo_bf16", "demo_fp16", "demo_vlm_fp32", "demo_vlm_bf16", "demo_vlm_fp16")) -> dict:
    common = ["log.progress=false", "log.every=10", "parallel.pipeline_stages=1", f"train.steps={steps}",
              "train.save_every=0", "train.keep_checkpoints=1", f"train.eval_every={steps}"]
    plan = {"demo": (os.path.join(ROOT, "configs", "demo.yaml"), data["synth"]),
            "demo_vlm": (os.path.join(ROOT, "configs", "demo_vlm.yaml"), data["synth_vlm"])}
    res = {}
    t_start = time.time()
    for name in names:
        cfg_name = "demo_vlm" if name.startswith("demo_vlm_") else "demo"
        cfg, d = plan[cfg_name]
        extra, env_extra, _ = VARIANTS[name[len(cfg_name) + 1:]]
        if time.time() - t_start > budget_s:
            res[name] = {"error": "skipped: time budget"}
            continue
        log = os.path.join(logs, name + ".log")
        job = launch(cfg, os.path.join(runs, name), common + extra + [f"data.train={d['train']}",
                                                               f"data.val={d['val']}"], log, env_extra)
        st = wait_all({name: job}, 240)[name]
        m = metrics(os.path.join(runs, name))
        meas = [r for r in m if r["step"] > warmup]
        sps = [r["samples_per_sec"] for r in meas]
        res[name] = {**st, "steps": len(m), "measured_steps": len(sps),
                     "samples_per_sec_median": statistics.median(sps) if sps else None,
                     "samples_per_sec_min": min(sps) if sps else None,
                     "samples_per_sec_max": max(sps) if sps else None,
                     "step_time_median_ms": 1000 * statistics.median(r["step_time"] for r in meas) if meas else None,
                     "loader_wait_frac_median": statistics.median(r["loader_wait_frac"] for r in meas) if meas else None,
                     "skipped_steps": m[-1].get("skipped_steps") if m else None,
                     "loss_first_last": [m[0]["loss"], m[-1]["loss"]] if m else None,
                     "peak_memory": peak_memory(log), "log_tail": tail(log, 8) if st["rc"] != 0 else ""}
    return res


def versions() -> dict:
    import torch
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpu_mem_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    for m in ("deepspeed", "transformers", "tokenizers", "pydantic"):
        try:
            out[m] = __import__(m).__version__
        except Exception as e:  # noqa: BLE001
            out[m] = f"missing: {e!r}"
    try:
        out["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                            "--format=csv,noheader"], capture_output=True, text=True,
                                           timeout=30).stdout.strip()
    except Exception as e:  # noqa: BLE001
        out["nvidia_smi"] = repr(e)
    return out


# --------------------------------------------------------------------------------------------
# summary
# --------------------------------------------------------------------------------------------
def fmt(x, nd=3):
    if x is None:
        return "-"
    if isinstance(x, float):
        if x == 0 or (1e-3 <= abs(x) < 1e5):
            return f"{x:.{nd}f}" if abs(x) >= 1 or x == 0 else f"{x:.{nd}g}"
        return f"{x:.{nd}g}"
    return str(x)


def summary(res: dict) -> str:
    L = [f"versions: {json.dumps(res.get('versions'))}", ""]
    po = res.get("precision_overflow", {})
    for name, r in sorted(po.get("runs", {}).items()):
        m = r["metrics"]
        st = po["status"][name]
        L.append(f"## {name}: rc {st['rc']}, {len(m)} steps, {st['wall_s']} s")
        if m:
            keys = [k for k in m[0] if k.startswith("grad_norm.")]
            L.append("| step | loss | skipped | skipped_steps | ds_skipped | loss_scale | ds_loss_scale | grad_norm | "
                     + " | ".join(keys) + " | clip_coef |")
            L.append("|" + "---|" * (9 + len(keys)))
            for x in m:
                L.append(f"| {x['step']} | {fmt(x['loss'], 5)} | {x.get('skipped')} | {x.get('skipped_steps')} | "
                         f"{x.get('ds_skipped_steps')} | {fmt(x.get('loss_scale'))} | {fmt(x.get('ds_loss_scale'))} | "
                         f"{fmt(x.get('grad_norm'), 4)} | "
                         + " | ".join(fmt(x.get(k), 4) for k in keys) + f" | {fmt(x.get('clip_coef'), 4)} |")
        if m:
            sk = [x["step"] for x in m if x.get("skipped")]
            scales = [x.get("loss_scale") for x in m]
            L.append(f"skipped at steps {sk}; loss_scale {fmt(scales[0])} -> {fmt(scales[-1])} "
                     f"(min {fmt(min((v for v in scales if v), default=None))}); loss first {fmt(m[0]['loss'], 4)}, "
                     f"mean of last 10 {fmt(statistics.mean(x['loss'] for x in m[-10:]), 4)}")
        if st["rc"] != 0:
            L.append("```\n" + r["log_tail"] + "\n```")
        L.append("")
    for name, c in sorted(po.get("compare", {}).items()):
        L.append(f"compare {name} vs fp32: {json.dumps(c)}")
    L.append("")
    for name, r in res.get("speed", {}).items():
        L.append(f"speed {name}: {json.dumps({k: v for k, v in r.items() if k != 'cmd'})}")
    return "\n".join(L) + "\n"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "train":
        return train_entry(sys.argv[2:])
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("data", "smoke", "full"))
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_out"))
    ap.add_argument("--root", default=os.path.join(ROOT, "data", "gpu"))
    ap.add_argument("--work", default="/tmp/gpu_checks")
    ap.add_argument("--parts", default="precision,speed")
    ap.add_argument("--runs", default=DEFAULT_RUNS, help="precision/overflow runs: FAMILY_VARIANT, comma-separated")
    ap.add_argument("--steps", type=int, default=20, help="steps of the precision runs")
    ap.add_argument("--wait", type=float, default=360, help="seconds the parallel precision/overflow runs may take")
    ap.add_argument("--speed-runs", default="demo_fp32,demo_bf16,demo_fp16,demo_vlm_fp32,demo_vlm_bf16,demo_vlm_fp16",
                    help="CONFIG_VARIANT (demo or demo_vlm, a VARIANTS key)")
    ap.add_argument("--speed-steps", type=int, default=60)
    ap.add_argument("--speed-warmup", type=int, default=10)
    ap.add_argument("--speed-budget", type=float, default=240, help="seconds after which no new speed run starts")
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    os.makedirs(a.out, exist_ok=True)
    if a.what == "data":
        print(json.dumps(make_data(a.root), indent=1))
        return 0
    data = make_data(a.root)
    runs, logs = os.path.join(a.work, "runs"), os.path.join(a.work, "logs")
    os.makedirs(runs, exist_ok=True)
    os.makedirs(logs, exist_ok=True)
    res = {"versions": versions()}
    print(json.dumps(res["versions"]), flush=True)
    t0 = time.time()
    if a.what == "smoke":
        job = launch(TINY, os.path.join(runs, "smoke_fp16"),
                     ["log.progress=false", f"data.train={data['tiny']['train']}", "parallel.pipeline_stages=1",
                      "train.steps=3", "train.precision=fp16"] + CLIP_SETS, os.path.join(logs, "smoke_fp16.log"))
        st = wait_all({"smoke_fp16": job}, 200)["smoke_fp16"]
        res["precision_overflow"] = {"status": {"smoke_fp16": st},
                                     "runs": {"smoke_fp16": {"metrics": metrics(os.path.join(runs, "smoke_fp16")),
                                                             "log_tail": tail(os.path.join(logs, "smoke_fp16.log"), 40)}}}
        print(tail(os.path.join(logs, "smoke_fp16.log"), 40))
    else:
        parts = set(a.parts.split(","))
        if "precision" in parts:
            res["precision_overflow"] = precision_and_overflow(data, runs, logs, a.steps, a.runs.split(","), a.wait)
            print(f"precision/overflow done at {time.time() - t0:.0f} s", flush=True)
        if "speed" in parts:
            res["speed"] = speed(data, runs, logs, a.speed_steps, a.speed_warmup, a.speed_budget,
                               a.speed_runs.split(","))
            print(f"speed done at {time.time() - t0:.0f} s", flush=True)
    res["wall_s"] = round(time.time() - t0, 1)
    with open(os.path.join(a.out, "results.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    text = summary(res)
    with open(os.path.join(a.out, "summary.md"), "w") as fh:
        fh.write(text)
    print(text)
    with tarfile.open(os.path.join(a.out, "runs.tar.gz"), "w:gz") as tf:
        tf.add(logs, arcname="logs")
        for p in glob.glob(os.path.join(runs, "*", "*")):
            if os.path.isfile(p) and os.path.basename(p) in ("metrics.jsonl", "config.yaml", "ds_config.json"):
                tf.add(p, arcname=os.path.relpath(p, a.work))
    return 0


if __name__ == "__main__":
    sys.exit(main())
