"""ms-swift (``swift sft``) on a peers bench's job, in its own virtual environment.

ms-swift 4.x pins ``transformers<5.20`` and cannot share mmpipe's environment: the bench builds a venv once
(``~/.cache/mmpipe/swift-venv``, or ``--swift-venv DIR``; its path printed) with ms-swift and this
environment's torch, torchvision and DeepSpeed versions, and runs ``swift sft`` from it as users type it
(``NPROC_PER_NODE``, ``--deepspeed zero2``, ``--per_device_train_batch_size``, ``--gradient_accumulation_steps``)
on the same transformers directory, the same samples in mmpipe's order (the JSONL rewritten in that order:
ms-swift's sequential sampler, unshuffled, gives each optimizer step the same samples mmpipe's step has),
the same AdamW settings and schedule, full weights (ViT and merger trained, as mmpipe's full run) or LoRA
(all-linear on the decoder, the tower frozen, as mmpipe's). Its per-step losses and times come from its
``logging.jsonl``."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from mmpipe.bench.common import free_port

# the ``swift sft`` model types of mmpipe's families that ms-swift trains (LLaVA's tiny directories are no
# llava-hf checkpoint ms-swift knows: not run)
MODEL_TYPES = {"qwen2_5_vl": "qwen2_5_vl"}
DEFAULT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "mmpipe", "swift-venv")


def _log(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def swift_venv(path: str = None) -> str:
    """The venv holding ``swift`` (``path``, else ``DEFAULT_VENV``), built there once when it has none."""
    venv = os.path.abspath(path or DEFAULT_VENV)
    swift = os.path.join(venv, "bin", "swift")
    if os.path.exists(swift):
        _log(f"ms-swift from {venv}")
        return venv
    if path:
        raise SystemExit(f"mmpipe bench peers: --swift-venv {path} has no bin/swift: give a venv with ms-swift "
                         "installed, or leave --swift-venv out to build one")
    import deepspeed
    import torch
    import torchvision
    _log(f"building ms-swift's environment in {venv} (once; --swift-venv DIR to bring one) ...")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    pip = [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q"]
    torch_v, vision_v = torch.__version__.split("+")[0], torchvision.__version__.split("+")[0]
    proc = subprocess.run(pip + [f"torch=={torch_v}", f"torchvision=={vision_v}"], capture_output=True, text=True)
    if proc.returncode == 0:
        proc = subprocess.run(pip + ["ms-swift>=4,<5", f"deepspeed=={deepspeed.__version__}", "qwen_vl_utils"],
                              capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(swift):
        raise SystemExit("mmpipe bench peers: could not install ms-swift into " + venv + ":\n"
                         + "\n".join((proc.stdout + proc.stderr).splitlines()[-15:]))
    return venv


def ordered_jsonl(train: str, order: list, out: str) -> str:
    """``train``'s rows in mmpipe's sample order (image paths made absolute), as ``out``."""
    base = os.path.dirname(os.path.abspath(train))
    rows = [json.loads(line) for line in open(train)]
    with open(out, "w") as fh:
        for i in order:
            r = dict(rows[i])
            if r.get("images"):
                r["images"] = [p if os.path.isabs(p) else os.path.join(base, p) for p in r["images"]]
            fh.write(json.dumps(r) + "\n")
    return out


def placeholder_plugin(model_dir: str, out: str) -> str:
    """An ms-swift plugin (``--external_plugins``) that gives its Qwen templates the directory's own ids of
    ``<|image_pad|>`` / ``<|video_pad|>``. ms-swift hard-codes Qwen's vocabulary ids (151655 / 151656): on a
    directory whose tokenizer puts them elsewhere (the bench's tiny ones) it expands no placeholder, and the model's
    ``masked_scatter`` then silently keeps the first feature row of each image — a different loss, not a crash.
    On a real Qwen checkpoint the plugin sets the ids they already have."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    image, video = tok.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"])
    with open(out, "w") as fh:
        fh.write("# written by mmpipe bench peers: the model directory's placeholder ids (see mmpipe/bench/swift.py)\n"
                 "from swift.template.templates.qwen import Qwen2VLTemplate\n"
                 f"Qwen2VLTemplate.image_token_id, Qwen2VLTemplate.video_token_id = {image}, {video}\n")
    return out


