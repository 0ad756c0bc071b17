"""``mmpipe bench peers --family clip``: the same CLIP job trained by ``open_clip_train`` (torchrun,
2 processes, gloo, DDP) and by mmpipe in the layout it chooses (``parallel.layout: auto``), from
the same initial weights (converted to open_clip's names and checked equal on a batch), on the same
synthetic pairs, token ids and pixels, with the same global batch, steps, lr schedule and AdamW
settings: samples/s of each, their ratio, and both models' zero-shot retrieval recall on the same
held-out pairs."""
from __future__ import annotations

import csv
import json
import os
import re
import shlex
import statistics
import subprocess
import sys

import torch

from mmpipe.bench.common import ROOT, append_benchmarks, free_port, launch, with_scratch
from mmpipe.bench.open_clip_worker import open_clip_tokenizer
from mmpipe.bench.peers_vlm import bench_peers_vlm
from mmpipe.config.registry import BUILTIN, get_family
from mmpipe.config.schema import family_of, load_config, replace
from mmpipe.data.decode import load_image
from mmpipe.data.manifest import read_manifest
from mmpipe.data.synth import synth
from mmpipe.data.tokenizer import load_tokenizer, train_tokenizer
from mmpipe.families.clip.open_clip_format import open_clip_config, open_clip_state
from mmpipe.families.clip.retrieval import retrieval_metrics
from mmpipe.families.towers.common import normalize_pixels
from mmpipe.parallel.plain import plain_model
from mmpipe.train.metrics import read_metrics

MODEL_NAME = "mmpipe-bench-peer"
_STEP_LINE = re.compile(r"Train Epoch: \d+ \[\s*(\d+)/\d+.*?Batch \(t\): [\d.]+, ([\d.]+)/s,")


def _log(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


class Job:
    """What both systems train: the config (its tokenizer fixed to one trained on the captions), the
    family, the data and the initial weights."""

    def __init__(self, args, tmp: str):
        # a family whose open_clip job is CLIP towers with other settings (siglip: the sigmoid loss, --siglip)
        self.peer_sets = list(getattr(get_family(args.family, "--family"), "open_clip_peer_sets", ()))
        self.sigmoid = "model.loss=sigmoid" in self.peer_sets
        cfg = load_config(args.config, self.peer_sets)
        self.family_cls = family_of(cfg)
        size = self.family_cls.pixels(cfg.model, cfg.data).size
        _log(f"synthetic data: {args.n} pairs ...")
        info = synth(os.path.join(tmp, "data"), args.n, val_fraction=args.val_fraction, seed=0, progress=False)
        self.train, self.val = read_manifest(info["train"]), read_manifest(info["val"], key="data.val")
        tok_dir = os.path.join(tmp, "tokenizer")
        train_tokenizer([s.text for s in self.train], cfg.data.tokenizer_vocab_size, tok_dir).save_pretrained(tok_dir)
        self.tok_dir, self.tokenizer = tok_dir, self.family_cls.prepare_tokenizer(load_tokenizer(tok_dir))
        self.sets = [f"data.train={info['train']}", f"data.val={info['val']}", f"data.tokenizer={tok_dir}",
                     f"train.steps={args.steps}", f"train.eval_every={args.steps}", f"train.save_every={args.steps}",
                     "parallel.layout=auto", "log.progress=false"] + self.peer_sets
        # open_clip runs each rank's share of the batch as one batch: mmpipe gets the same micro-batch
        self.sets.append(f"parallel.micro_batch_size={load_config(args.config).train.batch_size // 2}")
        cfg = load_config(args.config, self.sets)
        cfg = replace(cfg, model=self.family_cls.resolve(cfg.model, self.tokenizer, cfg.data))
        self.cfg, self.size = cfg, size
        self.family = self.family_cls(cfg.model, cfg.train.seed)
        self.model = plain_model(self.family).eval()  # mmpipe's initial weights (each layer seeded by name)

    # ---- the same batch through both models -------------------------------------------------------
    def pixels(self, samples) -> torch.Tensor:
        return torch.stack([load_image(s.image, self.size) for s in samples])

    def ids(self, samples) -> torch.Tensor:
        return open_clip_tokenizer(self.tokenizer, self.cfg.data.max_length)([s.text for s in samples])

    def features(self, model, samples, batch: int = 64) -> tuple:
        """(image, text) features of ``samples`` by an open_clip model or (``model`` None) mmpipe's."""
        v = self.family.vision
        imgs, txts = [], []
        with torch.no_grad():
            for i in range(0, len(samples), batch):
                part = samples[i:i + batch]
                pix, ids = self.pixels(part), self.ids(part)
                if model is None:
                    imgs.append(self.model.encode_image(pix))
                    txts.append(self.model.encode_text(ids, (ids != self.pad_id).long()))
                else:
                    imgs.append(model.encode_image(normalize_pixels(pix, v.mean, v.std, torch.float32)))
                    txts.append(model.encode_text(ids))
        return torch.cat(imgs), torch.cat(txts)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0


def _open_clip_model(cfg_dir: str, weights: str, sigmoid: bool = False):
    """open_clip's model (built as ``--siglip`` builds it, with a ``logit_bias``, for the sigmoid loss)."""
    import math

    import open_clip
    open_clip.add_model_config(cfg_dir)
    kw = {"init_logit_scale": math.log(10), "init_logit_bias": -10} if sigmoid else {}
    return open_clip.create_model(MODEL_NAME, pretrained=weights, **kw).eval()  # its loader: checkpoints, state dicts


def _write_csv(job: Job, path: str, rows: int) -> None:
    """open_clip's CSV: the training pairs repeated in order to ``rows`` (its DistributedSampler shuffles)."""
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["filepath", "title"])
        for i in range(rows):
            s = job.train[i % len(job.train)]
            w.writerow([s.image, s.text])


