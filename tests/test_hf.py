"""transformers parity: a tiny CLIPModel saved with save_pretrained and loaded via model.pretrained
gives the same loss and features as transformers itself, single-process and pipelined (P = 2)."""
from __future__ import annotations

import os

import pytest
from mmpipe.data.pixels import SquarePixels
import torch
from helpers import TINY, launch, train_losses

import mmpipe
from mmpipe.parallel.plain import plain_model
from mmpipe.families.towers.common import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    normalize_pixels,
)


def _tiny_clip(vocab_size, eos, pad=0):
    from transformers import CLIPConfig, CLIPModel
    cfg = CLIPConfig(
        text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                         vocab_size=vocab_size, max_position_embeddings=16, eos_token_id=eos, bos_token_id=None,
                         pad_token_id=pad),
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                           image_size=32, patch_size=8),
        projection_dim=16)
    torch.manual_seed(0)
    return CLIPModel(cfg).eval()


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory, tiny_data):
    from mmpipe.data.manifest import read_manifest
    from mmpipe.data.tokenizer import eos_id, train_tokenizer
    d = tmp_path_factory.mktemp("hf")
    tok = train_tokenizer([s.text for s in read_manifest(tiny_data["train"])], 300, str(d / "tokenizer"))
    model = _tiny_clip(len(tok), eos_id(tok))
    model.save_pretrained(str(d / "clip"))
    return {"clip": str(d / "clip"), "tokenizer": str(d / "tokenizer"), "model": model, "tok": tok}


def test_build_model_matches_transformers(clip_dir):
    hf = clip_dir["model"]
    cfg = mmpipe.load_config(None, [f"model.pretrained={clip_dir['clip']}"])
    m = mmpipe.build_model(cfg).eval()
    torch.manual_seed(1)
    pix = torch.randn(6, 3, 32, 32)
    enc = clip_dir["tok"](["a red circle", "a large blue square at the top", "x", "a b c d e f g", "small", "green"],
                          padding="max_length", max_length=16, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values=pix, attention_mask=mask, return_loss=True).loss
        torch.testing.assert_close(m(pix, ids, mask), ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(m.encode_image(pix), hf.get_image_features(pixel_values=pix).pooler_output,
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(m.encode_text(ids, mask),
                                   hf.get_text_features(input_ids=ids, attention_mask=mask).pooler_output,
                                   atol=1e-5, rtol=0)


def test_pipelined_first_step_matches_transformers(clip_dir, tiny_data, tmp_path):
    from mmpipe.data.loader import Collate, ImageTextDataset
    from mmpipe.data.sampler import MicroBatchSampler
    from mmpipe.data.manifest import read_manifest
    out = str(tmp_path / "run")
    launch(2, ["--config", TINY, "--set", f"data.train={tiny_data['train']}", "--set", f"train.output_dir={out}",
               "--set", f"model.pretrained={clip_dir['clip']}", "--set", f"data.tokenizer={clip_dir['tokenizer']}",
               "--set", "parallel.pipeline_stages=2", "--stop-at", "1"])
    loss = train_losses(out)[0]
    # the same first global batch (4 micro-batches of 4) through transformers' CLIPModel at once: the
    # loss spans the whole global batch (model.negatives: global)
    samples = read_manifest(tiny_data["train"])
    ds, collate = ImageTextDataset(samples, SquarePixels(32)), Collate(clip_dir["tok"], 16)
    cfg = mmpipe.load_config(TINY)
    sampler = MicroBatchSampler(len(samples), 4, 4, 1, 0, cfg.train.seed)
    hf = clip_dir["model"]
    with torch.no_grad():
        b = collate([ds[i] for mb in sampler.micro_batches(0) for i in mb])
        pix = normalize_pixels(b["pixel_values"], OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, torch.float32)
        ref = hf(input_ids=b["input_ids"], pixel_values=pix, attention_mask=b["attention_mask"], return_loss=True).loss
    assert abs(loss - float(ref)) < 1e-5
    assert os.path.isfile(os.path.join(out, "plan.json"))


def test_clip_family_maps_its_weights_to_transformers_and_back():
    """``to_hf`` gives a state dict transformers' CLIPModel (built from the adapter's ``hf_config``)
    loads strictly and whose features equal ours; ``from_hf`` inverts it exactly."""
    from transformers import CLIPModel

    from mmpipe.config.resolve import build_family
    cfg = mmpipe.load_config(TINY, ["model.text.vocab_size=50", "model.text.eos_token_id=3",
                                    "model.text.max_position_embeddings=16"])
    family = build_family(cfg)
    model = plain_model(family).eval()
    sd = model.state_dict()
    adapter = family.hf
    hf_model = CLIPModel(adapter.hf_config()).eval()
    hf_model.load_state_dict(adapter.to_hf(sd), strict=True)
    back = adapter.from_hf(hf_model.state_dict())
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    g = torch.Generator().manual_seed(0)
    pix = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, generator=g)
    ids = torch.randint(4, 50, (2, 16), generator=g)
    ids[:, 9] = 3
    mask = torch.ones_like(ids)
    with torch.no_grad():
        norm = normalize_pixels(pix, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, torch.float32)
        torch.testing.assert_close(model.encode_image(pix), hf_model.get_image_features(pixel_values=norm).pooler_output,
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(model.encode_text(ids, mask),
                                   hf_model.get_text_features(input_ids=ids, attention_mask=mask).pooler_output,
                                   atol=1e-5, rtol=0)
