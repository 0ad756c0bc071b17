"""``mmpipe bench peers --family vlm``: the same LLaVA-style fine-tune by the plain route (transformers'
``Trainer`` + DeepSpeed ZeRO-2, a minimal chat collator on the directory's processor, the ``deepspeed``
launcher) and by mmpipe in the layout it chooses (``parallel.layout: auto``), full weights and LoRA:
the same local LLaVA directory (mmpipe's initial weights saved with ``save_pretrained``), the same
chat data in the same sample order, global batch, steps, ranks and AdamW settings. Prints each
system's first-step loss (same weights, same first batch: they must agree), samples/s and the ratio."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys

from mmpipe.bench import swift as ms
from mmpipe.bench.common import ROOT, append_benchmarks, free_port, launch, with_scratch
from mmpipe.bench.trainer_worker import encode
from mmpipe.config.schema import family_of, load_config, replace
from mmpipe.data.sampler import MicroBatchSampler
from mmpipe.data.synth import MIXED_SIZES, synth_vlm
from mmpipe.data.tokenizer import load_tokenizer, train_tokenizer
from mmpipe.families.chat import chat_texts, read_chat
from mmpipe.families.qwen_vl import Qwen25VLFamily
from mmpipe.families.qwen_vl.tiny import _tokenizer
from mmpipe.parallel.plain import plain_model
from mmpipe.train.metrics import read_memory_record, read_metrics


def _log(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def make_hf_dir(args, tmp: str) -> tuple:
    """(config, chat file, model directory): synthetic chat data, a tokenizer trained on it, and the
    model's initial weights as the family's transformers directory (``LlavaForConditionalGeneration``,
    ``Qwen2_5_VLForConditionalGeneration``) with its processor."""
    cfg = load_config(args.config)
    fam_cls = family_of(cfg)
    size = getattr(fam_cls.pixels(cfg.model, cfg.data), "size", None)
    # a native-resolution family (no fixed size) gets images of mixed sizes
    info = synth_vlm(os.path.join(tmp, "data"), args.n, val_fraction=0.0, size=size or 64, seed=0, text_only=0.15,
                     progress=False, sizes=None if size else MIXED_SIZES)
    tok_dir = os.path.join(tmp, "tokenizer")
    texts = chat_texts(read_chat(info["train"]))
    if issubclass(fam_cls, Qwen25VLFamily):  # a Qwen checkpoint's layout: byte-level BPE with Qwen's special tokens and
        # ChatML template (its default system prompt), as ms-swift's
        # (byte-level: at least 512 entries, so merges exist beyond the 256 bytes)
        _tokenizer(texts + ["You are a helpful assistant."], max(cfg.data.tokenizer_vocab_size, 512)).save_pretrained(tok_dir)
        tok = fam_cls.prepare_tokenizer(load_tokenizer(tok_dir))  # qwen templates encode it
    else:
        tok = fam_cls.prepare_tokenizer(train_tokenizer(texts, cfg.data.tokenizer_vocab_size, tok_dir))
    cfg = replace(cfg, model=fam_cls.resolve(cfg.model, tok, cfg.data))
    family = fam_cls(cfg.model, cfg.train.seed)
    model, processor = family.hf_export(plain_model(family).state_dict(), tok, cfg.data)
    if getattr(family, "aux_coef", 0):  # a MoE model: transformers adds the router's loss only when asked (ms-swift
        model.config.text_config.output_router_logits = True  # asks when router_aux_loss_coef > 0), as mmpipe does
    llava = os.path.join(tmp, "hf_model")
    model.save_pretrained(llava)
    processor.save_pretrained(llava)
    return cfg, info["train"], llava


def check_same_tokens(cfg, train: str, llava: str, order: list, n: int) -> int:
    """The Trainer's collator gives mmpipe's ids and labels for the first ``n`` samples (checked, not
    assumed); returns how many were compared."""
    from transformers import AutoProcessor
    fam_cls = family_of(cfg)
    processor = AutoProcessor.from_pretrained(llava)
    tok = fam_cls.prepare_tokenizer(load_tokenizer(llava))
    family = fam_cls(replace(cfg, model=fam_cls.resolve(cfg.model, tok, cfg.data)).model, cfg.train.seed)
    samples = read_chat(train)
    enc = family.encoder(tok, cfg.data.max_length, cfg.data)
    rows = [json.loads(line) for line in open(train)]
    for i in order[:n]:
        ours = enc.encode(samples[i])
        theirs = encode(processor, rows[i], os.path.dirname(train), cfg.data.max_length)
        if theirs["input_ids"].tolist() != ours.input_ids or theirs["labels"].tolist() != ours.labels:
            raise SystemExit(f"mmpipe bench peers: sample {i}: the Trainer's collator and mmpipe disagree on its tokens "
                             f"or labels:\n  {theirs['input_ids'].tolist()}\n  {ours.input_ids}")
    return n


def run_trainer(cfg, train: str, llava: str, order: list, args, tmp: str, lora: bool) -> dict:
    name = "trainer_lora" if lora else "trainer_full"
    ds = os.path.join(tmp, "ds_zero2.json")
    with open(ds, "w") as fh:
        json.dump({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                   "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 2},
                   "bf16": {"enabled": False}, "fp16": {"enabled": False}}, fh)
    mbs = args.micro_batch
    spec = {"llava": llava, "train": train, "order": order, "max_length": cfg.data.max_length, "micro_batch": mbs,
            "accumulation": cfg.train.batch_size // (2 * mbs), "steps": args.steps, "seed": cfg.train.seed,
            "optim": {"lr": cfg.optim.lr, "weight_decay": cfg.optim.weight_decay, "betas": list(cfg.optim.betas),
                      "eps": cfg.optim.eps},
            "ds_config": ds, "tmp": os.path.join(tmp, name), "out": os.path.join(tmp, name + ".json"),
            "threads": max(1, (os.cpu_count() or 2) // 2),
            "lora": {"r": args.lora_rank, "alpha": args.lora_alpha} if lora else None}
    path = os.path.join(tmp, name + "_spec.json")
    with open(path, "w") as fh:
        json.dump(spec, fh)
    cmd = [shutil.which("deepspeed") or "deepspeed", "--num_gpus", "2", "--master_port", str(free_port()),
           os.path.join(ROOT, "mmpipe", "bench", "trainer_worker.py"), path]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).splitlines()
        first = next((k for k, line in enumerate(lines) if "Traceback" in line), max(0, len(lines) - 25))
        tail = "\n".join(lines[first:first + 40])  # the first rank's error, not the others' broken connections
        raise SystemExit(f"mmpipe bench peers: Trainer failed: {' '.join(cmd)}\n{tail}")
    with open(spec["out"]) as fh:
        return json.load(fh)


@with_scratch("peers-vlm")
def bench_peers_vlm(args, tmp: str) -> int:
    _log(f"synthetic chat data ({args.n} samples), a tokenizer, the initial weights as a transformers directory ...")
    cfg, train, llava = make_hf_dir(args, tmp)
    batch = cfg.train.batch_size
    n = len(read_chat(train))
    sampler = MicroBatchSampler(n, args.micro_batch, batch // args.micro_batch, 1, 0, cfg.train.seed,
                                max_steps=args.steps)
    order = [i for mb in list(sampler)[:args.steps * batch // args.micro_batch] for i, _ in mb]
    _log(f"the Trainer's collator gives mmpipe's tokens and labels on the first step's "
         f"{check_same_tokens(cfg, train, llava, order, batch)} samples")
    sets = [f"model.pretrained={llava}", f"data.tokenizer={llava}", f"data.train={train}", "data.val=null",
            f"train.steps={args.steps}", "train.eval_every=0", f"train.save_every={args.steps}", "parallel.layout=auto",
            f"parallel.micro_batch_size={args.micro_batch}", "log.progress=false", "optim.schedule=constant",
            "data.padding=batch", "data.pad_multiple=1",
            "optim.warmup_steps=0"]
    lora_sets = ["optim.train_type=lora", f"optim.lora_rank={args.lora_rank}", f"optim.lora_alpha={args.lora_alpha}",
                 "optim.lora_dropout=0"]
    rows, trainable = [], []
    swift = _swift(args)
    for lora in (False, True):
        what = "LoRA" if lora else "full"
        _log(f"Trainer + DeepSpeed ZeRO-2 ({what}): 2 ranks, {args.steps} steps of {batch} ...")
        peer = run_trainer(cfg, train, llava, order, args, tmp, lora)
        _log(f"mmpipe ({what}, parallel.layout=auto): 2 ranks, {args.steps} steps of {batch} ...")
        out = os.path.join(tmp, f"mmpipe_{what}")
        launch(2, args.config, sets + (lora_sets if lora else []), out)
        recs = read_metrics(os.path.join(out, "metrics.jsonl"))
        with open(os.path.join(out, "layout.json")) as fh:
            layout = json.load(fh)["chosen"]["name"]
        ours = sum({r["stage"]: r["trainable"] for r in read_memory_record(out)}.values())  # one replica
        _log(f"trainable parameters ({what}): Trainer {peer.get('trainable')}, mmpipe {ours}"
             + ("" if peer.get("trainable") == ours else "  NOT the same"))
        trainable.append((what, peer.get("trainable"), ours))
        t_sps = batch / statistics.median(peer["step_times"][args.warmup:])
        m_sps = batch / statistics.median([r["step_time"] for r in recs][args.warmup:])
        rows.append((what, "Trainer + ZeRO-2", "DP2 ZeRO-2", peer["losses"][0], t_sps, t_sps))
        rows.append((what, "mmpipe", layout, recs[0]["loss"], m_sps, t_sps))
        if swift:
            _log(f"swift sft ({what}, --deepspeed zero2, NPROC_PER_NODE=2): {args.steps} steps of {batch} ...")
            sw = ms.run_swift(swift, args.family, llava, train, order, cfg, args, tmp, lora)
            _log(f"ms-swift ({what}): {sw['trainable']}")
            s_sps = batch / statistics.median(sw["step_times"][args.warmup:])
            rows.append((what, "ms-swift + ZeRO-2", "DP2 ZeRO-2", sw["losses"][0], s_sps, t_sps))
    return _report(args, cfg, llava, n, batch, rows, trainable)


def _swift(args):
    """ms-swift's venv for ``--swift`` / ``--swift-venv`` (None without them); the family must be one it trains."""
    if not (args.swift or args.swift_venv):
        return None
    if args.family not in ms.MODEL_TYPES:
        raise SystemExit(f"mmpipe bench peers: --swift runs ms-swift on {', '.join(ms.MODEL_TYPES)}; not on "
                         f"--family {args.family}")
    return ms.swift_venv(args.swift_venv)


