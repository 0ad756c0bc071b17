"""SigLIP (``model.type: siglip``): a ``SiglipModel`` directory gives transformers' features and loss
through ``mmpipe.build_model``; a run exports to a directory ``SiglipModel`` and ``SiglipProcessor``
load with the run's features and tokens; every layout trains like one process on one micro-batch of
the whole global batch (the layout parity against the P = 2 reference runs in test_parity.py)."""
from __future__ import annotations

import os

import pytest
import torch
from helpers import TINY_CONFIGS, assert_same_training
from PIL import Image
from test_parity import reference

import mmpipe

TINY_SIGLIP = TINY_CONFIGS["siglip"]


def _siglip_dir(tmp_path) -> str:
    """A SiglipModel of the tiny config's shape, random weights, a temperature and bias away from init."""
    from transformers import SiglipConfig, SiglipModel
    torch.manual_seed(0)
    tower = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    model = SiglipModel(SiglipConfig(text_config=dict(tower, vocab_size=300, max_position_embeddings=16),
                                     vision_config=dict(tower, image_size=32, patch_size=8)))
    with torch.no_grad():
        model.logit_scale.fill_(1.7)
        model.logit_bias.fill_(-3.2)
    out = str(tmp_path / "siglip")
    model.save_pretrained(out)
    return out


def test_a_siglipmodel_directory_gives_transformers_features_and_loss(tmp_path):
    from transformers import SiglipModel
    d = _siglip_dir(tmp_path)
    theirs = SiglipModel.from_pretrained(d).eval()
    cfg = mmpipe.load_config(TINY_SIGLIP, [f"model.pretrained={d}"])
    ours = mmpipe.build_model(cfg).eval()
    assert ours.loss.logit_scale.item() == pytest.approx(1.7) and ours.loss.logit_bias.item() == pytest.approx(-3.2)
    g = torch.Generator().manual_seed(1)
    pixels, ids = torch.randn(6, 3, 32, 32, generator=g), torch.randint(3, 300, (6, 16), generator=g)
    with torch.no_grad():
        want = theirs(pixel_values=pixels, input_ids=ids, return_loss=True)
        img, txt = ours.encode_image(pixels), ours.encode_text(ids, torch.ones_like(ids))
        loss = ours.family.batch_loss(ours.loss, torch.cat([img, txt], dim=-1))
    torch.testing.assert_close(img / img.norm(dim=-1, keepdim=True), want.image_embeds, atol=1e-5, rtol=0)
    torch.testing.assert_close(txt / txt.norm(dim=-1, keepdim=True), want.text_embeds, atol=1e-5, rtol=0)
    assert abs(loss.item() - want.loss.item()) < 1e-5
    # the state dict maps back to transformers' names, every one of them
    assert set(ours.family.hf.to_hf(ours.state_dict())) == {k for k in theirs.state_dict() if "position_ids" not in k}


def test_a_siglip_run_exports_to_siglipmodel_and_its_processor(family_runs_of, tmp_path):
    from transformers import SiglipModel, SiglipProcessor

    from mmpipe.cli.main import main
    from mmpipe.data.decode import load_image
    from mmpipe.data.synth import make_image
    import random
    ref = reference(family_runs_of("siglip"))
    out = str(tmp_path / "siglip_hf")
    assert main(["export", "--run", ref, "--out", out]) == 0
    hf, proc = SiglipModel.from_pretrained(out).eval(), SiglipProcessor.from_pretrained(out)
    cfg = mmpipe.load_config(os.path.join(ref, "config.yaml"))
    ours = mmpipe.build_model(cfg).eval()
    ours.load_state_dict(mmpipe.load_weights(ref))
    png = str(tmp_path / "shape.png")
    make_image(random.Random(3), 32)[0].save(png)  # at the tower's size: the resize is the identity
    caption = "a small red circle at the top left"
    enc = proc(text=[caption], images=[Image.open(png)], return_tensors="pt", padding="max_length")
    assert enc["input_ids"].shape[1] == 16  # padded to the tower's length, as training
    with torch.no_grad():
        want_img = ours.encode_image(load_image(png, 32).unsqueeze(0))
        want_txt = ours.encode_text(enc["input_ids"], torch.ones_like(enc["input_ids"]))
        got_img = hf.get_image_features(pixel_values=enc["pixel_values"]).pooler_output
        got_txt = hf.get_text_features(input_ids=enc["input_ids"]).pooler_output
    torch.testing.assert_close(got_img, want_img, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_txt, want_txt, atol=1e-5, rtol=0)
    from mmpipe.data.tokenizer import load_tokenizer
    tok = load_tokenizer(os.path.join(ref, "tokenizer"))
    assert enc["input_ids"][0].tolist() == tok(caption, padding="max_length", max_length=16)["input_ids"]


ONE = ["parallel.pipeline_stages=1", "parallel.micro_batch_size=16"]  # tiny: batch 16


