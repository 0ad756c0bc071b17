"""Greedy answers from a VLM run's checkpoint (any layout), on one device, with transformers'
``generate`` and its KV cache (the checkpoint is loaded into ``LlavaForConditionalGeneration``,
whose arithmetic the family matches).

    mmpipe generate --run runs/demo_vlm --image data/synth_vlm/images/000001.jpg --prompt "what colour is the shape?"
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from mmpipe.errors import ConfigError


class Generator:
    def __init__(self, run_dir: str, step: Optional[int] = None, device: str = "cpu"):
        import mmpipe
        from mmpipe.config.registry import build_family
        from mmpipe.config.schema import family_of
        from mmpipe.families.towers.common import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
        from mmpipe.train.export import run_tokenizer
        cfg_path = os.path.join(run_dir, "config.yaml")
        if not os.path.isfile(cfg_path):
            raise ConfigError(f"--run {run_dir}: no config.yaml (not an mmpipe run directory)")
        cfg = mmpipe.load_config(cfg_path)
        if cfg.model.type != "vlm":
            raise ConfigError(f"--run {run_dir}: model.type={cfg.model.type}; mmpipe generate answers with a VLM run")
        self.cfg = cfg
        self.family = build_family(cfg, cfg.train.seed)  # (a LoRA run's: its adapters are folded in below)
        self.tok = run_tokenizer(cfg, family_of(cfg), run_dir)
        self.encoder = self.family.encoder(self.tok, cfg.data.max_length)
        from mmpipe.families.lora import merged
        self.model = self.family.hf.hf_model(merged(mmpipe.load_weights(run_dir, step), self.family.lora)).to(device)
        self.device, self.mean, self.std = device, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
        self.size = self.family.vision_cfg.image_size
        self.stop = self.encoder.end_of_turn_ids()  # the end of the assistant's turn, as training learned it

    def pixels(self, image_path: str, what: str = "--image") -> torch.Tensor:
        from mmpipe.data.loader import decode_sample, finish_pixels
        from mmpipe.families.towers.common import normalize_pixels
        pixels, why = decode_sample(image_path, "<image>", self.cfg.data.decode_size or self.size, draft=False)
        if pixels is None:
            raise ConfigError(f"{what} {image_path}: {why}")
        pixels = finish_pixels(pixels, self.size, None, 0, 0)  # as training's ChatDataset
        return normalize_pixels(pixels.unsqueeze(0), self.mean, self.std, torch.float32)

    def prompt(self, prompt: str, image: Optional[str] = None, history: tuple = (), what: str = "--image") -> tuple:
        """(input ids (1, T), pixel values (1, 3, S, S) or None) of a user turn and the assistant header."""
        from mmpipe.families.vlm.chat_data import IMAGE
        n = prompt.count(IMAGE)
        if image is None and n:
            raise ConfigError(f"--prompt has {n} {IMAGE} marker(s) but no --image: give --image PATH, or drop the marker")
        if image is not None and n > 1:
            raise ConfigError(f"--prompt has {n} {IMAGE} markers but one --image: give one marker (or none: the image "
                              "goes first)")
        text = prompt if image is None or IMAGE in prompt else f"{IMAGE}\n{prompt}"
        ids = torch.tensor([self.encoder.prompt_ids(tuple(history) + (("user", text),))], device=self.device)
        return ids, (self.pixels(image, what).to(self.device) if image else None)

    @torch.no_grad()
    def generate_ids(self, prompt: str, image: Optional[str] = None, max_new_tokens: int = 24, stop: bool = True,
                     history: tuple = (), what: str = "--image") -> list:
        """The greedy continuation's token ids (KV cache); ``stop``: end at the end-of-turn token."""
        ids, pix = self.prompt(prompt, image, history, what)
        extra = {"pixel_values": pix} if pix is not None else {}
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **extra,
                                  max_new_tokens=max_new_tokens, min_new_tokens=0 if stop else max_new_tokens,
                                  do_sample=False, use_cache=True, eos_token_id=self.stop if stop else None,
                                  pad_token_id=self.tok.pad_token_id)
        return out[0, ids.shape[1]:].tolist()

    def answer(self, prompt: str, image: Optional[str] = None, max_new_tokens: int = 24, history: tuple = (),
               what: str = "--image") -> str:
        new = [t for t in self.generate_ids(prompt, image, max_new_tokens, history=history, what=what)
               if t not in self.stop]
        return self.tok.decode(new, skip_special_tokens=True).strip()


