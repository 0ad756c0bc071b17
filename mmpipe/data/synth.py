"""Learnable synthetic data: JPEGs of coloured shapes of varied size and position on noisy
backgrounds, with captions that describe them ("a large red circle at the top left"), or (``--kind
vlm``) chat samples asking for their colour, shape, count and position plus some text-only
questions. Writes ``images/``, ``train.jsonl`` and ``val.jsonl``."""
from __future__ import annotations

import json
import os
import random
from typing import Optional

import numpy as np
from PIL import Image, ImageDraw

from mmpipe.errors import ConfigError

COLORS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (235, 210, 20),
          "purple": (140, 40, 170), "orange": (245, 130, 10), "white": (245, 245, 245)}
SHAPES = ("circle", "square", "triangle")
SIZES = {"small": 0.22, "large": 0.42}
ROWS = {"top": 0.25, "middle": 0.5, "bottom": 0.75}
COLS = {"left": 0.25, "center": 0.5, "right": 0.75}


def _position_words(row: str, col: str) -> str:
    if row == "middle" and col == "center":
        return "in the center"
    if row == "middle":
        return f"on the {col}"
    if col == "center":
        return f"at the {row}"
    return f"at the {row} {col}"


def make_image(rng: random.Random, size: int) -> tuple[Image.Image, str]:
    color, shape, sz = rng.choice(list(COLORS)), rng.choice(SHAPES), rng.choice(list(SIZES))
    row, col = rng.choice(list(ROWS)), rng.choice(list(COLS))
    im = _background(rng, size)
    d = ImageDraw.Draw(im)
    r = SIZES[sz] * size / 2 * rng.uniform(0.9, 1.1)
    cx = COLS[col] * size + rng.uniform(-0.04, 0.04) * size
    cy = ROWS[row] * size + rng.uniform(-0.04, 0.04) * size
    fill = tuple(int(np.clip(c + rng.randint(-20, 20), 0, 255)) for c in COLORS[color])
    _draw_shape(d, shape, cx, cy, r, fill)
    article = "an" if sz[0] in "aeiou" else "a"
    return im, f"{article} {sz} {color} {shape} {_position_words(row, col)}"


def _draw_shape(d, shape: str, cx: float, cy: float, r: float, fill) -> None:
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)


def _background(rng: random.Random, size: int, width: Optional[int] = None) -> Image.Image:
    width = width or size
    base = np.array([rng.randint(40, 110) for _ in range(3)], dtype=np.float32)
    grad = np.linspace(-25, 25, width, dtype=np.float32)[None, :, None]
    noise = np.random.default_rng(rng.randint(0, 2 ** 31)).normal(0, 12, (size, width, 3)).astype(np.float32)
    return Image.fromarray(np.clip(base[None, None, :] + grad + noise, 0, 255).astype(np.uint8), "RGB")


# ---- VLM chat set ------------------------------------------------------------------------------------
NUMBERS = ("one", "two", "three")
CELLS = [(row, col) for row in ROWS for col in COLS]
TEXT_QA = [(f"what number comes after {a}?", b) for a, b in zip(("one", "two", "three", "four"),
                                                                 ("two", "three", "four", "five"))] + \
          [(f"what colour is {thing}?", c) for thing, c in (("grass", "green"), ("the sky", "blue"),
                                                            ("snow", "white"), ("a banana", "yellow"))]


def make_vlm_sample(rng: random.Random, size: int, width: Optional[int] = None,
                    height: Optional[int] = None) -> tuple[Image.Image, list]:
    """An image of 1-3 shapes of one colour and kind, and its (question, answer) turns: colour,
    shape, count, and position when there is one shape. ``width`` / ``height`` (default ``size``): a
    larger photo-like frame, the shapes placed in its centre ``size`` square (what a centre crop keeps)."""
    color, shape = rng.choice(list(COLORS)), rng.choice(SHAPES)
    k = rng.randint(1, 3)
    cells = rng.sample(CELLS, k)
    w, h = width or size, height or size
    im = _background(rng, h, w)
    d = ImageDraw.Draw(im)
    r, x0, y0 = 0.12 * size, (w - size) / 2, (h - size) / 2
    for row, col in cells:
        fill = tuple(int(np.clip(c + rng.randint(-20, 20), 0, 255)) for c in COLORS[color])
        _draw_shape(d, shape, x0 + COLS[col] * size, y0 + ROWS[row] * size, r, fill)
    qa = [("what colour are the shapes?", color), ("what kind of shape is shown?", shape),
          ("how many shapes are there?", NUMBERS[k - 1])]
    if k == 1:
        qa.append(("where is the shape?", _position_words(*cells[0])))
    return im, qa


# mixed image sizes (w, h) for native-resolution models: 4 to 64 image tokens each at Qwen2.5-VL's
# 14 px patches merged 2x2 between min_pixels 3136 and max_pixels 50176 (`mmpipe data synth --sizes
# mixed`, the benches, the native-resolution demo)
MIXED_SIZES = [(56, 56), (224, 224), (112, 56), (56, 224), (168, 112), (224, 84)]