@pytest.mark.parametrize("key,nprocs,launcher,sets", [
    ("sl_p1x4", 1, "python", ["parallel.pipeline_stages=1"]),
    ("sl_dp2", 2, "deepspeed", ["parallel.pipeline_stages=1", "parallel.micro_batch_size=8"]),
    ("sl_p2_frozen_vision", 2, "deepspeed", ["parallel.pipeline_stages=2", "optim.freeze_vision=true"]),
    # ZeRO-3 partitions the loss's scale and bias: the blocked loss gathers them (2 micro-batches per rank)
    ("sl_dp2x2_z3", 2, "deepspeed", ["parallel.pipeline_stages=1", "parallel.zero_stage=3"]),
])
def test_siglip_trains_like_one_micro_batch_of_the_global_batch(family_runs_of, key, nprocs, launcher, sets):
    """P = 1 with 4 micro-batches, DP2 (one pass), DP2 x 2 micro-batches under ZeRO-3 and lock-image
    tuning at P = 2 against one process
    on one micro-batch of 16 (the loss layer in the graph); P = 2, P = 3 and P2 x DP2 against the
    P = 2 reference in test_parity.py; with ``loss_block=5`` the blocked loss runs in these layouts."""
    runs = family_runs_of("siglip")
    frozen = ["optim.freeze_vision=true"] if "frozen" in key else []
    one = runs.get("sl_one" + ("_frozen" if frozen else ""), 1, ONE + frozen, "python", flags=["--stop-at", "4"])[0]
    run = runs.get(key, nprocs, sets + ["model.loss_block=5"], launcher, flags=["--stop-at", "4"])[0]
    assert_same_training(run, one)


def test_the_bench_trains_open_clips_own_siglip_b16_beside_mmpipes(tmp_path):
    """``mmpipe bench gpu``'s SigLIP peer: the open_clip config written from configs/siglip_b16.yaml is
    open_clip's ViT-B-16-SigLIP (timm's SigLIP ViT, its text transformer; the hub tokenizer left out):
    every parameter of the same shape as in open_clip's own, as many as mmpipe's model has; the tiny
    shape, which timm has no SigLIP ViT of, gets open_clip's own ViT at its sizes, and says so."""
    import json
    import math

    import open_clip

    from mmpipe.config.schema import family_of, load_config, replace
    from mmpipe.data.tokenizer import StandInTokenizer
    from mmpipe.parallel.plain import plain_model

    def family_and_peer(path):
        cfg = load_config(path)
        fam = family_of(cfg)
        tok = fam.prepare_tokenizer(StandInTokenizer((cfg.model.text.vocab_size or 300) - len(fam.special_tokens),
                                                     fam.special_tokens))
        family = fam(replace(cfg, model=fam.resolve(cfg.model, tok, cfg.data)).model, 0)
        return family, family.open_clip_peer()

    family, (oc_cfg, flags, towers) = family_and_peer(os.path.join(os.path.dirname(TINY_SIGLIP), "siglip_b16.yaml"))
    assert flags == ["--siglip"] and "timm vit_base_patch16_siglip_224" in towers
    (tmp_path / "mmpipe-siglip-b16.json").write_text(json.dumps(oc_cfg))
    open_clip.add_model_config(str(tmp_path))
    with torch.device("meta"):
        ours = open_clip.create_model("mmpipe-siglip-b16", init_logit_scale=math.log(10), init_logit_bias=-10,
                                      device="meta")
        theirs = open_clip.create_model("ViT-B-16-SigLIP", device="meta")
        mm = plain_model(family)
    shapes = lambda model: {k: tuple(v.shape) for k, v in model.state_dict().items()}  # noqa: E731
    assert shapes(ours) == shapes(theirs)
    # and the settings without parameters (causal mask, pooling, norms), as open_clip's own config file sets them
    from open_clip.model import CLIPTextCfg, CLIPVisionCfg
    ref = open_clip.get_model_config("ViT-B-16-SigLIP")
    tokenizer_keys = {"hf_tokenizer_name", "tokenizer_kwargs"}
    assert CLIPTextCfg(**oc_cfg["text_cfg"]) == CLIPTextCfg(**{k: v for k, v in ref["text_cfg"].items()
                                                                if k not in tokenizer_keys})
    assert CLIPVisionCfg(**oc_cfg["vision_cfg"]) == CLIPVisionCfg(**ref["vision_cfg"])
    assert {k: v for k, v in oc_cfg.items() if not k.endswith("_cfg")} == {
        k: v for k, v in ref.items() if not k.endswith("_cfg")}
    count = lambda model: sum(p.numel() for p in model.parameters())  # noqa: E731
    assert count(ours) == count(mm) == 203_155_970
    _, (tiny_cfg, _, tiny_towers) = family_and_peer(TINY_SIGLIP)
    assert "timm_model_name" not in tiny_cfg["vision_cfg"] and "open_clip's ViT" in tiny_towers
