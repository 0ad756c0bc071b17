"""``mmpipe export``: a run's checkpoint as a Hugging Face directory (or mmpipe's own format)."""
from __future__ import annotations


def cmd_export(args) -> int:
    from mmpipe.train.export import export
    out, kind, why = export(args.run, args.out, args.step, args.dtype, args.format, args.merge)
    if kind == "PeftModel":
        import os
        base = os.path.join(out, "base")
        print(f"wrote {out} as a peft adapter directory ({why}; load with PeftModel.from_pretrained("
              f"LlavaForConditionalGeneration.from_pretrained({base!r}), {out!r}), or AutoPeftModel.from_pretrained('.') "
              "from inside it: its adapter_config.json names the base relatively, so the directory can be moved)")
    elif kind == "mmpipe":
        print(f"wrote {out} in mmpipe's format (load with mmpipe.build_model({out!r})): {why}")
    else:
        print(f"wrote {out} as transformers' {kind} ({why}; load with {kind}.from_pretrained)")
    return 0
