"""Qwen3.5 (``model.type: qwen3_5``): transformers' arithmetic (a directory written offline, fed by its own
processor), packed rows whose samples never share a GatedDeltaNet's conv window or recurrent state (and a test
that sees the leak when they do), cuts inside the ViT and between linear-attention layers, LoRA against peft,
export back to ``Qwen3_5ForConditionalGeneration`` answering as ``mmpipe generate``. Layout parity (P2 x DP2)
and resume on the mixed-size chat data: tests/test_parity.py (``TINY_CONFIGS``)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from helpers import TINY_CONFIGS, train_losses
from PIL import Image
from test_parity import _weights, assert_weights_close, reference

import mmpipe

TINY_Q35 = TINY_CONFIGS["qwen3_5"]
SIZES = [(64, 64), (160, 96), (64, 192), (128, 128), (224, 64)]  # five grids at patch 16, merge 2


@pytest.fixture(scope="module")
def q35_dir(tmp_path_factory):
    from mmpipe.families.qwen_vl.tiny import write_tiny_qwen3_5
    return write_tiny_qwen3_5(str(tmp_path_factory.mktemp("q35") / "dir"), seed=1)


def _family(d: str, **data):
    from mmpipe.config.resolve import resolve_family
    from mmpipe.config.registry import get_family
    from mmpipe.data.tokenizer import load_tokenizer
    import yaml
    path = os.path.join(os.path.dirname(d), "run.yaml")
    with open(path, "w") as fh:
        yaml.safe_dump({"model": {"type": "qwen3_5", "pretrained": d},
                        "data": {"max_length": 256, "min_pixels": 4096, "max_pixels": 65536, "num_workers": 0, **data}},
                       fh)
    tok = get_family("qwen3_5").prepare_tokenizer(load_tokenizer(d))
    cfg, fam = resolve_family(mmpipe.load_config(path), tok)
    return cfg, fam, tok


def _chat(tmp_path, rows) -> str:
    with open(tmp_path / "chat.jsonl", "w") as fh:
        for marks, q, a, ims in rows:
            fh.write(json.dumps({"messages": [{"role": "user", "content": "".join(marks) + "\n" + q},
                                              {"role": "assistant", "content": a}], "images": ims}) + "\n")
    return str(tmp_path / "chat.jsonl")


def _images(tmp_path) -> list:
    rng = np.random.default_rng(0)
    paths = []
    for k, (w, h) in enumerate(SIZES):
        paths.append(str(tmp_path / f"im{k}.png"))
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(paths[-1])
    return paths


def test_loss_and_logits_are_transformers_fed_by_its_own_processor(q35_dir, tmp_path):
    """mmpipe's encoder and collate give the processor's ids, patches and grids (five image sizes, two-image,
    one-image and text-only rows), and the model transformers' loss and logits (within 1e-5)."""
    from transformers import AutoProcessor, Qwen3_5ForConditionalGeneration

    from mmpipe.families.chat import read_chat
    from mmpipe.parallel.plain import plain_model
    paths = _images(tmp_path)
    rows = [(["<image>", "<image>"], "what colour are the shapes?", "red", paths[:2]),
            ([], "what is two plus two?", "four", []),
            (["<image>"], "how many shapes are there?", "three", paths[2:3]),
            (["<image>", "<image>"], "where is the shape?", "at the top left", paths[3:])]
    cfg, fam, tok = _family(q35_dir)
    ds, collate = fam.dataset(read_chat(_chat(tmp_path, rows)), tok, cfg.data), fam.collate(tok, cfg.data)
    b = collate([ds[i] for i in range(len(rows))])
    assert len({tuple(g.tolist()) for g in b["image_grid_thw"]}) == 5
    proc = AutoProcessor.from_pretrained(q35_dir)
    proc.image_processor.size = {"shortest_edge": 4096, "longest_edge": 65536}
    texts = [proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}] * len(marks) +
                                        [{"type": "text", "text": "\n" + q}]},
                                       {"role": "assistant", "content": [{"type": "text", "text": a}]}])
             for marks, q, a, _ in rows]
    enc = proc(text=texts, images=[Image.open(p).convert("RGB") for p in paths], return_tensors="pt", padding=True)
    mask = b["attention_mask"].bool()
    for i in range(len(rows)):
        assert b["input_ids"][i][mask[i]].tolist() == enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist()
    torch.testing.assert_close(b["pixel_values"], enc["pixel_values"], rtol=0, atol=0)
    assert torch.equal(b["image_grid_thw"], enc["image_grid_thw"])
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(q35_dir).eval()
    ours = plain_model(fam).eval()
    with torch.no_grad():
        inputs = [b[k] for k in fam.inputs]
        logits = ours.eval_outputs(*inputs)
        loss = ours(*inputs, b["labels"])
        out = hf(input_ids=b["input_ids"], attention_mask=b["attention_mask"], pixel_values=b["pixel_values"],
                 image_grid_thw=b["image_grid_thw"], mm_token_type_ids=(b["input_ids"] == fam.image_token_id).int(),
                 labels=b["labels"])
    torch.testing.assert_close(loss, out.loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[mask], out.logits[mask], rtol=0, atol=1e-5)
    assert (b["labels"] != -100).sum() > 10 and out.loss > 1.0  # a real loss over the answers


