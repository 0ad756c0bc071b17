"""``mmpipe`` command line: train | generate | data synth|prepare|check | config | plan | bench.

Config mistakes and bad paths end as one line, ``mmpipe: error: ...``, exit status 2.
"""
from __future__ import annotations

import argparse
import os
import sys

from mmpipe.cli.config import cmd_config
from mmpipe.cli.data import cmd_data_check, cmd_data_prepare, cmd_data_synth
from mmpipe.cli.export import cmd_export
from mmpipe.cli.generate import cmd_generate
from mmpipe.cli.plan import add_parser as add_plan, cmd_plan_any
from mmpipe.cli.report import add_parser as add_report
from mmpipe.cli.train import _train_parser, cmd_train
from mmpipe.config.registry import BUILTIN
from mmpipe.errors import ConfigError, MmpipeError, one_line
from mmpipe.parallel.roster import describe_lost


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mmpipe", description="pipeline-parallel image+text training on DeepSpeed")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = _train_parser(sub.add_parser("train", help="train (run under deepspeed / accelerate launch / python)"))
    t.set_defaults(func=cmd_train)
    g = sub.add_parser("generate", help="greedy answer of a chat family's run (any layout's checkpoint) to images + "
                       "a prompt")
    g.add_argument("--run", required=True, help="run directory (train.output_dir of a chat family's run: model.type "
                   "vlm, qwen2_5_vl)")
    g.add_argument("--image", action="append", help="image file (omit for a text-only prompt); repeat it for a "
                   "multi-image prompt: the images in order, one per <image> marker of --prompt (none: all first)")
    g.add_argument("--video", action="append", help="video file or directory of frames (qwen2_5_vl, qwen3_vl, "
                   "qwen3_5), sampled as training sampled it; repeat it for several, one per <video> marker of --prompt "
                   "(none: all first)")
    g.add_argument("--prompt", help="the user's question")
    g.add_argument("--eval", metavar="CHAT_FILE", help="instead: exact-match accuracy on the first question of each "
                   "conversation in a chat file (vs constant-answer baselines); written to RUN/exact_match.json")
    g.add_argument("--limit", type=int, default=None, help="with --eval: at most this many questions (1 or more)")
    g.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    g.add_argument("--max-new-tokens", type=int, default=32, help="at most this many tokens per answer, with --eval "
                   "too (1 or more)")
    g.set_defaults(func=cmd_generate)
    e = sub.add_parser("export", help="a run's checkpoint (any layout) as a transformers directory (or mmpipe's "
                       "own format where transformers has no matching class)")
    e.add_argument("--run", required=True, help="run directory (train.output_dir)")
    e.add_argument("--out", required=True, help="directory to write (save_pretrained layout)")
    e.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    e.add_argument("--dtype", default="fp32", help="fp32 or bf16 weights")
    e.add_argument("--format", default="auto", help="auto (transformers where a class computes the same outputs, "
                   "else mmpipe's), hf, or mmpipe (safetensors + config.yaml, for mmpipe.build_model)")
    e.add_argument("--merge", action="store_true", help="LoRA runs: fold the adapters into full weights (default: a "
                   "peft adapter directory, its base model in OUT/base)")
    e.set_defaults(func=cmd_export)
    d = sub.add_parser("data", help="data tools").add_subparsers(dest="data_cmd", required=True)
    s = d.add_parser("synth", help="write a learnable synthetic image-caption (or, --kind vlm, chat) data set")
    s.add_argument("--out", required=True)
    s.add_argument("--kind", choices=tuple(BUILTIN), default="clip",
                   help="clip: image-caption pairs; vlm: chat about the images (ms-swift JSONL) + text-only turns")
    s.add_argument("--n", type=int, default=2000, help="total samples (train + val)")
    s.add_argument("--val-fraction", type=float, default=0.1)
    s.add_argument("--size", type=int, default=None, help="image side in pixels (default 96; vlm 64)")
    s.add_argument("--sizes", default=None, help="chat kinds: images of mixed sizes, each one of these: mixed (4 to "
                   "64 tokens at Qwen2.5-VL's pixel bounds) or WxH,WxH,...; in place of --size")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=cmd_data_synth)
    pr = d.add_parser("prepare", help="preprocess a manifest into a cache (uint8 images + token ids) for data.cache")
    pr.add_argument("--manifest", help="manifest to cache (default: the config's data.train)")
    pr.add_argument("--out", required=True, help="cache directory (re-run the same command to resume)")
    pr.add_argument("--config", "-c", help="run config supplying size, max_length and tokenizer defaults")
    pr.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    pr.add_argument("--size", type=int, help="cached image side (default: data.decode_size or the model's image size)")
    pr.add_argument("--max-length", type=int, help="tokens per caption (default: data.max_length)")
    pr.add_argument("--tokenizer", help="local tokenizer dir (default: data.tokenizer, else trained on the captions)")
    pr.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="decoding processes")
    pr.add_argument("--max-items", type=int, help="stop after this many rows (continue later with the same command)")
    pr.set_defaults(func=cmd_data_prepare)
    ck = d.add_parser("check", help="read every manifest row and image as training would; report the unusable ones",
                      description="Exit status 1 when the unusable fraction exceeds data.max_bad_fraction.")
    ck.add_argument("--manifest", help="manifest to check (default: the config's data.train)")
    ck.add_argument("--config", "-c", help="run config: decode size (data.decode_size or the model's image size) "
                    "and data.max_bad_fraction (default 0.05)")
    ck.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ck.add_argument("--json", action="store_true",
                    help="one JSON object per row on stdout: line, image, text (the caption training sees), status "
                    "(ok/bad), why, and for decoded images width, height (upright, full resolution), mode (as in "
                    "the file) and mean (0-255, of the RGB image at the decode size, as training gets it)")
    ck.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="decoding processes")
    ck.set_defaults(func=cmd_data_check)
    from mmpipe.bench.commands import add_parser as add_bench
    add_bench(sub)
    add_plan(sub).set_defaults(func=cmd_plan_any)
    add_report(sub)
    c = sub.add_parser("config", help="print the resolved run config, or --reference for every key")
    c.add_argument("--config", "-c")
    c.add_argument("--set", dest="overrides", action="append", default=[])
    c.add_argument("--reference", action="store_true")
    c.set_defaults(func=cmd_config)
    return ap