def exact_match(run_dir: str, chat_file: str, limit: Optional[int] = None, step: Optional[int] = None,
                progress: bool = True) -> dict:
    """Greedy answers to the first question of each held-out conversation, scored by exact match
    (case and surrounding spaces ignored), against two baselines: the best constant answer over
    the set, and the best constant answer per question (what a model that ignores the image can
    reach at most). Written to ``RUN/exact_match.json``."""
    import json
    from collections import Counter, defaultdict

    from mmpipe.families.vlm.chat_data import IMAGE, read_chat
    gen = Generator(run_dir, step)
    # LLaVA JSON names images relative to the run's data.image_folder, as training read them
    items = [s for s in read_chat(chat_file, gen.cfg.data.image_folder, key="--eval") if s.error is None][:limit]
    it = items
    if progress:
        from tqdm import tqdm
        it = tqdm(items, desc="answering", unit="q")
    rows, skipped = [], []
    norm = lambda s: " ".join(s.lower().split())  # noqa: E731
    for s in it:
        # the first user turn against the first assistant turn after it; a system turn before it is context
        u = next((i for i, (r, _) in enumerate(s.messages) if r == "user"), None)
        want = next((t for r, t in s.messages[u:] if r == "assistant"), None) if u is not None else None
        if want is None:
            skipped.append(f"{s.where}: no user turn followed by an assistant turn to score")
            continue
        question, image = s.messages[u][1].replace(IMAGE, "").strip(), s.images[0] if s.images else None
        try:
            got = gen.answer(question, image, history=s.messages[:u], what=f"{s.where}: image")
        except ConfigError as e:  # an image that does not decode: that question is skipped, and said
            skipped.append(str(e))
            continue
        rows.append({"question": question, "image": image, "want": norm(want), "got": norm(got)})
    n = max(1, len(rows))
    acc = sum(r["want"] == r["got"] for r in rows) / n
    constant = Counter(r["want"] for r in rows).most_common(1)[0] if rows else ("", 0)
    by_q = defaultdict(Counter)
    for r in rows:
        by_q[r["question"]][r["want"]] += 1
    prior = sum(c.most_common(1)[0][1] for c in by_q.values()) / n
    image_rows = [r for r in rows if r["image"]]
    out = {"n": len(rows), "exact_match": acc, "constant_answer": constant[0], "constant_baseline": constant[1] / n,
           "question_prior_baseline": prior,
           "exact_match_image_questions": sum(r["want"] == r["got"] for r in image_rows) / max(1, len(image_rows)),
           "examples": rows[:8], "skipped": skipped}
    with open(os.path.join(run_dir, "exact_match.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    return out


def cmd_generate(args) -> int:
    from mmpipe.cli.generate import Generator, exact_match
    if args.eval:
        r = exact_match(args.run, args.eval, args.limit, args.step)
        print(f"exact match {r['exact_match']:.3f} on {r['n']} held-out questions (image questions "
              f"{r['exact_match_image_questions']:.3f}); best constant answer '{r['constant_answer']}' "
              f"{r['constant_baseline']:.3f} ({r['exact_match'] / max(r['constant_baseline'], 1e-9):.1f}x); best "
              f"answer per question without the image {r['question_prior_baseline']:.3f}")
        for e in r["examples"][:3]:
            print(f"  Q: {e['question']}  A: {e['got']!r}  (want {e['want']!r})")
        for why in r["skipped"][:5]:
            print(f"  skipped: {why}")
        if len(r["skipped"]) > 5:
            print(f"  ... {len(r['skipped'])} questions skipped in all (RUN/exact_match.json lists them)")
        return 0
    if not args.prompt:
        raise ConfigError("mmpipe generate: give --prompt (and --image), or --eval CHAT_FILE")
    g = Generator(args.run, step=args.step)
    print(g.answer(args.prompt, args.image, max_new_tokens=args.max_new_tokens))
    return 0