def _report(args, cfg, llava: str, n: int, batch: int, rows: list, trainable: list) -> int:
    """The table, the first-step loss differences and trainable counts, and the BENCHMARKS.md entry."""
    lines = ["| weights | system | layout | first-step loss | samples/s | vs Trainer |", "|---|---|---|---|---|---|"]
    lines += [f"| {w} | {s} | {lay} | {loss:.6f} | {sps:.1f} | {sps / base:.2f}x |" for w, s, lay, loss, sps, base in rows]
    table = "\n".join(lines)
    print(table)
    for base in (r for r in rows if r[1] == "Trainer + ZeRO-2"):
        for other in (r for r in rows if r[0] == base[0] and r is not base):
            diff = abs(base[3] - other[3])
            print(f"first-step loss |Trainer - {other[1]}| ({base[0]}): {diff:.2e} ({base[3]!r} vs {other[3]!r})"
                  + ("" if diff < 1e-5 else "  NOT within 1e-5"))
    for what, theirs, ours in trainable:
        print(f"trainable parameters ({what}): Trainer {theirs}, mmpipe {ours}" + ("" if theirs == ours else "  NOT the same"))
    import transformers
    from transformers import AutoConfig
    arch = AutoConfig.from_pretrained(llava).architectures[0]
    images = "images of mixed sizes, " if getattr(cfg.data, "max_pixels", None) else ""
    notes = (f"{os.path.basename(args.config)}'s model ({arch}), {n} synthetic chat samples ({images}15% text-only), "
             f"global batch {batch}, "
             f"micro-batch {args.micro_batch}, {args.steps} steps, fp32, 2 ranks on this machine's cores, constant lr "
             f"{cfg.optim.lr}, no clipping; LoRA r={args.lora_rank}, alpha={args.lora_alpha}, dropout 0 on the decoder's "
             f"linears. samples/s from the median step after the first {args.warmup} (Trainer: a callback around each "
             "optimizer step; mmpipe: its metrics), DeepSpeed's CPU-op build outside both windows. Both start from the "
             "same transformers directory and see the same samples in the same order: the Trainer's collator (transformers "
             f"{transformers.__version__} processor, apply_chat_template, assistant-only labels) was checked to give "
             "mmpipe's ids and labels on the first step's samples. Trainer's logged loss is the token mean over the "
             "global batch (num_items_in_batch across devices), as mmpipe's; for a model that declines the count "
             "(Qwen2.5-VL's accepts_loss_kwargs = False: the Trainer would weigh micro-batches, not tokens, equally) the "
             "worker passes the Trainer a token-mean compute_loss_func, and a micro-batch without images sends a zero "
             "2x2 image through the ViT times 0 (ms-swift's fix; without it the ZeRO-2 ranks deadlock). Differences left: Trainer weight-decays the "
             "token embedding (mmpipe does not), ZeRO-2 partitions optimizer state that mmpipe's chosen layout may hold "
             "whole, and (LLaVA) transformers runs the whole ViT and reads hidden_states[-2] where mmpipe builds only "
             "the blocks up to the feature layer.")
    if any(r[1].startswith("ms-swift") for r in rows):
        notes += (" ms-swift: `swift sft` (its own venv) with NPROC_PER_NODE=2, --deepspeed zero2, --use_cpu on a CPU, fp16 "
                  "off, the same micro-batch, accumulation, AdamW settings and the JSONL in mmpipe's sample order; full "
                  "trains the ViT and merger too, LoRA is all-linear with them frozen; its samples/s from its running "
                  "mean s/it per step. Its Qwen templates are given the directory's <|image_pad|> / <|video_pad|> ids "
                  "(an --external_plugins file): ms-swift hard-codes Qwen's vocabulary ids (151655 / 151656), which "
                  "the bench's tiny tokenizer puts elsewhere, and untouched it expands no image placeholder (its "
                  "first-step loss was 6.0305 against 5.9669 on a 32-sample batch).")
    if not args.no_append:
        given = sys.argv[3:]
        cmd = "mmpipe bench peers " + " ".join(shlex.quote(a) for a in
                                               (given if "--family" in given else ["--family", args.family] + given))
        append_benchmarks(f"Peers: mmpipe vs transformers Trainer + DeepSpeed ZeRO-2 ({arch})", cmd, table, notes)
    return 0
