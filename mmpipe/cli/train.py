"""``mmpipe train`` (= launch/train.py): the training command's arguments."""
from __future__ import annotations

import argparse

from mmpipe.config.schema import load_config
from mmpipe.parallel.startup import close_distributed


def _train_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--config", "-c", help="YAML run config (keys: docs/configuration.md, or mmpipe config --reference)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.steps=10 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in train.output_dir")
    p.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                   help="save a checkpoint and exit after STEP (continue later with --resume)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run already in train.output_dir (without it, a fresh run there is refused)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def cmd_train(args) -> int:
    from mmpipe.train.trainer import run
    cfg = load_config(args.config, args.overrides)
    run(cfg, resume=args.resume, stop_at=args.stop_at, overwrite=args.overwrite)
    close_distributed()
    return 0
