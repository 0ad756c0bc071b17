"""``mmpipe config``: the configuration reference, generated from the schema."""
from __future__ import annotations


def cmd_config(args) -> int:
    from mmpipe.config.schema import load_config, reference, save_yaml
    if args.reference:
        print(reference())
        return 0
    cfg = load_config(args.config, args.overrides)
    save_yaml(cfg, "/dev/stdout")
    return 0
