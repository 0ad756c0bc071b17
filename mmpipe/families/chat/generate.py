"""Greedy answers from a chat family's run checkpoint (any layout), on one device, with transformers'
``generate`` and its KV cache (the checkpoint is loaded into the family's transformers model,
``hf.hf_model``, whose arithmetic the family matches), and ``--eval``'s exact match on held-out
conversations."""
from __future__ import annotations

import os
from typing import Optional

import torch

from mmpipe.errors import ConfigError, DataError
from mmpipe.families.chat.records import IMAGE, read_chat, VIDEO


class ChatGenerator:
    """Greedy generation of a chat family's transformers model (``family.hf.hf_model`` of ``state``,
    a plain state dict with LoRA folded in), prompts encoded as training's encoder encodes them.
    ``mmpipe.cli.generate.Generator`` builds one from a run directory."""

    def __init__(self, cfg, family, tok, state: dict, device: str = "cpu"):
        self.cfg, self.family, self.tok, self.device = cfg, family, tok, device
        self.encoder = family.encoder(tok, cfg.data.max_length, cfg.data)
        self.model = family.hf.hf_model(state).to(device)
        self.stop = self.encoder.end_of_turn_ids()  # the end of the assistant's turn, as training learned it

    def images(self, paths: list, what: str = "--image", videos: tuple = ()) -> dict:
        """The model's image (and video) inputs for ``paths`` (``videos``), prepared as training prepared them
        (the family's)."""
        extra = {"videos": list(videos)} if videos else {}
        try:
            return {k: v.to(self.device) for k, v in
                    self.family.generation_inputs(list(paths), self.cfg.data, **extra).items()}
        except ConfigError as e:
            raise ConfigError(f"{what} {e}") from None

    def prompt(self, prompt: str, image=None, history: tuple = (), what: str = "--image", video=None) -> tuple:
        """(input ids (1, T), the model's image inputs or None) of ``history``, a user turn and the
        assistant header, tokenized as training's chat encoder does. ``image``: one path (``--image``:
        a prompt without a marker gets it first, joined to the text as the family's template joins them:
        ``family.marker_join``), or a list of paths, one per ``<image>`` marker of ``history`` and ``prompt``
        in order (a chat sample's, the turn as written); ``video`` likewise with ``<video>`` markers. ``what``
        names the images in a message (``--image``, or an eval row's ``where: image``)."""
        paths = [] if image is None else [image] if isinstance(image, str) else list(image)
        n = prompt.count(IMAGE)
        before = sum(t.count(IMAGE) for _, t in history)
        join = self.family.marker_join
        if isinstance(image, str) or image is None:  # the command line's one --image
            if image is None and n:
                raise ConfigError(f"--prompt has {n} {IMAGE} marker(s) but no --image: give --image PATH, or drop "
                                  "the marker")
            if image is not None and n > 1:
                raise ConfigError(f"--prompt has {n} {IMAGE} markers but one --image: give one marker (or none: the "
                                  "image goes first)")
            if image is not None and n + before == 0:
                prompt, n = f"{IMAGE}{join}{prompt}", 1
        if n + before != len(paths):
            raise ConfigError(f"{what}: {n + before} {IMAGE} marker(s) but {len(paths)} image(s) (one image per "
                              "marker, in order)")
        videos = [] if video is None else [video] if isinstance(video, str) else list(video)
        vwhat = "--video" if what == "--image" else what.replace(": image", ": video")
        if videos and self.encoder.video is None:
            raise ConfigError(f"{vwhat}: model.type={self.cfg.model.type} has no video input (qwen2_5_vl, qwen3_vl "
                              "and qwen3_5 have)")
        marks = prompt.count(VIDEO) + sum(t.count(VIDEO) for _, t in history)
        if what == "--image" and videos and marks == 0:  # the command line's videos, no marker: first, in order
            prompt, marks = VIDEO * len(videos) + join + prompt, len(videos)
        if marks != len(videos):
            raise ConfigError(f"{vwhat}: {marks} {VIDEO} marker(s) but {len(videos)} video(s) (one video per marker, "
                              "in order)")
        try:
            ids = self.encoder.prompt_ids(tuple(history) + (("user", prompt),), paths, videos)
        except DataError as e:  # named by the file it is about: an image's or a video's
            raise ConfigError(f"{vwhat if str(e).startswith(tuple(map(str, videos))) else what} {e}") from None
        ids = torch.tensor([ids], device=self.device)
        return ids, (self.images(paths, what, videos) if paths or videos else None)

    @torch.no_grad()
    def generate_ids(self, prompt: str, image=None, max_new_tokens: int = 32, stop: bool = True,
                     history: tuple = (), what: str = "--image", video=None) -> list:
        """The greedy continuation's token ids (KV cache); ``stop``: end at the end-of-turn token;
        ``image`` / ``video``: as ``prompt`` takes them."""
        if max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens {max_new_tokens}: give 1 or more (the most tokens an answer gets)")
        ids, extra = self.prompt(prompt, image, history, what, video)
        extra = self.family.generation_kwargs(ids, extra or {})
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **extra,
                                  max_new_tokens=max_new_tokens, min_new_tokens=0 if stop else max_new_tokens,
                                  do_sample=False, use_cache=True, eos_token_id=self.stop if stop else None,
                                  pad_token_id=self.tok.pad_token_id)
        return out[0, ids.shape[1]:].tolist()

    def answer(self, prompt: str, image=None, max_new_tokens: int = 32, history: tuple = (),
               what: str = "--image", video=None) -> str:
        new = [t for t in self.generate_ids(prompt, image, max_new_tokens, history=history, what=what, video=video)
               if t not in self.stop]
        return self.tok.decode(new, skip_special_tokens=True).strip()


