"""`mmpipe export`: a pipelined run's checkpoint as a transformers directory, loaded back with
transformers' own classes and processors, gives mmpipe's outputs (fp32, within 1e-5)."""
from __future__ import annotations

import os

import pytest
import torch
from PIL import Image

import mmpipe
from test_parity import reference


def _png(tmp_path, size: int) -> str:
    """A real image at the tower's size (PNG: decoded exactly alike by every library)."""
    import random

    from mmpipe.data.synth import make_image
    im, _ = make_image(random.Random(3), size)
    path = str(tmp_path / "shape.png")
    im.save(path)
    return path


def test_clip_run_exports_to_clipmodel_and_clipprocessor(runs, tmp_path):
    from transformers import CLIPModel, CLIPProcessor

    from mmpipe.cli import main
    from mmpipe.data.loader import load_image
    ref = reference(runs)
    out = str(tmp_path / "clip_hf")
    assert main(["export", "--run", ref, "--out", out]) == 0
    hf, proc = CLIPModel.from_pretrained(out).eval(), CLIPProcessor.from_pretrained(out)
    cfg = mmpipe.load_config(os.path.join(ref, "config.yaml"))
    ours = mmpipe.build_model(cfg).eval()
    ours.load_state_dict(mmpipe.load_weights(ref))
    png, caption = _png(tmp_path, 32), "a small red circle at the top left"
    enc = proc(text=[caption], images=[Image.open(png)], return_tensors="pt", padding="max_length",
               max_length=cfg.data.max_length)
    with torch.no_grad():
        want_img = ours.encode_image(load_image(png, 32).unsqueeze(0))
        want_txt = ours.encode_text(enc["input_ids"], enc["attention_mask"])
        got_img = hf.get_image_features(pixel_values=enc["pixel_values"]).pooler_output
        got_txt = hf.get_text_features(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).pooler_output
    torch.testing.assert_close(got_img, want_img, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_txt, want_txt, atol=1e-5, rtol=0)
    # the processor's ids are the run's tokenizer's
    from mmpipe.data.tokenizer import load_tokenizer
    tok = load_tokenizer(os.path.join(ref, "tokenizer"))
    assert enc["input_ids"][0].tolist() == tok(caption, padding="max_length", max_length=16)["input_ids"]


def test_vlm_run_exports_to_llava_and_its_processor(family_runs_of, tiny_chat_data, tmp_path):
    from transformers import LlavaForConditionalGeneration, LlavaProcessor

    from mmpipe.export import export
    ref = reference(family_runs_of("vlm"))
    out = export(ref, str(tmp_path / "llava_hf"))
    hf, proc = LlavaForConditionalGeneration.from_pretrained(out).eval(), LlavaProcessor.from_pretrained(out)
    ours = mmpipe.build_model(mmpipe.load_config(os.path.join(ref, "config.yaml"))).eval()
    ours.load_state_dict(mmpipe.load_weights(ref))
    messages = [{"role": "user", "content": "<image>\nwhat colour are the shapes?"}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True)
    assert text == "<|user|>\n<image>\nwhat colour are the shapes?<|end|>\n<|assistant|>\n"  # the run's template
    enc = proc(text=text, images=Image.open(_png(tmp_path, 32)), return_tensors="pt")
    assert int((enc["input_ids"] == ours.family.image_token_id).sum()) == ours.family.n_image_tokens() == 16
    with torch.no_grad():
        got = hf(**enc).logits
        want = ours.eval_outputs(enc["pixel_values"], enc["input_ids"], enc["attention_mask"])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert hf.lm_head.weight.data_ptr() == hf.get_input_embeddings().weight.data_ptr()  # the tie survives


def test_export_bf16_and_bad_input(runs, tmp_path, capsys):
    from safetensors import safe_open

    from mmpipe.cli import main
    ref = reference(runs)
    out = str(tmp_path / "bf16")
    assert main(["export", "--run", ref, "--out", out, "--dtype", "bf16", "--step", "4"]) == 0
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as fh:
        assert all(fh.get_tensor(k).dtype == torch.bfloat16 for k in fh.keys())
    capsys.readouterr()
    for args, expect in ((["--run", str(tmp_path / "nothing")], "no config.yaml"),
                         (["--run", ref, "--step", "5"], "no checkpoint for step 5")):
        assert main(["export", *args, "--out", str(tmp_path / "x")]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expect in err[0], err
