"""One rank of the plain route a LLaVA or Qwen2.5-VL user takes: transformers' ``Trainer`` with a
DeepSpeed ZeRO-2 JSON on ``AutoModelForImageTextToText`` (``LlavaForConditionalGeneration``,
``Qwen2_5_VLForConditionalGeneration``; optionally wrapped by ``peft.get_peft_model``), fed by a
minimal chat collator built on the directory's own processor (``apply_chat_template``, assistant-only
labels). Run by ``mmpipe bench peers --family vlm|qwen2_5_vl`` under the ``deepspeed`` launcher:

    deepspeed --num_gpus 2 mmpipe/bench/trainer_worker.py SPEC.json

It writes ``SPEC.json``'s ``out`` (rank 0): each step's seconds and Trainer's logged losses."""
from __future__ import annotations

import inspect
import json
import re
import sys
import time

from mmpipe.config.schema import family_of, load_config
from mmpipe.data.tokenizer import load_tokenizer
from mmpipe.families.chat import read_chat
from mmpipe.families.towers.common import normalize_pixels



# peft's targets: the decoder's linears, as mmpipe's LoRA adapts them (ms-swift's all-linear on the language model:
# attention and MLP projections, and Qwen3.5's linear-attention in_proj_qkv / in_proj_z / in_proj_b / in_proj_a /
# out_proj); a model without some of these names simply has fewer
LORA_TARGETS = (r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|in_proj_qkv|in_proj_z|"
                r"in_proj_b|in_proj_a|out_proj|shared_expert_gate)")

def render(processor, messages, generation_prompt=False) -> str:
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


# what a processor returns beside input_ids: one value per token (padded with 0 in a batch), or per image
TOKEN_KEYS = ("mm_token_type_ids", "token_type_ids")
IMAGE_KEYS = ("pixel_values", "image_grid_thw", "image_sizes")


def image_items(content: str) -> list:
    """ms-swift's ``<image>`` marks in a message's text -> transformers' list content (image items and text
    items in order), as ms-swift's template does for a model whose processor has its own image token."""
    items = []
    for k, part in enumerate(content.split("<image>")):
        if k:
            items.append({"type": "image"})
        if part:
            items.append({"type": "text", "text": part})
    return items


def encode(processor, row: dict, image_root: str, max_length: int) -> dict:
    """One ms-swift JSONL row -> input_ids (image tokens expanded by the processor), labels (the
    assistant turns and what closes them; everything else -100), the processor's per-token ids and its
    image tensors (pixels; Qwen2.5-VL's patch grids)."""
    import os

    import torch
    from PIL import Image
    as_items = getattr(processor, "image_token", "<image>") != "<image>"  # e.g. Qwen2.5-VL's <|image_pad|>
    messages = [{"role": m["role"], "content": image_items(m["content"]) if as_items else m["content"]}
                for m in row["messages"]]
    images = [Image.open(os.path.join(image_root, p)).convert("RGB") for p in row.get("images") or []]

    def ids_of(msgs, generation_prompt=False):
        text = render(processor, msgs, generation_prompt)
        n = sum(isinstance(c, dict) and c.get("type") == "image" for m in msgs for c in m["content"]) if as_items \
            else text.count("<image>")
        return processor(text=text, images=images[:n] or None, return_tensors="pt")
    full = ids_of(messages)
    ids = full["input_ids"][0]
    labels = torch.full_like(ids, -100)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = ids_of(messages[:i], generation_prompt=True)["input_ids"].shape[1]
        end = ids_of(messages[:i + 1])["input_ids"].shape[1]
        labels[start:end] = ids[start:end]
    if images and len(ids) > max_length:  # (mmpipe would cut before the image or drop the sample)
        raise ValueError(f"mmpipe bench peers: a sample with images is {len(ids)} tokens, over max_length {max_length}: "
                         "give the bench a larger data.max_length")
    out = {"input_ids": ids[:max_length], "labels": labels[:max_length]}
    out.update({k: full[k][0][:max_length] for k in TOKEN_KEYS if k in full})
    if images:
        out.update({k: full[k] for k in IMAGE_KEYS if k in full})
    return out