def first_question(s) -> object:
    """(history, the first user turn's text as written, the images and the videos of history and turn, the
    answer wanted) of a chat sample, or why it has none to score. The images (videos) of a sample are consumed
    by its ``<image>`` (``<video>``) markers in message order; a system turn before the question is context."""
    u = next((i for i, (r, _) in enumerate(s.messages) if r == "user"), None)
    want = next((t for r, t in s.messages[u:] if r == "assistant"), None) if u is not None else None
    if want is None:
        return f"{s.where}: no user turn followed by an assistant turn to score"
    upto = sum(t.count(IMAGE) for _, t in s.messages[:u + 1])
    videos = sum(t.count(VIDEO) for _, t in s.messages[:u + 1])
    return tuple(s.messages[:u]), s.messages[u][1], tuple(s.images[:upto]), tuple(s.videos[:videos]), want


def _scored(text: str, images: tuple, want: str, got: str, videos: tuple = ()) -> dict:
    norm = lambda x: " ".join(x.lower().split())  # noqa: E731
    return {"question": " ".join(text.replace(IMAGE, " ").replace(VIDEO, " ").split()), "images": list(images),
            "image": images[0] if images else None, "videos": list(videos), "want": norm(want), "got": norm(got)}


def exact_match(gen: ChatGenerator, run_dir: str, chat_file: str, limit: Optional[int] = None,
                progress: bool = True, max_new_tokens: int = 32) -> dict:
    """Greedy answers (at most ``max_new_tokens`` each) to the first question of each held-out
    conversation, asked as written (its text and ``<image>`` markers where they stand, with the
    images its markers name), scored by exact match (case and surrounding spaces ignored), against
    two baselines: the best constant answer over the set, and the best constant answer per question
    (what a model that ignores the image can reach at most). Written to ``RUN/exact_match.json``."""
    import json
    from collections import Counter, defaultdict

    if limit is not None and limit < 1:
        raise ConfigError(f"--limit {limit}: give 1 or more (the most questions to score), or leave it out for all")
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {max_new_tokens}: give 1 or more (the most tokens an answer gets)")
    # LLaVA JSON names images relative to the run's data.image_folder, as training read them
    items, skipped = [], []
    for s in read_chat(chat_file, gen.cfg.data.image_folder, key="--eval"):
        if limit is not None and len(items) >= limit:
            break
        if s.error is None:
            items.append(s)
        else:  # a row the reader cannot use (a video, a malformed line): named, as training names it
            skipped.append(f"{s.where}: {s.error}")
    it = items
    if progress:
        from tqdm import tqdm
        it = tqdm(items, desc="answering", unit="q")
    rows = []
    for s in it:
        asked = first_question(s)
        if isinstance(asked, str):
            skipped.append(asked)
            continue
        history, text, images, videos, want = asked
        try:
            got = gen.answer(text, list(images), max_new_tokens, history=history, what=f"{s.where}: image",
                             video=list(videos))
        except (ConfigError, DataError) as e:  # an image that does not decode: that question is skipped, and said
            skipped.append(str(e) if s.where in str(e) else f"{s.where}: {e}")
            continue
        rows.append(_scored(text, images[sum(t.count(IMAGE) for _, t in history):], want, got,
                            videos[sum(t.count(VIDEO) for _, t in history):]))
    n = max(1, len(rows))
    acc = sum(r["want"] == r["got"] for r in rows) / n
    constant = Counter(r["want"] for r in rows).most_common(1)[0] if rows else ("", 0)
    by_q = defaultdict(Counter)
    for r in rows:
        by_q[r["question"]][r["want"]] += 1
    prior = sum(c.most_common(1)[0][1] for c in by_q.values()) / n
    image_rows = [r for r in rows if r["images"]]
    out = {"n": len(rows), "exact_match": acc, "constant_answer": constant[0], "constant_baseline": constant[1] / n,
           "question_prior_baseline": prior,
           "exact_match_image_questions": sum(r["want"] == r["got"] for r in image_rows) / max(1, len(image_rows)),
           "image_questions": sorted({r["question"] for r in image_rows}),
           "by_question": {q: {"n": sum(c.values()), "exact_match": sum(r["want"] == r["got"] for r in rows
                                                                        if r["question"] == q) / sum(c.values()),
                               "without_the_image": c.most_common(1)[0][1] / sum(c.values())}
                           for q, c in sorted(by_q.items())},
           "examples": rows[:8], "skipped": skipped}
    with open(os.path.join(run_dir, "exact_match.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    return out