def step_times(logged: list) -> list:
    """Each step's seconds from ms-swift's running mean ``train_speed(s/it)`` after step n (the mean of steps 1..n)."""
    speeds = [float(r["train_speed(s/it)"]) for r in logged]
    return [speeds[0]] + [n * speeds[n - 1] - (n - 1) * speeds[n - 2] for n in range(2, len(speeds) + 1)]


def run_swift(venv: str, family: str, model_dir: str, train: str, order: list, cfg, args, tmp: str, lora: bool) -> dict:
    """``swift sft`` on 2 ranks (DeepSpeed ZeRO-2) of the job: ``{"losses", "step_times", "trainable"}``."""
    name = "swift_lora" if lora else "swift_full"
    data = ordered_jsonl(train, order, os.path.join(tmp, name + "_train.jsonl"))
    mbs, batch = args.micro_batch, cfg.train.batch_size
    o = cfg.optim
    cmd = [os.path.join(venv, "bin", "swift"), "sft", "--model", model_dir, "--model_type", MODEL_TYPES[family],
           "--template", MODEL_TYPES[family], "--dataset", data, "--output_dir", os.path.join(tmp, name),
           "--per_device_train_batch_size", str(mbs), "--gradient_accumulation_steps", str(batch // (2 * mbs)),
           "--max_steps", str(args.steps), "--learning_rate", str(o.lr), "--lr_scheduler_type", "constant",
           "--warmup_ratio", "0", "--weight_decay", str(o.weight_decay), "--adam_beta1", str(o.betas[0]),
           "--adam_beta2", str(o.betas[1]), "--adam_epsilon", str(o.eps), "--max_grad_norm", "0",
           "--max_length", str(cfg.data.max_length), "--truncation_strategy", "delete",
           "--dataset_shuffle", "false", "--train_dataloader_shuffle", "false", "--dataset_num_proc", "1",
           "--dataloader_num_workers", "0", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
           # (ms-swift turns fp16 autocast on for a float32 model unless told: its first steps then overflow)
           "--torch_dtype", "float32", "--fp16", "false", "--bf16", "false", "--deepspeed", "zero2",
           "--seed", str(cfg.train.seed),
           "--external_plugins", placeholder_plugin(model_dir, os.path.join(tmp, "swift_placeholders.py"))]
    if lora:
        cmd += ["--tuner_type", "lora", "--lora_rank", str(args.lora_rank), "--lora_alpha", str(args.lora_alpha),
                "--lora_dropout", "0", "--target_modules", "all-linear", "--freeze_vit", "true", "--freeze_aligner", "true"]
    else:
        cmd += ["--tuner_type", "full", "--freeze_vit", "false", "--freeze_aligner", "false"]
    on_cpu = _on_cpu()
    if on_cpu:
        cmd += ["--use_cpu", "true"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(NPROC_PER_NODE="2", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1",
               PATH=os.path.join(venv, "bin") + os.pathsep + env.get("PATH", ""),
               MIN_PIXELS=str(cfg.data.min_pixels), MAX_PIXELS=str(cfg.data.max_pixels))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
    runs = sorted(d for d in os.listdir(os.path.join(tmp, name)) if d.startswith("v")) \
        if os.path.isdir(os.path.join(tmp, name)) else []
    log = os.path.join(tmp, name, runs[-1], "logging.jsonl") if runs else None
    if proc.returncode != 0 or not log or not os.path.exists(log):
        lines = (proc.stdout + proc.stderr).splitlines()
        first = next((k for k, line in enumerate(lines) if "Traceback" in line), max(0, len(lines) - 25))
        raise SystemExit(f"mmpipe bench peers: swift sft failed: {' '.join(cmd)}\n" + "\n".join(lines[first:first + 40]))
    recs = [json.loads(line) for line in open(log)]
    steps = [r for r in recs if "loss" in r and "global_step/max_steps" in r]
    last = next((r for r in recs if "model_parameter_info" in r), {})
    history = [r["loss"] for r in last.get("log_history", []) if "loss" in r]  # (full precision; the lines: 8 digits)
    return {"losses": history or [float(r["loss"]) for r in steps], "step_times": step_times(steps),
            "trainable": last.get("model_parameter_info", "")}


def _on_cpu() -> bool:
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().device_name() == "cpu"


def _free_port() -> int:
    return free_port()
