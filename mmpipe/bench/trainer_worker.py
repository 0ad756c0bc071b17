"""One rank of the plain route a LLaVA user takes: transformers' ``Trainer`` with a DeepSpeed ZeRO-2
JSON on ``LlavaForConditionalGeneration`` (optionally wrapped by ``peft.get_peft_model``), fed by a
minimal chat collator built on the directory's own processor (``apply_chat_template``, assistant-only
labels). Run by ``mmpipe bench peers --family vlm`` under the ``deepspeed`` launcher:

    deepspeed --num_gpus 2 mmpipe/bench/trainer_worker.py SPEC.json

It writes ``SPEC.json``'s ``out`` (rank 0): each step's seconds and Trainer's logged losses."""
from __future__ import annotations

import json
import sys
import time


def render(processor, messages, generation_prompt=False) -> str:
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def encode(processor, row: dict, image_root: str, max_length: int) -> dict:
    """One ms-swift JSONL row -> input_ids (image tokens expanded by the processor), labels (the
    assistant turns and what closes them; everything else -100), pixel values."""
    import os

    import torch
    from PIL import Image
    messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    images = [Image.open(os.path.join(image_root, p)).convert("RGB") for p in row.get("images") or []]

    def ids_of(text):
        enc = processor(text=text, images=images[:text.count("<image>")] or None, return_tensors="pt")
        return enc
    full = ids_of(render(processor, messages))
    ids = full["input_ids"][0]
    labels = torch.full_like(ids, -100)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = ids_of(render(processor, messages[:i], generation_prompt=True))["input_ids"].shape[1]
        end = ids_of(render(processor, messages[:i + 1]))["input_ids"].shape[1]
        labels[start:end] = ids[start:end]
    out = {"input_ids": ids[:max_length], "labels": labels[:max_length]}
    if images:
        out["pixel_values"] = full["pixel_values"]
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
        for i, it in enumerate(items):
            k = len(it["input_ids"])
            ids[i, :k], labels[i, :k], mask[i, :k] = it["input_ids"], it["labels"], 1
        out = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        pix = [it["pixel_values"] for it in items if "pixel_values" in it]
        if pix:
            out["pixel_values"] = torch.cat(pix)
        return out


def main(spec_path: str) -> None:
    import os

    import torch
    from torch.utils.data import Dataset, SequentialSampler
    from transformers import (
        AutoProcessor,
        LlavaForConditionalGeneration,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )
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

    class InOrder(Trainer):
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], None

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.t0)

    model = LlavaForConditionalGeneration.from_pretrained(spec["llava"], torch_dtype=torch.float32)
    if spec.get("lora"):
        from peft import LoraConfig, get_peft_model
        lo = spec["lora"]
        model = get_peft_model(model, LoraConfig(r=lo["r"], lora_alpha=lo["alpha"], lora_dropout=0.0, bias="none",
                                                 target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|"
                                                                r"gate_proj|up_proj|down_proj)"))
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
                      callbacks=[clock])
    trainer.train()
    if trainer.is_world_process_zero():
        losses = [float(r["loss"]) for r in trainer.state.log_history if "loss" in r]
        with open(spec["out"], "w") as fh:
            json.dump({"step_times": clock.times, "losses": losses}, fh)
    import torch.distributed as dist
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # DeepSpeed's CPU communication threads abort the interpreter's normal teardown here


if __name__ == "__main__":
    main(sys.argv[-1])
