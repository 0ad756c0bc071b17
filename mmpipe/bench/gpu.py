"""``mmpipe bench gpu``: mmpipe at real model sizes on one accelerator, beside the tools users measure
it against, on the same job and the same device in the same run.

Jobs (random weights built from config fields, nothing downloaded; bf16):

- ``clip``: CLIP ViT-B/16 at 256 pairs per GPU (``configs/bench_gpu_clip_b16.yaml``) by mmpipe and by
  ``open_clip_train`` (the same architecture: its model config written from mmpipe's, its synthetic
  data, ``--precision amp_bf16``, one process);
- ``vlm_lora``: a LLaVA-1.5-7B shape (``configs/llava_1_5_7b.yaml``: CLIP ViT-L/14-336 frozen, MLP
  projector, 32 x 4096 Llama) with LoRA (r 128, alpha 256, LLaVA's), chat samples packed into 2048-token
  rows, by mmpipe and by transformers' ``Trainer`` + peft on ``LlavaForConditionalGeneration`` (the same
  samples, padded per micro-batch, as LLaVA's scripts);
- ``vlm_full``: the same shape trained in full, its decoder cut to ``--full-layers`` blocks so that
  weights, gradients and AdamW state fit one device (said in the table);
- ``siglip_b16``: SigLIP ViT-B/16 (``configs/siglip_b16.yaml``: transformers' Siglip towers, the sigmoid loss)
  at 256 pairs per GPU, by mmpipe and by ``open_clip_train --siglip`` on open_clip's SigLIP of that shape
  (timm's SigLIP ViT, as open_clip ships ``ViT-B-16-SigLIP``; open_clip's own ViT at those sizes without
  timm, said in the table);
- ``qwen_lora``: a Qwen2.5-VL-7B shape (``configs/qwen2_5_vl_7b.yaml``: the native-resolution ViT frozen,
  a 28 x 3584 Qwen2 decoder) with LoRA on the decoder's linears, chat samples with images of four sizes
  (256 to 972 image tokens each) packed into 2048-token rows, by mmpipe and by transformers' ``Trainer`` +
  peft on ``Qwen2_5_VLForConditionalGeneration`` (the same samples, padded per micro-batch, as ms-swift);
- ``qwen3_5_lora``: a Qwen3.5-9B shape (``configs/qwen3_5_9b.yaml``: the ViT frozen, a 32 x 4096 hybrid decoder
  of GatedDeltaNet and gated full-attention blocks) with LoRA on the decoder's linears (ms-swift's all-linear:
  the linear-attention blocks' in_proj_qkv / in_proj_z / in_proj_b / in_proj_a / out_proj too), images of four
  sizes (196 to 768 image tokens) packed into 2048-token rows, by mmpipe and by the Trainer + peft on
  ``Qwen3_5ForConditionalGeneration``.

For each: samples/s (median step after the warm-up), model TFLOP/s per device and MFU (analytic FLOPs:
``mmpipe.planning.flops``), the allocator's peak (``max_memory_allocated`` after the first step) beside
the memory model's prediction for the run (sized on the meta device). ``--tiny`` runs the same jobs on
the tiny test configs (seconds on a CPU: what the test runs). ``--out DIR`` also writes ``results.json``.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

from mmpipe.bench.common import ROOT, _steps, append_benchmarks, free_port, launch, with_scratch
from mmpipe.bench.gpu_pipeline import PIPELINE_JOBS, bench_gpu_pipeline
from mmpipe.bench.trainer_worker import write_gpu_spec
from mmpipe.config.schema import family_of, load_config, replace
from mmpipe.data.tokenizer import StandInTokenizer
from mmpipe.planning.offline import run_memory
from mmpipe.train.metrics import read_memory_record

JOBS = ("clip", "vlm_lora", "vlm_full", "siglip_b16", "qwen_lora", "qwen3_5_lora")
_OC_STEP = re.compile(r"Train Epoch: \d+ \[\s*(\d+)/\d+.*?Batch \(t\): ([\d.]+), ([\d.]+)/s,")


def _log(msg: str) -> None:
    print(f"[bench gpu] {msg}", flush=True)


def _device() -> tuple:
    """(accelerator name, device description)."""
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    if acc.device_name() == "cpu":
        return "cpu", f"CPU ({os.cpu_count()} cores)"
    import torch
    return acc.device_name(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else acc.device_name()


# ---- the jobs -------------------------------------------------------------------------------------
def job_specs(args) -> dict:
    """Per job: config, its --set list, what it is; real sizes, or the tiny test configs (``--tiny``)."""
    on_cpu = _device()[0] == "cpu"
    common = ["parallel.layout=manual", "parallel.pipeline_stages=1", "parallel.profile=false", "train.save=false",
              "train.eval_every=0", "data.val=null", "log.progress=false", f"train.steps={args.steps}",
              "train.precision=bf16"]
    if on_cpu:
        common.append("data.num_workers=1")
    cfgs = os.path.join(ROOT, "configs")
    if args.tiny:
        clip = (os.path.join(cfgs, "tiny.yaml"), ["parallel.micro_batch_size=16", "train.batch_size=16",
                                                  "data.padding=max_length"])
        vlm = (os.path.join(cfgs, "tiny_vlm.yaml"), ["parallel.micro_batch_size=2", "train.batch_size=4",
                                                     "data.max_length=96"])
        full_layers = 2
        siglip = (os.path.join(cfgs, "tiny_siglip.yaml"), ["parallel.micro_batch_size=16", "train.batch_size=16"])
        qwen = (os.path.join(cfgs, "tiny_qwen2_5_vl.yaml"), ["parallel.micro_batch_size=2", "train.batch_size=4",
                                                             "data.max_length=96"])
        qwen_sizes = [(56, 56), (112, 84)]  # 4 and 12 image tokens
        qwen3_5 = (os.path.join(cfgs, "tiny_qwen3_5.yaml"), ["parallel.micro_batch_size=2", "train.batch_size=4",
                                                             "data.max_length=96"])
        qwen3_5_sizes = [(64, 64), (128, 96)]  # 4 and 12 image tokens
    else:
        clip = (os.path.join(cfgs, "bench_gpu_clip_b16.yaml"), [])
        vlm = (os.path.join(cfgs, "llava_1_5_7b.yaml"), [f"parallel.micro_batch_size={args.vlm_micro_batch}",
                                                         f"train.batch_size={args.vlm_batch}",
                                                         "parallel.activation_checkpointing=none"])
        full_layers = args.full_layers
        siglip = (os.path.join(cfgs, "siglip_b16.yaml"), ["parallel.micro_batch_size=256", "train.batch_size=256",
                                                          "parallel.activation_checkpointing=none",
                                                          "optim.warmup_steps=0", "data.num_workers=8"])
        qwen = (os.path.join(cfgs, "qwen2_5_vl_7b.yaml"), [f"parallel.micro_batch_size={args.vlm_micro_batch}",
                                                           f"train.batch_size={args.vlm_batch}",
                                                           "parallel.activation_checkpointing=none", "data.num_workers=8"])
        qwen_sizes = [(448, 448), (672, 504), (896, 672), (1008, 756)]  # 256, 432, 768 and 972 image tokens
        qwen3_5 = (os.path.join(cfgs, "qwen3_5_9b.yaml"), [f"parallel.micro_batch_size={args.vlm_micro_batch}",
                                                           f"train.batch_size={args.vlm_batch}",
                                                           "parallel.activation_checkpointing=none", "data.num_workers=8"])
        qwen3_5_sizes = [(448, 448), (640, 480), (896, 672), (1024, 768)]  # 196, 300, 588 and 768 image tokens
    vlm_common = ["data.packing=true", "data.padding=batch", "optim.warmup_steps=0", "data.log_samples=true"]
    lora = ["optim.train_type=lora", f"optim.lora_rank={args.lora_rank}", f"optim.lora_alpha={2 * args.lora_rank}",
            "optim.lora_dropout=0.05"]
    return {"clip": {"config": clip[0], "sets": common + clip[1], "peer": "open_clip_train"},
            "vlm_lora": {"config": vlm[0], "sets": common + vlm[1] + vlm_common + lora, "peer": "Trainer + peft",
                         "lora": True},
            "vlm_full": {"config": vlm[0], "sets": common + vlm[1] + vlm_common + [
                f"model.llm.num_hidden_layers={full_layers}"], "peer": "Trainer", "lora": False,
                "cut": full_layers},
            "siglip_b16": {"config": siglip[0], "sets": common + siglip[1], "peer": "open_clip_train"},
            "qwen_lora": {"config": qwen[0], "sets": common + qwen[1] + vlm_common + lora, "peer": "Trainer + peft", "lora": True,
                          "image_sizes": qwen_sizes},
            "qwen_full": {"config": qwen[0], "sets": common + qwen[1] + vlm_common + [
                f"model.llm.num_hidden_layers={full_layers}"], "peer": "Trainer", "lora": False, "cut": full_layers,
                "image_sizes": qwen_sizes},
            "qwen3_5_lora": {"config": qwen3_5[0], "sets": common + qwen3_5[1] + vlm_common + lora, "peer": "Trainer + peft",
                             "lora": True, "image_sizes": qwen3_5_sizes}}


def _data(tmp: str, job: str, cfg, n: int, sizes=None) -> list:
    """Synthetic data for ``job``: pairs at the tower's size, or chat samples (one image each, 15% text only:
    LLaVA's mix, packed into max_length rows) at the tower's size or, native resolution, of ``sizes``."""
    from mmpipe.data.synth import synth, synth_vlm
    size = None if sizes else family_of(cfg).pixels(cfg.model, cfg.data).size
    if family_of(cfg).data_format == "captions":
        info = synth(os.path.join(tmp, f"pairs_{job}"), n, val_fraction=0.0, size=size, progress=False)
    else:
        info = synth_vlm(os.path.join(tmp, f"chat_{job}"), n, val_fraction=0.0, size=size or 64, text_only=0.15,
                         progress=False, sizes=sizes)
    return [f"data.train={info['train']}"]


def run_mmpipe(name: str, spec: dict, data: list, args, tmp: str) -> dict:
    """One mmpipe run (the deepspeed launcher, one rank): samples/s, TFLOP/s, MFU, memory."""
    out = os.path.join(tmp, f"mmpipe_{name}")
    t0 = time.time()
    launch(1, spec["config"], spec["sets"] + data + list(args.sets), out)
    wall = time.time() - t0
    if args.out:  # the steps and (VLM) each micro-batch's samples, for reading the run afterwards
        import shutil
        os.makedirs(args.out, exist_ok=True)
        shutil.copy(os.path.join(out, "metrics.jsonl"), os.path.join(args.out, f"metrics_{name}.jsonl"))
        if os.path.isfile(os.path.join(out, "profile", "rank0.txt")):  # --set log.profile=[a,b]
            shutil.copy(os.path.join(out, "profile", "rank0.txt"), os.path.join(args.out, f"profile_{name}.txt"))
        if os.path.isfile(os.path.join(out, "samples", "rank0.jsonl")):
            shutil.copy(os.path.join(out, "samples", "rank0.jsonl"), os.path.join(args.out, f"samples_{name}.jsonl"))
    recs = _steps(out, args.warmup)
    step = statistics.median(r["step_time"] for r in recs)
    samples, first_length = 0, None
    log_file = os.path.join(out, "samples", "rank0.jsonl")
    if os.path.isfile(log_file):  # packed rows: the samples each step trained, from data.log_samples
        per = {}
        with open(log_file) as fh:
            for line in fh:
                r = json.loads(line)
                per[r["step"]] = per.get(r["step"], 0) + len(r["keys"])
                if r["step"] == 1 and "length" in r:  # the allocator's peak is the first step's
                    first_length = max(first_length or 0, r["length"])
        samples = statistics.median(v for k, v in per.items() if k > args.warmup)
    cfg = load_config(os.path.join(out, "config.yaml"))
    if not samples:  # packs: the samples a step trained; pairs: the batch
        samples = cfg.train.batch_size
    mem = next((r for r in read_memory_record(out) if r["rank"] == 0), None)  # metrics.jsonl's memory record
    params, trainable = (mem["params"] / 1e6, mem["trainable"] / 1e6) if mem else (None, None)
    peak_mb = mem["peak_mb"] if mem and mem["peak_of"] == "device" else None
    predicted = run_memory(cfg, out, 1, meta=True)[0].to_dict()["total"] / 2**20  # as planned: data.max_length
    at_first = None  # the same model at the first step's longest micro-batch (rows padded per micro-batch)
    if first_length is not None and first_length < cfg.data.max_length:
        at_first = run_memory(replace(cfg, data__max_length=first_length), out, 1, meta=True)[0].to_dict()["total"] / 2**20
    tflops = [r["tflops"] for r in recs if r.get("tflops") is not None]
    mfu = [r["mfu"] for r in recs if r.get("mfu") is not None]
    hfu = [r["hfu"] for r in recs if r.get("hfu") is not None]
    res = {"system": "mmpipe", "job": name, "step_s": step, "samples_per_step": samples, "samples_s": samples / step,
           "tflops": statistics.median(tflops) if tflops else None, "mfu": statistics.median(mfu) if mfu else None,
           "hfu": statistics.median(hfu) if hfu else None, "peak_mb": peak_mb, "predicted_mb": predicted,
           "first_length": first_length, "predicted_at_first_mb": at_first,
           "params_m": params, "trainable_m": trainable, "wall_s": wall, "steps": len(recs) + args.warmup,
           "step_times": [r["step_time"] for r in _steps(out, 0)]}
    _log(f"mmpipe {name}: {res['samples_s']:.1f} samples/s, step {step * 1e3:.0f} ms, peak {peak_mb} MB "
         f"(predicted {predicted:.0f}), MFU {res['mfu']}, {wall:.0f} s")
    return res


# ---- open_clip_train --------------------------------------------------------------------------------
def run_open_clip(spec: dict, args, tmp: str, on_cpu: bool) -> dict:
    """open_clip_train on the run's architecture, or on what open_clip has of it (the family's
    ``open_clip_peer``: SigLIP's is open_clip's own), one process, its synthetic data, amp_bf16."""
    cfg = load_config(spec["config"], spec["sets"])
    fam_cls = family_of(cfg)
    vocab = cfg.model.text.vocab_size or 49408
    tok = fam_cls.prepare_tokenizer(StandInTokenizer(vocab - len(fam_cls.special_tokens), fam_cls.special_tokens))
    cfg = replace(cfg, model=fam_cls.resolve(cfg.model, tok, cfg.data))
    family = fam_cls(cfg.model, cfg.train.seed)
    oc_cfg, loss_flags, towers = family.open_clip_peer()  # (towers: None where they are the run's own)
    oc_cfg["text_cfg"]["context_length"] = cfg.data.max_length
    job = spec["job"]
    cfg_dir = os.path.join(tmp, f"open_clip_config_{job}")
    os.makedirs(cfg_dir, exist_ok=True)
    with open(os.path.join(cfg_dir, "mmpipe-bench-gpu.json"), "w") as fh:
        json.dump(oc_cfg, fh)
    batch, o = cfg.train.batch_size, cfg.optim
    oc_args = ["--dataset-type", "synthetic", "--train-num-samples", str(batch * args.steps), "--model",
               "mmpipe-bench-gpu", "--batch-size", str(batch), "--epochs", "1", "--lr", str(o.lr), "--wd",
               str(o.weight_decay), "--warmup", "0", "--precision", "amp_bf16",
               "--workers", str(cfg.data.num_workers), "--log-every-n-steps", "1", "--logs", os.path.join(tmp, f"oc_logs_{job}"),
               "--name", "peer", "--save-frequency", "0", "--report-to", "", "--seed", "0", *loss_flags]
    if on_cpu:
        oc_args += ["--device", "cpu"]
    spec_path = os.path.join(tmp, f"open_clip_spec_{job}.json")
    with open(spec_path, "w") as fh:
        json.dump({"args": oc_args, "model_config_dir": cfg_dir, "synthetic": True,
                   "threads": max(1, (os.cpu_count() or 2) // 2)}, fh)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "mmpipe.bench.open_clip_worker", spec_path], capture_output=True,
                          text=True, env=env)
    wall = time.time() - t0
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit("mmpipe bench gpu: open_clip_train failed:\n" + "\n".join(text.splitlines()[-25:]))
    with open(os.path.join(tmp, f"oc_logs_{job}", "peer", "out.log")) as fh:
        times = [float(m.group(2)) for m in _OC_STEP.finditer(fh.read())]
    step = statistics.median(times[args.warmup:])
    peak = re.search(r"PEAK_MB (\d+)", text)
    res = {"system": " ".join(["open_clip_train", *loss_flags]), "job": job, "step_s": step,
           "samples_per_step": batch, "samples_s": batch / step, "peak_mb": float(peak.group(1)) if peak else None,
           "wall_s": wall, "steps": len(times), "step_times": times, "towers": towers}
    _log(f"{res['system']} {job}: {res['samples_s']:.1f} samples/s, step {step * 1e3:.0f} ms, {wall:.0f} s")
    return res


# ---- transformers' Trainer ---------------------------------------------------------------------------
def run_trainer(name: str, spec: dict, data: list, mm: dict, args, tmp: str) -> dict:
    """transformers' Trainer (+ peft) on the run's model in transformers (``LlavaForConditionalGeneration``,
    ``Qwen2_5_VLForConditionalGeneration``) built from its config,
    on the samples mmpipe trained, encoded by mmpipe's chat encoder (the same ids and labels), padded
    per micro-batch."""
    path = write_gpu_spec(os.path.join(tmp, f"mmpipe_{name}"), spec, mm, args, os.path.join(tmp, f"trainer_{name}"))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.time()
    import shutil
    cmd = [shutil.which("deepspeed") or "deepspeed", "--num_gpus", "1", "--master_port", str(free_port()),
           os.path.join(ROOT, "mmpipe", "bench", "trainer_worker.py"), "--gpu", path]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit("mmpipe bench gpu: the Trainer failed:\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-25:]))
    with open(path.replace(".json", "_out.json")) as fh:
        out = json.load(fh)
    step = statistics.median(out["step_times"][args.warmup:])
    res = {"system": spec["peer"], "job": name, "step_s": step, "samples_per_step": out["samples_per_step"],
           "samples_s": out["samples_per_step"] / step, "peak_mb": out["peak_mb"], "wall_s": wall,
           "steps": len(out["step_times"]), "step_times": out["step_times"], "tokens_per_step": out["tokens_per_step"],
           "images_per_step": out["images_per_step"]}
    _log(f"{spec['peer']} {name}: {res['samples_s']:.1f} samples/s, step {step * 1e3:.0f} ms, {wall:.0f} s")
    return res


# ---- the bench ----------------------------------------------------------------------------------------
def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def table(results: list) -> str:
    lines = ["| job | system | samples/s | vs peer | step ms | TFLOP/s per device | MFU | peak MB (allocator) | "
             "memory model MB | error | at the first step's shape |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    by_job = {}
    for r in results:
        by_job.setdefault(r["job"], []).append(r)
    for job, rows in by_job.items():
        peer = next((r for r in rows if r["system"] != "mmpipe"), None)
        for r in rows:
            ratio = r["samples_s"] / peer["samples_s"] if peer else None
            err = (r["predicted_mb"] / r["peak_mb"] - 1) * 100 if r.get("predicted_mb") and r.get("peak_mb") else None
            at = r.get("predicted_at_first_mb")
            at_text = "-" if at is None else f"{at:.0f} MB at {r['first_length']} tokens" + (
                f" ({(at / r['peak_mb'] - 1) * 100:+.1f}%)" if r.get("peak_mb") else "")
            lines.append(f"| {r.get('label', job)} | {r['system']} | {r['samples_s']:.1f} | {_fmt(ratio, '.2f')}x | "
                         f"{r['step_s'] * 1e3:.0f} | {_fmt(r.get('tflops'), '.1f')} | "
                         f"{_fmt(r.get('mfu') and 100 * r['mfu'], '.1f')}% | {_fmt(r.get('peak_mb'), '.0f')} | "
                         f"{_fmt(r.get('predicted_mb'), '.0f')} | {_fmt(err, '+.1f')}% | {at_text} |")
    return "\n".join(lines).replace("| -x |", "| - |").replace("| -% |", "| - |")


@with_scratch("gpu")
def bench_gpu(args, tmp: str) -> int:
    acc, device = _device()
    on_cpu = acc == "cpu"
    if on_cpu and not args.tiny:
        raise SystemExit("mmpipe bench gpu: no accelerator here; the real sizes need a GPU (run with --tiny for the "
                         "small configs on a CPU)")
    if args.pipeline:
        args.jobs = args.jobs or list(PIPELINE_JOBS)
        return bench_gpu_pipeline(args, tmp, job_specs(args), _data, (acc, device))
    args.jobs = args.jobs or list(JOBS)
    if "qwen_full" in args.jobs:
        raise SystemExit("mmpipe bench gpu: qwen_full is a --pipeline job")
    specs = job_specs(args)
    results = []

    def save():
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "results.json"), "w") as fh:
                json.dump({"device": device, "results": results, "args": vars(args) | {"func": None}}, fh, indent=1)

    for name in args.jobs:
        spec = dict(specs[name], job=name)
        cfg = load_config(spec["config"], spec["sets"])
        pairs = family_of(cfg).data_format == "captions"
        n = args.n or (2048 if pairs else cfg.train.batch_size * (args.steps + 1) * 4)  # ~3 per packed row
        _log(f"{name}: {n} synthetic samples ...")
        data = _data(tmp, name, cfg, n, spec.get("image_sizes"))
        if args.attention and not pairs:  # the first kernel is the run the peer is measured against
            spec = dict(spec, sets=spec["sets"] + [f"model.attention={args.attention[0]}"])
        try:
            mm = run_mmpipe(name, spec, data, args, tmp)
            if spec.get("cut"):
                mm["label"] = f"{name} ({spec['cut']} decoder blocks)"
            results.append(mm)
            save()
            for attention in ([] if pairs else (args.attention or [])[1:]):  # the same job, another kernel
                other = run_mmpipe(f"{name}_{attention}", dict(spec, sets=spec["sets"] + [f"model.attention={attention}"]),
                                   data, args, tmp)
                other.update(job=name, label=f"{mm.get('label', name)}, model.attention={attention}")
                results.append(other)
                save()
            if args.peers and spec["peer"]:
                peer = (run_open_clip(spec, args, tmp, on_cpu) if spec["peer"] == "open_clip_train"
                        else run_trainer(name, spec, data, mm, args, tmp))
                peer["label"] = mm.get("label", name)
                results.append(peer)
                save()
        except SystemExit as e:  # one job's failure is reported; the others still run
            _log(f"{name} FAILED: {e}")
            results.append({"system": "failed", "job": name, "error": str(e)[-2000:], "samples_s": 0.0, "step_s": 0.0})
            save()
    ok = [r for r in results if r["system"] != "failed"]
    text = table(ok)
    print(text)
    notes = (f"Device: {device} ({'GPU' if not on_cpu else 'CPU, tiny configs: the bench itself tested, no figure to read'}). "
             f"One rank, P = 1, bf16, {args.steps} steps, samples/s and TFLOP/s from the median step after the "
             f"first {args.warmup}. MFU = model FLOPs (forward + backward, no recompute; analytic per layer, "
             "mmpipe.planning.flops) / step time / the device's dense bf16 peak. Peak MB: the allocator's "
             "max_memory_allocated after the first step; memory model: `mmpipe.planning.memory` for the run's config "
             "sized on the meta device at data.max_length (what a plan must fit), and where the first step's rows were "
             "shorter (packed rows padded per micro-batch), the same model at that step's longest micro-batch, the "
             "shape the allocator's peak saw. CLIP: open_clip_train runs its own main on the same architecture (model config "
             "written from mmpipe's), its synthetic data, --precision amp_bf16 (fp32 weights, autocast); mmpipe: "
             "DeepSpeed bf16 (bf16 weights, fp32 master and AdamW state), data from JPEGs decoded by its loader. VLM: "
             "mmpipe packs chat samples into 2048-token rows; the Trainer gets the same samples (mmpipe's token ids "
             "and labels) padded per micro-batch, bf16 weights. Qwen2.5-VL: images of mixed sizes at native "
             "resolution (each its own token count), the ViT frozen.")
    for r in ok:
        if r.get("towers"):
            notes += f" {r['job']}: {r['system']} trains {r['towers']}."
    if not args.no_append and ok:
        cmd = "mmpipe bench gpu " + " ".join(shlex.quote(a) for a in sys.argv[3:])
        append_benchmarks(f"GPU bench at real sizes ({device})" if not on_cpu else "GPU bench (tiny, CPU)", cmd,
                          text, notes)
    save()
    return 0 if len(ok) == len(results) else 1


def add_arguments(p) -> None:
    p.add_argument("--jobs", nargs="+", choices=JOBS + ("qwen_full",), default=None,
                   help=f"default: {' '.join(JOBS)}; with --pipeline: clip vlm_full qwen_full")
    p.add_argument("--pipeline", action="store_true", help="P = 2 on the devices present (two GPUs, or two ranks "
                   "sharing one: NCCL >= 2.30) against P = 1 on the same device, at --accumulation: losses, every "
                   "gradient, memory per stage against the memory model, stage timing, no hang (docs/gpu.md)")
    p.add_argument("--attention", nargs="+", choices=("sdpa", "varlen"), default=None,
                   help="chat jobs: mmpipe once per model.attention (the first beside the peer), e.g. sdpa varlen; "
                   "--pipeline: the chat jobs' (the first)")
    p.add_argument("--accumulation", nargs="+", type=int, default=[1, 8], help="--pipeline: gradient accumulation steps")
    p.add_argument("--share-device", action="store_true", help="--pipeline: both ranks on device 0 (LOCAL_RANK 0) "
                   "even with two devices present; on the CPU, the one-GPU launch's twin")
    p.add_argument("--timeout", type=float, default=600, help="--pipeline: seconds a run may take before it counts "
                   "as a hang")
    p.add_argument("--tiny", action="store_true", help="the tiny test configs (a CPU is enough)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the median")
    p.add_argument("--n", type=int, default=None, help="synthetic samples per job (default: enough for the steps)")
    p.add_argument("--vlm-micro-batch", type=int, default=2, help="VLM packed rows per micro-batch")
    p.add_argument("--vlm-batch", type=int, default=8, help="VLM packed rows per step")
    p.add_argument("--full-layers", type=int, default=8, help="decoder blocks of the full-training VLM job")
    p.add_argument("--lora-rank", type=int, default=128, help="LoRA r (alpha = 2r, LLaVA's 128/256)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for mmpipe's runs (repeatable), e.g. log.profile=[6,8]")
    p.add_argument("--no-peers", dest="peers", action="store_false", help="mmpipe only")
    p.add_argument("--out", default=None, help="also write DIR/results.json")
    p.add_argument("--no-append", action="store_true")
    p.set_defaults(func=bench_gpu)
