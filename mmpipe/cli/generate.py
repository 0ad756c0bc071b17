"""``mmpipe generate``: greedy answers of a chat family's run, or ``--eval``'s exact match
(``mmpipe.families.chat.generate``).

    mmpipe generate --run runs/demo_vlm --image data/synth_vlm/images/000001.jpg --prompt "what colour is the shape?"
    mmpipe generate --run runs/demo_qwen3_vl --video clip.mp4 --prompt "what happens?"   (Qwen families)
"""
from __future__ import annotations

import os
from typing import Optional

from mmpipe.config.resolve import build_family
from mmpipe.config.schema import family_of
from mmpipe.errors import ConfigError
from mmpipe.families.chat import generate as chat
from mmpipe.families.chat.records import IMAGE
from mmpipe.families.lora import merged
from mmpipe.train.export import run_tokenizer
import mmpipe


def Generator(run_dir: str, step: Optional[int] = None, device: str = "cpu") -> chat.ChatGenerator:  # noqa: N802
    """The run's chat family, tokenizer and weights (any layout's checkpoint; LoRA folded in) as a
    ``ChatGenerator``."""
    cfg_path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"--run {run_dir}: no config.yaml (not an mmpipe run directory)")
    cfg = mmpipe.load_config(cfg_path)
    if not family_of(cfg).generates:
        raise ConfigError(f"--run {run_dir}: model.type={cfg.model.type} does not generate; mmpipe generate answers "
                          "with a chat family's run (e.g. model.type=vlm)")
    family = build_family(cfg, cfg.train.seed)  # (a LoRA run's: its adapters are folded in below)
    tok = run_tokenizer(cfg, family_of(cfg), run_dir)
    return chat.ChatGenerator(cfg, family, tok, merged(mmpipe.load_weights(run_dir, step), family.lora), device)


def exact_match(run_dir: str, chat_file: str, limit: Optional[int] = None, step: Optional[int] = None,
                progress: bool = True, max_new_tokens: int = 32) -> dict:
    """``--eval``: ``chat.exact_match`` of the run's generator (``RUN/exact_match.json``)."""
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit {limit}: give 1 or more (the most questions to score), or leave it out for all")
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {max_new_tokens}: give 1 or more (the most tokens an answer gets)")
    return chat.exact_match(Generator(run_dir, step), run_dir, chat_file, limit, progress, max_new_tokens)


def cmd_generate(args) -> int:
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: give 1 or more (the most tokens an answer gets)")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit {args.limit}: give 1 or more (the most questions --eval scores), or leave it out "
                          "for all")
    if args.eval:
        r = exact_match(args.run, args.eval, args.limit, args.step, max_new_tokens=args.max_new_tokens)
        print(f"exact match {r['exact_match']:.3f} on {r['n']} held-out questions (image questions "
              f"{r['exact_match_image_questions']:.3f}); best constant answer '{r['constant_answer']}' "
              f"{r['constant_baseline']:.3f} ({r['exact_match'] / max(r['constant_baseline'], 1e-9):.1f}x); best "
              f"answer per question without the image {r['question_prior_baseline']:.3f}")
        for q, v in r["by_question"].items():  # what the image taught: each image question against its prior
            if v["n"] >= 10 and q in r["image_questions"]:
                print(f"  {q:<34} {v['exact_match']:.3f} on {v['n']} (without the image {v['without_the_image']:.3f})")
        for e in r["examples"][:3]:
            print(f"  Q: {e['question']}  A: {e['got']!r}  (want {e['want']!r})")
        for why in r["skipped"][:5]:
            print(f"  skipped: {why}")
        if len(r["skipped"]) > 5:
            print(f"  ... {len(r['skipped'])} questions skipped in all (RUN/exact_match.json lists them)")
        return 0
    if not args.prompt:
        raise ConfigError("mmpipe generate: give --prompt (and --image), or --eval CHAT_FILE")
    images, prompt = args.image or [], args.prompt
    g = Generator(args.run, step=args.step)
    if len(images) > 1 and IMAGE not in prompt:  # several images, no markers: all of them first, in order
        prompt = (IMAGE + g.family.marker_join) * len(images) + prompt
    videos = getattr(args, "video", None) or []
    print(g.answer(prompt, images[0] if len(images) == 1 else images or None, max_new_tokens=args.max_new_tokens,
                   video=videos or None))
    return 0