def synth_vlm(out: str, n: int, val_fraction: float = 0.1, size: int = 64, seed: int = 0, text_only: float = 0.15,
              progress: bool = True, width: Optional[int] = None, questions: Optional[tuple] = None,
              sizes: Optional[list] = None) -> dict:
    """ms-swift JSONL chat (``train.jsonl``, ``val.jsonl``) over ``images/``: each image sample asks
    one or two questions (the first turn carries ``<image>``); a ``text_only`` fraction are text
    questions without an image. Answers are short and exact (for exact-match evaluation).
    ``width``: wider frames (see ``make_vlm_sample``); ``questions``: ask only these; ``sizes``: (width,
    height) frames, each image one of them at random (mixed sizes for native-resolution models; in place
    of ``size`` / ``width``), its shapes in its centre square."""
    n_val = split_counts(n, val_fraction)
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    rng = random.Random(seed)
    rows = []
    it = range(n)
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc="synth chat", unit="sample")
    for i in it:
        if rng.random() < text_only:
            q, a = rng.choice(TEXT_QA)
            rows.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
            continue
        if sizes:
            w, h = rng.choice(sizes)
            im, qa = make_vlm_sample(rng, min(w, h), w, h)
        else:
            im, qa = make_vlm_sample(rng, size, width)
        qa = [x for x in qa if x[0] in questions] if questions else qa
        rel = f"images/{i:06d}.jpg"
        im.save(os.path.join(out, rel), quality=90)
        turns = rng.sample(qa, min(len(qa), rng.randint(1, 2)))
        msgs = []
        for j, (q, a) in enumerate(turns):
            msgs += [{"role": "user", "content": ("<image>\n" if j == 0 else "") + q}, {"role": "assistant", "content": a}]
        rows.append({"messages": msgs, "images": [rel]})
    for name, part in (("val.jsonl", rows[:n_val]), ("train.jsonl", rows[n_val:])):
        with open(os.path.join(out, name), "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in part)
    return {"train": os.path.join(out, "train.jsonl"), "val": os.path.join(out, "val.jsonl"),
            "n_train": n - n_val, "n_val": n_val}


def synth_skewed_chat(out: str, n: int, size: int = 64, seed: int = 0) -> dict:
    """A skewed chat mix (``mmpipe bench balance --mix skewed``): text-only single questions (10%),
    long text-only conversations of 6-10 turns (30%), one image with one question (35%), and several
    images (2-4) with one question (25%): micro-batches cut from it load the vision tower and the
    decoder very differently. ms-swift JSONL over ``images/``."""
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        r = rng.random()
        if r < 0.4:
            turns = [rng.choice(TEXT_QA) for _ in range(1 if r < 0.1 else rng.randint(6, 10))]
            rows.append({"messages": [m for q, a in turns for m in ({"role": "user", "content": q},
                                                                    {"role": "assistant", "content": a})]})
            continue
        k = 1 if r < 0.75 else rng.randint(2, 4)
        rels, qa = [], None
        for j in range(k):
            im, qa_j = make_vlm_sample(rng, size)
            qa = qa or qa_j
            rel = f"images/{i:06d}_{j}.jpg"
            im.save(os.path.join(out, rel), quality=90)
            rels.append(rel)
        q, a = rng.choice(qa)
        rows.append({"messages": [{"role": "user", "content": "<image>\n" * k + q},
                                  {"role": "assistant", "content": a}], "images": rels})
    path = os.path.join(out, "train.jsonl")
    with open(path, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    return {"train": path, "n_train": n}


def split_counts(n: int, val_fraction: float) -> int:
    """Val samples of ``n``: the rounded fraction, at least one, at most ``n`` (what is written and said)."""
    return min(n, max(1, int(round(n * val_fraction))))


def check_split(n: int, val_fraction: float) -> None:
    """``mmpipe data synth``'s flags: one line for a count or fraction that leaves nothing to train or hold out."""
    if n < 2:
        raise ConfigError(f"--n {n}: give at least 2 samples (one to train on, one to hold out)")
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction {val_fraction}: give a fraction in [0, 1) (the share held out for validation)")
    if split_counts(n, val_fraction) >= n:
        raise ConfigError(f"--val-fraction {val_fraction} of --n {n} leaves no training sample: lower it or raise --n")


def synth(out: str, n: int, val_fraction: float = 0.1, size: int = 96, seed: int = 0, progress: bool = True) -> dict:
    n_val = split_counts(n, val_fraction)
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    rng = random.Random(seed)
    rows = []
    it = range(n)
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc="synth images", unit="img")
    for i in it:
        im, caption = make_image(rng, size)
        rel = f"images/{i:06d}.jpg"
        im.save(os.path.join(out, rel), quality=90)
        rows.append({"image": rel, "text": caption})
    with open(os.path.join(out, "train.jsonl"), "w") as fh:
        for r in rows[n_val:]:
            fh.write(json.dumps(r) + "\n")
    with open(os.path.join(out, "val.jsonl"), "w") as fh:
        for r in rows[:n_val]:
            fh.write(json.dumps(r) + "\n")
    return {"train": os.path.join(out, "train.jsonl"), "val": os.path.join(out, "val.jsonl"),
            "n_train": n - n_val, "n_val": n_val}