def run_open_clip(job: Job, args, tmp: str) -> str:
    """open_clip_train on 2 ranks; returns its log directory."""
    cfg = job.cfg
    cfg_dir = os.path.join(tmp, "open_clip_config")
    os.makedirs(cfg_dir, exist_ok=True)
    with open(os.path.join(cfg_dir, MODEL_NAME + ".json"), "w") as fh:
        json.dump(open_clip_config(job.family), fh)
    start = os.path.join(tmp, "open_clip_start.pt")
    torch.save(open_clip_state(job.family, job.model.state_dict()), start)
    check = job.train[:32]  # the same start: open_clip's model computes mmpipe's features
    (a, b), (c, d) = job.features(_open_clip_model(cfg_dir, start, job.sigmoid), check), job.features(None, check)
    err = max(float((a - c).abs().max()), float((b - d).abs().max()))
    if err > 1e-4:
        raise SystemExit(f"mmpipe bench peers: open_clip's model differs from mmpipe's at the start (max |diff| {err:.2e})")
    _log(f"initial weights converted to open_clip's CLIP: features equal on {len(check)} pairs (max |diff| {err:.1e})")
    data = os.path.join(tmp, "open_clip_train.csv")
    batch = cfg.train.batch_size
    _write_csv(job, data, args.steps * batch)
    o = cfg.optim
    logs = os.path.join(tmp, "open_clip_logs")
    oc_args = ["--train-data", data, "--dataset-type", "csv", "--csv-img-key", "filepath", "--csv-caption-key", "title",
               "--csv-separator", ",", "--model", MODEL_NAME, "--pretrained", start, "--batch-size", str(batch // 2),
               "--epochs", "1", "--lr", str(o.lr), "--wd", str(o.weight_decay), "--warmup", str(o.warmup_steps),
               "--beta1", str(o.betas[0]), "--beta2", str(o.betas[1]), "--eps", str(o.eps), "--precision", "fp32",
               "--workers", str(cfg.data.num_workers), "--device", "cpu", "--dist-backend", "gloo",
               *(["--siglip"] if job.sigmoid else ["--gather-with-grad"]), "--log-every-n-steps", "1", "--logs", logs, "--name", "peer",
               "--save-frequency", "1", "--report-to", "", "--seed", str(cfg.train.seed)]
    spec = os.path.join(tmp, "open_clip_spec.json")
    v = job.family.vision
    with open(spec, "w") as fh:
        json.dump({"args": oc_args, "model_config_dir": cfg_dir, "tokenizer": job.tok_dir,
                   "max_length": cfg.data.max_length, "image_size": job.size, "mean": list(v.mean), "std": list(v.std),
                   "threads": max(1, (os.cpu_count() or 2) // 2)}, fh)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "mmpipe.bench.open_clip_worker", spec]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = "\n".join([ln for ln in (proc.stdout + proc.stderr).splitlines() if "Error" in ln or "error" in ln][-12:])
        raise SystemExit(f"mmpipe bench peers: open_clip_train failed: {' '.join(cmd)}\n{tail}")
    return os.path.join(logs, "peer")


def open_clip_step_times(log_dir: str, batch: int) -> list:
    """Each logged step's time (seconds) from open_clip's ``out.log`` (``--log-every-n-steps 1``)."""
    with open(os.path.join(log_dir, "out.log")) as fh:
        return [batch / float(m.group(2)) for m in _STEP_LINE.finditer(fh.read())]


@with_scratch("peers")
def bench_peers(args, tmp: str) -> int:
    job = Job(args, tmp)
    batch = job.cfg.train.batch_size
    _log(f"open_clip_train: 2 ranks (torchrun, gloo), {args.steps} steps of {batch} ...")
    oc_dir = run_open_clip(job, args, tmp)
    oc_steps = open_clip_step_times(oc_dir, batch)[args.warmup:]
    oc_model = _open_clip_model(os.path.join(tmp, "open_clip_config"),
                                os.path.join(oc_dir, "checkpoints", "epoch_1.pt"), job.sigmoid)
    oc_recall = retrieval_metrics(*job.features(oc_model, job.val), captions=[s.text for s in job.val])
    _log(f"mmpipe: 2 ranks (deepspeed launcher, parallel.layout=auto), {args.steps} steps of {batch} ...")
    out = os.path.join(tmp, "mmpipe_run")
    launch(2, args.config, job.sets, out)
    mm_steps = [r["step_time"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))][args.warmup:]
    mm_recall = read_metrics(os.path.join(out, "metrics.jsonl"), "eval")[-1]
    with open(os.path.join(out, "layout.json")) as fh:
        layout = json.load(fh)["chosen"]["name"]
    oc_sps, mm_sps = batch / statistics.median(oc_steps), batch / statistics.median(mm_steps)
    lines = ["| system | layout | samples/s | vs open_clip | i2t R@1 | i2t R@5 | t2i R@1 | t2i R@5 |",
             "|---|---|---|---|---|---|---|---|"]
    for name, lay, sps, r in (("open_clip_train", "DDP 2 ranks", oc_sps, oc_recall), ("mmpipe", layout, mm_sps, mm_recall)):
        lines.append(f"| {name} | {lay} | {sps:.1f} | {sps / oc_sps:.2f}x | {r['i2t_r1']:.3f} | {r['i2t_r5']:.3f} | "
                     f"{r['t2i_r1']:.3f} | {r['t2i_r5']:.3f} |")
    table = "\n".join(lines)
    print(table)
    import open_clip
    notes = (f"{os.path.basename(args.config)}'s model ({job.cfg.model.vision.num_hidden_layers}+"
             f"{job.cfg.model.text.num_hidden_layers}-layer CLIP ViT + CLIP text), {args.n} synthetic pairs "
             f"({len(job.val)} held out for recall, chance R@1 {1 / len(job.val):.3f}), global batch {batch}, "
             f"{args.steps} steps, fp32, 2 ranks on this machine's cores, micro-batch {batch // 2} for both (open_clip "
             f"runs each rank's share as one batch); samples/s from the median step after the "
             f"first {args.warmup} (open_clip: its own per-step `Batch (t)` log; mmpipe: its metrics). Both start from "
             "mmpipe's initial weights, converted to open_clip's names and checked equal on a batch, and read the "
             "same token ids (mmpipe's tokenizer) and pixels (mmpipe's decode and resize): open_clip_train "
             f"{open_clip.__version__} runs its own `main` under torchrun with those two functions swapped in and "
             "`device_ids` dropped from its DDP wrapper (torch refuses it for a CPU module), "
             + ("`--siglip` (SigLIP's sigmoid loss over the global batch, its features exchanged between the ranks "
                "in a ring, as mmpipe's `model.loss: sigmoid` with `negatives: global`; scale log 10 and bias -10 "
                "at the start in both). Differences left: open_clip weight-decays the position and token embeddings "
                "(mmpipe does not), clamps `logit_scale` at ln 100 after each step (mmpipe does not clamp the "
                "sigmoid loss's scale, as transformers), pads every caption to " if job.sigmoid else
                "`--gather-with-grad` (the exact gradient of the global-batch loss, as mmpipe's `negatives: global`). "
                "Differences left: open_clip weight-decays the position and token embeddings (mmpipe does not), "
                "clamps `logit_scale` at ln 100 after each step (mmpipe clamps the scale in the loss), pads every "
                "caption to ")
             + f"{job.cfg.data.max_length} tokens (mmpipe pads to the batch's longest) and samples with its "
             "DistributedSampler (mmpipe with its own seeded sampler), so recall agrees within noise, not exactly.")
    if not args.no_append:
        given = sys.argv[3:]
        cmd = "mmpipe bench peers " + " ".join(shlex.quote(a) for a in
                                               (given if "--family" in given else ["--family", args.family] + given))
        append_benchmarks("Peers: mmpipe vs open_clip_train (" + ("SigLIP loss" if job.sigmoid else "CLIP") + ")",
                          cmd, table, notes)
    return 0


def bench_peers_any(args) -> int:
    if get_family(args.family, "--family").data_format == "chat":
        args.config = args.config or os.path.join(ROOT, "configs", f"bench_{args.family}.yaml")
        args.n = args.n or 400
        args.steps = args.steps or 12
        args.warmup = 3 if args.warmup is None else args.warmup
        return bench_peers_vlm(args)
    args.config = args.config or os.path.join(ROOT, "configs", "demo.yaml")
    args.n, args.steps = args.n or 4200, args.steps or 400
    args.warmup = 10 if args.warmup is None else args.warmup
    return bench_peers(args)


def add_arguments(p) -> None:
    p.add_argument("--family", choices=tuple(BUILTIN), default="clip",
                   help="clip: against open_clip_train; siglip: against open_clip_train --siglip (CLIP towers, "
                        "SigLIP's sigmoid loss); vlm, qwen2_5_vl, qwen3_5: against transformers' Trainer + DeepSpeed ZeRO-2, "
                        "full weights and LoRA")
    p.add_argument("--config", default=None, help="default: configs/demo.yaml (clip), configs/bench_FAMILY.yaml (a chat family)")
    p.add_argument("--n", type=int, default=None, help="synthetic pairs (clip: 4200) or chat samples (vlm: 400)")
    p.add_argument("--micro-batch", type=int, default=4, help="vlm: micro-batch of both systems")
    p.add_argument("--lora-rank", type=int, default=8, help="vlm: LoRA r")
    p.add_argument("--lora-alpha", type=int, default=32, help="vlm: LoRA alpha")
    p.add_argument("--val-fraction", type=float, default=0.0477, help="held out for recall")
    p.add_argument("--steps", type=int, default=None, help="clip: 400, vlm: 12")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of the samples/s median (clip 10, vlm 3)")
    p.add_argument("--swift", action="store_true",
                   help="qwen2_5_vl: also run ms-swift's `swift sft` (full and LoRA, NPROC_PER_NODE=2, --deepspeed zero2) "
                        "from its own venv, built once in ~/.cache/mmpipe/swift-venv")
    p.add_argument("--swift-venv", default=None, metavar="DIR", help="a venv with ms-swift installed (implies --swift)")
    p.add_argument("--no-append", action="store_true")
    p.set_defaults(func=bench_peers_any)
