"""``mmpipe data synth | prepare | check``: generate demo data, pre-decode a cache, check a data set."""
from __future__ import annotations

from mmpipe.config.registry import get_family
from mmpipe.config.schema import family_of, load_config
from mmpipe.data.shards import is_shard_spec
from mmpipe.errors import ConfigError


def _sizes(text):
    """``--sizes``: None, ``mixed`` (MIXED_SIZES) or ``WxH,WxH,...``."""
    from mmpipe.data.synth import MIXED_SIZES
    if not text:
        return None
    if text == "mixed":
        return MIXED_SIZES
    try:
        sizes = [tuple(int(v) for v in part.lower().split("x")) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(len(wh) != 2 or min(wh) < 1 for wh in sizes):
        raise ConfigError(f"--sizes {text}: give mixed or WIDTHxHEIGHT pairs separated by commas (56x56,224x84)")
    return sizes


def cmd_data_synth(args) -> int:
    from mmpipe.data.synth import check_split, synth, synth_vlm
    check_split(args.n, args.val_fraction)  # before any image is written
    if get_family(args.kind, "--kind").data_format == "chat":
        info = synth_vlm(args.out, args.n, val_fraction=args.val_fraction, size=args.size or 64, seed=args.seed,
                         sizes=_sizes(args.sizes))
        print(f"wrote {info['n_train']} train and {info['n_val']} val chat samples (ms-swift JSONL): "
              f"{info['train']} {info['val']}")
        return 0
    if args.sizes:
        raise ConfigError(f"--sizes is for the chat kinds (images of several sizes); --kind {args.kind} writes square "
                          "images of one --size")
    info = synth(args.out, args.n, val_fraction=args.val_fraction, size=args.size or 96, seed=args.seed)
    print(f"wrote {info['n_train']} train and {info['n_val']} val pairs: {info['train']} {info['val']}")
    return 0


def cmd_data_prepare(args) -> int:
    from mmpipe.data.cache import prepare
    cfg = load_config(args.config, args.overrides)  # defaults for whatever the flags leave open
    try:
        family_of(cfg).check_source("cache")  # a family reading its own format (the VLM's chat file) has none
    except ConfigError:
        raise ConfigError(f"mmpipe data prepare: model.type={cfg.model.type} trains from its chat file (data.train) "
                          "as it is and has no cache: train without one (mmpipe data check --config ... reads the "
                          "chat file as training will)") from None
    manifest = args.manifest or cfg.data.train
    if not manifest:
        raise ConfigError("mmpipe data prepare: give --manifest (or a --config with data.train)")
    size = args.size or family_of(cfg).pixels(cfg.model, cfg.data).cache_size
    r = prepare(manifest, args.out, size, args.max_length or cfg.data.max_length,
                tokenizer=args.tokenizer or cfg.data.tokenizer, vocab_size=cfg.data.tokenizer_vocab_size,
                workers=args.workers, max_items=args.max_items)
    state = "complete" if r["remaining"] == 0 else f"{r['remaining']} rows left: run the same command again"
    print(f"{args.out}: {r['done_now']} rows done now; {r['ok']} usable, {r['bad']} unusable (see {args.out}/bad.jsonl);"
          f" {state}. Train with --set data.cache={args.out}")
    return 0


def cmd_data_check(args) -> int:
    from mmpipe.data.check import run_check
    cfg = load_config(args.config, args.overrides)
    manifest = args.manifest or cfg.data.train
    if not manifest or is_shard_spec(manifest):
        raise ConfigError("mmpipe data check: give --manifest (a .jsonl/.csv/.tsv manifest), or a --config with one "
                          "as data.train")
    rc = family_of(cfg).check_data(manifest, cfg, args.json, args.workers)  # a family's own format (chat data)
    if rc is not None:
        return rc
    size = family_of(cfg).pixels(cfg.model, cfg.data).cache_size
    return run_check(manifest, size, cfg.data.max_bad_fraction, args.json, args.workers)