def run_guarded(func, args) -> int:
    try:
        return _guarded(func, args)
    finally:  # (a finished run has closed it already; after an error, before the interpreter's exit)
        startup = sys.modules.get("mmpipe.parallel.startup")  # (not imported: no process group was made)
        if startup is not None:
            startup.close_distributed(finished=False)


def _guarded(func, args) -> int:
    try:
        return func(args)
    except MmpipeError as e:
        rank = os.environ.get("RANK", "0")  # (after a scheduler's variables became torch's: launchers.adopt)
        everywhere = getattr(e, "everywhere", isinstance(e, ConfigError))  # raised alike on every rank
        if rank == "0" or not everywhere:
            prefix = "" if rank == "0" or everywhere else f"[rank {rank}] "
            print(f"mmpipe: error: {prefix}{e}", file=sys.stderr, flush=True)
        return 2
    except RuntimeError as e:  # torch.distributed's DistBackendError is one
        if not _peer_lost(e):
            raise
        rank = os.environ.get("RANK", "0")
        # another rank exited (its own error line is printed by it): one line here naming it, no traceback
        who = describe_lost()
        what = f"{who} is gone" if who else "lost contact with another rank"
        print(f"mmpipe: [rank {rank}] stopped: {what}; resume from the last complete checkpoint with --resume "
              f"({one_line(e)})", file=sys.stderr, flush=True)
        return 3


def _peer_lost(e: BaseException) -> bool:
    """A collective failed because a peer process went away (gloo/NCCL wording)."""
    msg = str(e)
    return os.environ.get("WORLD_SIZE", "1") != "1" and any(
        s in msg for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                           "NCCL communicator was aborted", "Timed out", "timed out", "Timeout"))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_guarded(args.func, args)


def train_main(argv=None) -> int:
    """Entry of launch/train.py: the same as ``mmpipe train``."""
    args = _train_parser(argparse.ArgumentParser(prog="train.py")).parse_args(argv)
    return run_guarded(cmd_train, args)


if __name__ == "__main__":
    sys.exit(main())
