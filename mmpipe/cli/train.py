"""``mmpipe train`` (= launch/train.py): the training command's arguments."""
from __future__ import annotations

import argparse
import os

from mmpipe.config.schema import load_config
from mmpipe.parallel.startup import close_distributed
from mmpipe.train.faults import exit_status


def _train_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--config", "-c", help="YAML run config (keys: docs/configuration.md, or mmpipe config --reference)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.steps=10 (repeatable)")
    p.add_argument("--resume", nargs="?", const=True, default=None, type=_resume_arg, metavar="auto",
                   help="continue from the latest checkpoint in train.output_dir; --resume auto: continue if it holds "
                   "a complete checkpoint, else start fresh (the same command starts a job and continues it after "
                   "a requeue or restart; = train.resume: auto)")
    p.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                   help="save a checkpoint and exit after STEP (continue later with --resume)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run already in train.output_dir (without it, a fresh run there is refused)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _resume_arg(value: str) -> str:
    if value != "auto":
        raise argparse.ArgumentTypeError(f"{value!r}: give --resume alone (continue, a checkpoint must exist) or "
                                         "--resume auto (continue if there is a checkpoint, else start fresh)")
    return value


def cmd_train(args) -> int:
    from mmpipe.train.trainer import run
    cfg = load_config(args.config, args.overrides)
    done = run(cfg, resume=args.resume, stop_at=args.stop_at, overwrite=args.overwrite)
    close_distributed()  # (every rank is here: a requeue ends no rank's work)
    auto = (cfg.train.resume if args.resume is None else args.resume) == "auto"
    return exit_status(done["stopped_by"], int(os.environ.get("RANK", "0")), auto)
