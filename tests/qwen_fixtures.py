"""What the Qwen families' tests share: a run config resolved on a saved tiny directory, chat files, images of
five sizes, the plain model with a directory's weights."""
from __future__ import annotations

import json
import os

import numpy as np
from PIL import Image

import mmpipe

SIZES = [(64, 64), (160, 96), (64, 192), (128, 128), (224, 64)]  # five grids at patch 16, merge 2


def resolved_family(name: str, d: str, yaml_path: str = None, attention: str = "sdpa", max_length: int = 256,
                    **data):
    """(config, family, tokenizer) of ``model.type: name`` on the directory ``d`` (its run config written to
    ``yaml_path``, default beside ``d``), at the tests' pixel bounds."""
    import yaml

    from mmpipe.config.registry import get_family
    from mmpipe.config.resolve import resolve_family
    from mmpipe.data.tokenizer import load_tokenizer
    path = str(yaml_path or os.path.join(os.path.dirname(d), "run.yaml"))
    with open(path, "w") as fh:
        yaml.safe_dump({"model": {"type": name, "pretrained": d, "attention": attention},
                        "data": {"max_length": max_length, "min_pixels": 4096, "max_pixels": 65536, "num_workers": 0,
                                 **data}}, fh)
    tok = get_family(name).prepare_tokenizer(load_tokenizer(d))
    cfg, fam = resolve_family(mmpipe.load_config(path), tok)
    return cfg, fam, tok


def write_chat(path, rows, media: dict = None) -> str:
    """A chat file of one question and answer per row: ``(marks, question, answer, images)``, or with ``media``
    (name -> file) ``(marks, question, answer, image names, video names)``."""
    with open(path, "w") as fh:
        for row in rows:
            marks, q, a, ims = row[:4]
            rec = {"messages": [{"role": "user", "content": "".join(marks) + "\n" + q},
                                {"role": "assistant", "content": a}]}
            if media is None:
                rec["images"] = ims
            else:
                rec.update(images=[media[k] for k in ims], videos=[media[k] for k in row[4]])
            fh.write(json.dumps(rec) + "\n")
    return str(path)


def write_images(tmp_path, sizes=SIZES) -> list:
    """Random RGB PNGs of ``sizes`` (w, h)."""
    rng = np.random.default_rng(0)
    paths = []
    for k, (w, h) in enumerate(sizes):
        paths.append(str(tmp_path / f"im{k}.png"))
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(paths[-1])
    return paths


def loaded_model(fam):
    """The family's single-process model with its directory's weights in every layer."""
    from mmpipe.parallel.plain import plain_model
    model = plain_model(fam)
    for name in fam.layer_names():
        fam.load_pretrained(model.get_submodule(name), name)
    return model


def check_generates_as_mmpipe(hf, proc, run_dir: str, tmp_path, sizes) -> None:
    """Greedy ``generate`` of the exported transformers model ``hf`` (its ``proc``) on held-out images of ``sizes``
    gives ``mmpipe generate``'s tokens for the run ``run_dir``, from the processor's prompt = training's ids (mmpipe's
    prompt puts the image first, straight before the text, as the Qwen chat template renders it)."""
    import random

    import torch

    from mmpipe.cli.generate import Generator
    from mmpipe.data.synth import make_vlm_sample
    g = Generator(run_dir)
    for k, size in enumerate(sizes):
        im, qa = make_vlm_sample(random.Random(k), 48)
        path = str(tmp_path / f"held_out_{k}.png")
        im.resize(size).save(path)
        question = qa[0][0]
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        enc = proc(text=proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                   images=[Image.open(path).convert("RGB")], return_tensors="pt")
        ids, _ = g.prompt(question, path)
        assert enc["input_ids"].tolist() == ids.tolist()
        with torch.no_grad():
            got = hf.generate(**enc, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
        want = g.generate_ids(question, path, max_new_tokens=8)
        assert got[:len(want)] == want and (len(want) == 8 or want[-1] in g.stop)