class Collate:
    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, items: list) -> dict:
        import torch
        n = max(len(it["input_ids"]) for it in items)
        ids = torch.full((len(items), n), self.pad_id, dtype=torch.long)
        labels = torch.full((len(items), n), -100, dtype=torch.long)
        mask = torch.zeros((len(items), n), dtype=torch.long)
        out = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        for k in TOKEN_KEYS:
            if k in items[0]:
                out[k] = torch.zeros((len(items), n), dtype=items[0][k].dtype)
        for i, it in enumerate(items):
            k = len(it["input_ids"])
            ids[i, :k], labels[i, :k], mask[i, :k] = it["input_ids"], it["labels"], 1
            for key in TOKEN_KEYS:
                if key in out:
                    out[key][i, :k] = it[key]
        for key in IMAGE_KEYS:
            parts = [it[key] for it in items if key in it]
            if parts:
                out[key] = torch.cat(parts)
        return out


def dummy_vision(model):
    """ms-swift's fix for a micro-batch without images on a model whose forward then skips the vision
    tower (Qwen2.5-VL): a 2x2-patch zero image through the tower and merger, times 0, added to the loss,
    so every rank's backward reaches the same parameters and ZeRO's gradient reductions stay in step
    (without it ranks deadlock on the first text-only micro-batch). None for other models."""
    import torch
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    visual = getattr(getattr(base, "model", None), "visual", None)
    if visual is None:
        return None
    w = visual.patch_embed.proj.weight
    m = int(visual.spatial_merge_size)
    dummy = torch.zeros(m * m, w[0].numel(), dtype=w.dtype, device=w.device)
    out = visual(dummy, grid_thw=torch.tensor([[1, m, m]], device=w.device))
    return out.pooler_output.sum() * 0.0


def token_mean_loss(model, accumulation: int = 1):
    """For a model that declines the Trainer's ``num_items_in_batch`` (Qwen2.5-VL: ``accepts_loss_kwargs =
    False``, so each micro-batch's loss is its own token mean and the step weighs micro-batches, not
    tokens, equally) the causal-LM loss over the global batch's tokens, as ms-swift computes it; for a MoE model
    with its router loss on (``output_router_logits``), plus ``router_aux_loss_coef`` x the micro-batch's aux loss /
    (``accumulation`` x the processes: a mean over the step's micro-batches and ranks, as mmpipe weighs it, where
    the model's own loss would count it once per micro-batch and per rank); None (the model's own loss) for a dense model that takes the count."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    text = base.config.get_text_config()
    moe = bool(getattr(text, "output_router_logits", False))
    if getattr(base, "accepts_loss_kwargs", True) and not moe:
        return None
    from transformers.loss.loss_utils import ForCausalLMLoss
    vocab = text.vocab_size

    def loss(outputs, labels, num_items_in_batch=None):
        lm = ForCausalLMLoss(outputs.logits, labels, vocab, num_items_in_batch=num_items_in_batch)
        if not moe:
            return lm
        # (the Trainer multiplies the loss by its processes before DDP averages it: the token count is global)
        import torch.distributed as dist
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return lm + text.router_aux_loss_coef * outputs.aux_loss / (accumulation * world)
    return loss


def trainer_parts(synchronize=None) -> tuple:
    """(a ``Trainer`` that keeps the dataset's order, a callback timing each optimizer step; with
    ``synchronize``, the device's queue is drained at both ends of the step)."""
    from torch.utils.data import SequentialSampler
    from transformers import Trainer, TrainerCallback

    class InOrder(Trainer):
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if "pixel_values" in inputs:
                return result
            zero = dummy_vision(self.accelerator.unwrap_model(model))
            if zero is None:
                return result
            return (result[0] + zero, result[1]) if return_outputs else result + zero

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], None

        def on_step_begin(self, *a, **k):
            if synchronize is not None:
                synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            if synchronize is not None:
                synchronize()
            self.times.append(time.perf_counter() - self.t0)
    return InOrder, Clock


