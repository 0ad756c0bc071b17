"""The CLIP family in open_clip's format: open_clip's own ``CLIP``, built from the converted config
and state dict, computes mmpipe's features (what ``mmpipe bench peers --family clip`` starts both
systems from)."""
from __future__ import annotations

import os

import pytest
import torch

import mmpipe
from mmpipe.config.resolve import build_family
from mmpipe.families.clip.open_clip_format import open_clip_config, to_open_clip
from mmpipe.parallel.plain import plain_model

SETS = ["model.text.vocab_size=300", "model.text.max_position_embeddings=16", "model.text.eos_token_id=2"]


def _open_clip_model(family, state, tmp_path):
    import json

    import open_clip
    with open(os.path.join(tmp_path, "mmpipe-test-clip.json"), "w") as fh:
        json.dump(open_clip_config(family), fh)
    open_clip.add_model_config(str(tmp_path))
    model = open_clip.create_model("mmpipe-test-clip")
    model.load_state_dict(to_open_clip(family.hf.to_hf(state)), strict=True)
    return model.eval()


def test_open_clip_computes_mmpipes_features(tmp_path):
    from helpers import TINY
    family = build_family(mmpipe.load_config(TINY, SETS).model)
    ours = plain_model(family).eval()
    theirs = _open_clip_model(family, ours.state_dict(), tmp_path)
    g = torch.Generator().manual_seed(0)
    size = family.vision.image_size
    pixels = torch.randint(0, 256, (4, 3, size, size), dtype=torch.uint8, generator=g)
    ids = torch.randint(5, 300, (4, 16), generator=g)
    lengths = [16, 9, 5, 12]
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):  # EOS last, padding (id 0) after it
        ids[i, n - 1], ids[i, n:], mask[i, :n] = 2, 0, 1
    from mmpipe.families.towers.common import normalize_pixels
    with torch.no_grad():
        img = ours.encode_image(pixels)
        txt = ours.encode_text(ids, mask)
        x = normalize_pixels(pixels, family.vision.mean, family.vision.std, torch.float32)
        torch.testing.assert_close(theirs.encode_image(x), img, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(theirs.encode_text(ids), txt, rtol=1e-4, atol=1e-5)
    assert float(theirs.logit_scale.detach()) == pytest.approx(float(ours.logit_scale.detach()))


def test_other_towers_have_no_open_clip_format():
    from helpers import TINY

    from mmpipe.errors import ConfigError
    family = build_family(mmpipe.load_config(TINY, SETS + ["model.text.arch=bert"]).model)
    with pytest.raises(ConfigError, match="CLIP ViT \\+ CLIP text"):
        open_clip_config(family)


def test_the_sigmoid_loss_model_loads_into_open_clips_siglip_clip(tmp_path):
    """``bench peers --family siglip``'s start: CLIP towers with ``model.loss: sigmoid`` load strictly into
    open_clip's ``CLIP`` built as ``--siglip`` builds it (with a ``logit_bias``), and open_clip's model and
    its ``SigLipLoss`` give mmpipe's loss on the same batch."""
    import json

    import open_clip
    from open_clip.loss import SigLipLoss

    from helpers import TINY
    from mmpipe.families.clip.open_clip_format import open_clip_state
    family = build_family(mmpipe.load_config(TINY, SETS + ["model.loss=sigmoid"]).model)
    ours = plain_model(family).eval()
    with torch.no_grad():
        ours.loss.logit_bias.fill_(-2.0)
    with open(os.path.join(tmp_path, "mmpipe-test-siglip.json"), "w") as fh:
        json.dump(open_clip_config(family), fh)
    open_clip.add_model_config(str(tmp_path))
    theirs = open_clip.create_model("mmpipe-test-siglip", init_logit_scale=float(torch.log(torch.tensor(10.0))),
                                    init_logit_bias=-10).eval()
    theirs.load_state_dict(open_clip_state(family, ours.state_dict()), strict=True)
    g = torch.Generator().manual_seed(0)
    size = family.vision.image_size
    pixels = torch.randint(0, 256, (6, 3, size, size), dtype=torch.uint8, generator=g)
    ids = torch.randint(5, 300, (6, 16), generator=g)
    ids[:, -1] = 2
    from mmpipe.families.towers.common import normalize_pixels
    with torch.no_grad():
        want = family.batch_loss(ours.loss, torch.cat([ours.encode_image(pixels), ours.encode_text(ids, torch.ones_like(ids))], -1))
        x = normalize_pixels(pixels, family.vision.mean, family.vision.std, torch.float32)
        img, txt, scale, bias = theirs(x, ids)  # (normalized features, exp(logit_scale), logit_bias)
        got = SigLipLoss()(img, txt, scale, bias)
    assert float(theirs.logit_bias) == -2.0
    assert abs(got.item() - want.item()) < 1e-4
