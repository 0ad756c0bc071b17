"""``mmpipe config``: the configuration reference, generated from the schema."""
from __future__ import annotations

from mmpipe.config.schema import load_config, reference, save_yaml


def cmd_config(args) -> int:
    if args.reference:
        print(reference())
        return 0
    cfg = load_config(args.config, args.overrides)
    save_yaml(cfg, "/dev/stdout")
    return 0