def main(spec_path: str) -> None:
    import os

    import torch
    from torch.utils.data import Dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainingArguments
    with open(spec_path) as fh:
        spec = json.load(fh)
    torch.set_num_threads(spec["threads"])
    processor = AutoProcessor.from_pretrained(spec["llava"])
    with open(spec["train"]) as fh:
        rows = [json.loads(line) for line in fh]
    root = os.path.dirname(spec["train"])

    class Chat(Dataset):  # mmpipe's sample order (the bench checks the first step's samples match)
        def __len__(self):
            return len(spec["order"])

        def __getitem__(self, i):
            return encode(processor, rows[spec["order"][i]], root, spec["max_length"])

    InOrder, Clock = trainer_parts()

    model = AutoModelForImageTextToText.from_pretrained(spec["llava"], dtype=torch.float32)  # LLaVA, Qwen2.5-VL
    if spec.get("lora"):
        from peft import LoraConfig, get_peft_model
        lo = spec["lora"]
        model = get_peft_model(model, LoraConfig(r=lo["r"], lora_alpha=lo["alpha"], lora_dropout=0.0, bias="none",
                                                 target_modules=LORA_TARGETS))
    o = spec["optim"]
    args = TrainingArguments(output_dir=spec["tmp"], per_device_train_batch_size=spec["micro_batch"],
                             gradient_accumulation_steps=spec["accumulation"], max_steps=spec["steps"],
                             learning_rate=o["lr"], weight_decay=o["weight_decay"], adam_beta1=o["betas"][0],
                             adam_beta2=o["betas"][1], adam_epsilon=o["eps"], lr_scheduler_type="constant",
                             warmup_steps=0, max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=True, deepspeed=spec["ds_config"], dataloader_num_workers=0,
                             remove_unused_columns=False, seed=spec["seed"], disable_tqdm=True)
    clock = Clock()
    trainer = InOrder(model=model, args=args, train_dataset=Chat(), data_collator=Collate(processor.tokenizer.pad_token_id),
                      callbacks=[clock], compute_loss_func=token_mean_loss(model, spec["accumulation"]))
    trainer.train()
    if trainer.is_world_process_zero():
        losses = [float(r["loss"]) for r in trainer.state.log_history if "loss" in r]
        with open(spec["out"], "w") as fh:
            json.dump({"step_times": clock.times, "losses": losses,
                       "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}, fh)
    import torch.distributed as dist
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # DeepSpeed's CPU communication threads abort the interpreter's normal teardown here


# ---- mmpipe bench gpu: the Trainer on the samples an mmpipe run trained ---------------------------------
def write_gpu_spec(run_dir: str, spec: dict, mm: dict, args, tmp: str) -> str:
    """The Trainer's job for ``mmpipe bench gpu``: the mmpipe run ``run_dir``'s model (its resolved
    config) and samples, as many per step as the run trained (packed rows hold several), in
    ``ACCUMULATION`` micro-batches; LoRA as the run's."""
    import math
    import os
    accumulation = 4
    per_step = max(accumulation, int(round(mm["samples_per_step"])))
    path = os.path.join(os.path.dirname(tmp), os.path.basename(tmp) + ".json")
    with open(path, "w") as fh:
        json.dump({"run": run_dir, "micro_batch": math.ceil(per_step / accumulation), "accumulation": accumulation,
                   "steps": args.steps, "lora": spec.get("lora"), "lora_rank": args.lora_rank, "tmp": tmp}, fh)
    return path


def _encoded_samples(run: str, count: int):
    """(family, config, [{input_ids, labels, and the images' fields}]) for the first ``count`` usable
    samples of the run's training file, by mmpipe's own chat encoder and image loader: square images
    normalised as LLaVA's processor hands them over (mmpipe normalises on the device), native-resolution
    ones as the family's pixels give them (the model's own processor's patches and grids)."""
    import os

    import torch

    cfg = load_config(os.path.join(run, "config.yaml"))
    fam_cls = family_of(cfg)
    family = fam_cls(cfg.model, cfg.train.seed)
    enc = family.encoder(fam_cls.prepare_tokenizer(load_tokenizer(os.path.join(run, "tokenizer"))), cfg.data.max_length, cfg.data)
    px = fam_cls.pixels(cfg.model, cfg.data)
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    out = []
    samples = [s for s in read_chat(cfg.data.train) if not s.error]
    while len(out) < count:
        for s in samples:
            e = enc.encode(s)
            if e.dropped:
                continue
            item = {"input_ids": torch.tensor(e.input_ids), "labels": torch.tensor(e.labels)}
            if e.images:
                loaded = [px.load(p, f"image {p}", 0, 0) for p in e.images]
                why = next((why for image, why in loaded if image is None), None)
                if why:
                    raise SystemExit(f"mmpipe bench gpu: the Trainer's samples: {why}")
                item.update(px.batch([image for image, _ in loaded]))
                if item["pixel_values"].dtype == torch.uint8:  # square images, normalised on mmpipe's device
                    item["pixel_values"] = normalize_pixels(item["pixel_values"], mean, std, torch.float32)
            out.append(item)
            if len(out) == count:
                break
    return family, cfg, out


def _gpu_model(family, spec: dict, device):
    """transformers' model of the run's config (``LlavaForConditionalGeneration``,
    ``Qwen2_5_VLForConditionalGeneration``, ``Qwen3_5ForConditionalGeneration``), random bf16 weights made on
    ``device``; peft LoRA on the decoder's linears (the run had LoRA: Qwen3.5's linear-attention projections too,
    as mmpipe and ms-swift adapt them), else the vision tower frozen (freeze_vit)."""
    import torch
    from transformers import AutoModelForImageTextToText
    torch.set_default_dtype(torch.bfloat16)
    with device:  # random weights made where they train (a 7B model made on the host takes minutes)
        model = AutoModelForImageTextToText.from_config(family.hf.hf_config())
    torch.set_default_dtype(torch.float32)
    if spec["lora"]:
        from peft import LoraConfig, get_peft_model
        r = spec["lora_rank"]
        return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.05, bias="none",
                                                target_modules=LORA_TARGETS))
    for n, p in model.named_parameters():
        if re.search(r"(^|\.)(vision_tower|visual)\.", n):
            p.requires_grad_(False)
    return model


