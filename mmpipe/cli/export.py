"""``mmpipe export``: a run's checkpoint as a Hugging Face directory (or mmpipe's own format)."""
from __future__ import annotations

import json
import os

from mmpipe.train.export import BASE_DIR, export, HF_MARKER


def peft_load_hint(out: str) -> str:
    """How to load a LoRA export ``out``, from what it wrote: the base's transformers class (its marker) and how
    ``adapter_config.json`` names the base (the hub id the run started from, or this export's base copy by its
    absolute path)."""
    with open(os.path.join(out, BASE_DIR, HF_MARKER)) as fh:
        cls = json.load(fh)["class"]
    with open(os.path.join(out, "adapter_config.json")) as fh:
        adapter = json.load(fh)
    named, base = adapter["base_model_name_or_path"], os.path.join(out, BASE_DIR)
    load = (f"load with PeftModel.from_pretrained({cls}.from_pretrained({base!r}), {out!r}), or "
            f"AutoPeftModel.from_pretrained({out!r})")
    if os.path.isabs(named):
        return (f"{load}; its adapter_config.json names the base by this absolute path: after moving the directory "
                f"to NEW, PeftModel.from_pretrained({cls}.from_pretrained('NEW/{BASE_DIR}'), 'NEW')")
    rev = f" at revision {adapter['revision']}" if adapter.get("revision") else ""
    return f"{load}; its adapter_config.json names the base as the hub id {named}{rev}, so the directory can be moved"


def cmd_export(args) -> int:
    out, kind, why = export(args.run, args.out, args.step, args.dtype, args.format, args.merge)
    if kind == "PeftModel":
        print(f"wrote {out} as a peft adapter directory ({why}; {peft_load_hint(out)})")
    elif kind == "mmpipe":
        print(f"wrote {out} in mmpipe's format (load with mmpipe.build_model({out!r})): {why}")
    else:
        print(f"wrote {out} as transformers' {kind} ({why}; load with {kind}.from_pretrained)")
    return 0