def _packed_and_unpacked(q35_dir, tmp_path):
    """Six samples (images of five sizes, a text-only one) as six rows, and as two packed rows of three."""
    from mmpipe.families.chat import read_chat
    paths = _images(tmp_path)
    rows = [(["<image>"], "what colour are the shapes?", "red", paths[:1]),
            ([], "what is two plus two?", "four", []),
            (["<image>", "<image>"], "how many shapes are there?", "three and two", paths[1:3]),
            (["<image>"], "where is the shape?", "at the top left", paths[3:4]),
            (["<image>"], "what kind of shape is shown?", "a circle", paths[4:5]),
            ([], "what number comes after one?", "two", [])]
    cfg, fam, tok = _family(q35_dir)
    recs = read_chat(_chat(tmp_path, rows))
    ds, collate = fam.dataset(recs, tok, cfg.data), fam.collate(tok, cfg.data)
    single = collate([ds[i] for i in range(6)])
    pcfg, _, _ = _family(q35_dir, packing=True, max_length=10**4)
    packs = fam.dataset(recs, tok, pcfg.data)
    packs.packs = [[0, 1, 2], [3, 4, 5]]  # three samples a row
    packed = collate([packs[0], packs[1]])
    assert packed["attention_mask"].max() == 3
    return fam, single, packed


def _loss_and_grads(model, fam, b):
    model.zero_grad()
    loss = model(*[b[k] for k in fam.inputs], b["labels"], torch.tensor(float((b["labels"] != -100).sum())))
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def test_packed_rows_give_the_unpacked_loss_and_every_gradient(q35_dir, tmp_path):
    """Rows of three samples each: the loss and every gradient within 1e-5 of the six rows alone (each
    GatedDeltaNet's conv and recurrence restart at each sample, full attention stays within it)."""
    from mmpipe.parallel.plain import plain_model
    fam, single, packed = _packed_and_unpacked(q35_dir, tmp_path)
    model = plain_model(fam).train()
    for name in fam.layer_names():
        fam.load_pretrained(model.get_submodule(name), name)
    a, ga = _loss_and_grads(model, fam, single)
    b, gb = _loss_and_grads(model, fam, packed)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert ga.keys() == gb.keys() and any(".linear_attn." in k for k in ga)
    for k in ga:
        torch.testing.assert_close(gb[k], ga[k], rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")


def test_a_state_carried_across_a_sample_boundary_is_seen(q35_dir, tmp_path, monkeypatch):
    """The comparison above fails when a linear-attention layer runs a packed row whole (its conv window and
    recurrent state carried from one sample into the next: what NVIDIA-NeMo/Automodel#2147 shipped)."""
    from mmpipe.families.qwen_vl import qwen3_5_model
    from mmpipe.parallel.plain import plain_model
    fam, single, packed = _packed_and_unpacked(q35_dir, tmp_path)
    real = qwen3_5_model.mask_kind
    monkeypatch.setattr(qwen3_5_model, "mask_kind", lambda m: "causal" if real(m) == "packed" else real(m))
    model = plain_model(fam).train()
    for name in fam.layer_names():
        fam.load_pretrained(model.get_submodule(name), name)
    a, _ = _loss_and_grads(model, fam, single)
    b, _ = _loss_and_grads(model, fam, packed)
    assert abs(float(a) - float(b)) > 1e-3, (a, b)