def gpu_main(spec_path: str) -> None:
    """One process (the deepspeed launcher, one rank): transformers' model of the run's config
    (``LlavaForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``) built on the device in
    bf16 (random weights), peft LoRA on the decoder's linears when the run had LoRA, transformers'
    Trainer with DeepSpeed ZeRO-2 and bf16 (LLaVA's and ms-swift's route), the same samples padded per
    micro-batch; writes each step's seconds, the samples and tokens per step and
    the allocator's peak."""
    import os

    import torch
    from deepspeed.accelerator import get_accelerator
    from torch.utils.data import Dataset
    from transformers import TrainingArguments
    with open(spec_path) as fh:
        spec = json.load(fh)
    acc = get_accelerator()
    on_cpu = acc.device_name() == "cpu"
    per_step = spec["micro_batch"] * spec["accumulation"]
    family, cfg, items = _encoded_samples(spec["run"], per_step * spec["steps"])
    model = _gpu_model(family, spec, torch.device("cpu" if on_cpu else acc.device_name()))
    pad = 0
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if "mm_token_type_ids" in inspect.signature(base.forward).parameters:  # Qwen2.5-VL's M-RoPE reads them
        for it in items:
            it["mm_token_type_ids"] = (it["input_ids"] == base.config.image_token_id).long()

    class Items(Dataset):
        def __len__(self):
            return len(items)

        def __getitem__(self, i):
            return items[i]

    InOrder, Clock = trainer_parts(acc.synchronize)

    ds = os.path.join(spec["tmp"] + "_ds.json")
    with open(ds, "w") as fh:
        json.dump({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                   "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 2},
                   "bf16": {"enabled": "auto"}}, fh)
    args = TrainingArguments(output_dir=spec["tmp"], per_device_train_batch_size=spec["micro_batch"],
                             gradient_accumulation_steps=spec["accumulation"], max_steps=spec["steps"],
                             learning_rate=2e-5, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
                             logging_steps=1, save_strategy="no", report_to=[], bf16=True, use_cpu=on_cpu,
                             deepspeed=ds, dataloader_num_workers=0, remove_unused_columns=False, seed=0,
                             disable_tqdm=True)
    clock = Clock()
    trainer = InOrder(model=model, args=args, train_dataset=Items(), data_collator=Collate(pad), callbacks=[clock])
    acc.reset_peak_memory_stats() if not on_cpu else None
    trainer.train()
    tokens = [sum(len(items[i]["input_ids"]) for i in range(s * per_step, (s + 1) * per_step)) for s in range(spec["steps"])]
    with open(spec_path.replace(".json", "_out.json"), "w") as fh:
        images = [sum(len(items[i].get("image_grid_thw", items[i].get("pixel_values", ()))) for i in
                      range(s * per_step, (s + 1) * per_step)) for s in range(spec["steps"])]
        json.dump({"step_times": clock.times, "samples_per_step": per_step, "tokens_per_step": tokens,
                   "images_per_step": images, "micro_batch": spec["micro_batch"],
                   "peak_mb": None if on_cpu else acc.max_memory_allocated() / 2**20}, fh)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    if "--gpu" in sys.argv:
        gpu_main(sys.argv[-1])
    else:
        main(sys.argv[-1])
