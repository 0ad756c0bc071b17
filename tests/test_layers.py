"""Model <-> pipeline layers: the layer steps compute the plain model; towers, padding, pixels,
retrieval metrics."""
from __future__ import annotations

import pytest
import torch
from helpers import TINY

import mmpipe
from mmpipe.config.schema import load_config
from mmpipe.errors import ConfigError


# ---- model and pipeline layers -----------------------------------------------------------------
def _tiny_cfg():
    return load_config(TINY, ["model.text.vocab_size=50", "model.text.eos_token_id=3",
                              "model.text.max_position_embeddings=16"])


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    pix = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8, generator=g)
    ids = torch.randint(5, 50, (4, 16), generator=g)
    mask = torch.ones(4, 16, dtype=torch.int64)
    for i, n in enumerate((5, 9, 16, 3)):
        ids[i, n - 1] = 3
        ids[i, n:] = 0
        mask[i, n:] = 0
    return pix, ids, mask


def test_pipeline_layers_compute_the_plain_model():
    from mmpipe.config.resolve import build_family
    from mmpipe.parallel.layers import PipeLayer, plain_state_key, run_sequential
    cfg = _tiny_cfg()
    model = mmpipe.build_model(cfg)
    family = build_family(cfg)
    layers = [PipeLayer(family, n) for n in family.layer_names()]  # each built alone, like a stage does
    sd = model.state_dict()
    for layer in layers:  # same initial weights, same names
        for k, v in layer.state_dict().items():
            assert torch.equal(v, sd[plain_state_key(layer.name, k)])
    assert sum(len(layer.state_dict()) for layer in layers) == len(sd)
    pix, ids, mask = _batch()
    loss = run_sequential(layers, (pix, ids, mask))
    torch.testing.assert_close(loss, model(pix, ids, mask), rtol=0, atol=0)
    for layer in layers:
        layer.eval()
    with torch.no_grad():
        feats = run_sequential(layers, (pix, ids, mask))
        d = feats.shape[1] // 2
        torch.testing.assert_close(feats[:, :d], model.encode_image(pix))
        torch.testing.assert_close(feats[:, d:], model.encode_text(ids, mask))


def test_padding_does_not_change_text_features():
    model = mmpipe.build_model(_tiny_cfg()).eval()
    _, ids, mask = _batch()
    with torch.no_grad():
        a = model.encode_text(ids, mask)
        ids2 = ids.clone()
        ids2[mask == 0] = 7  # garbage in padded positions must be ignored
        b = model.encode_text(ids2, mask)
    torch.testing.assert_close(a, b)


def test_uint8_pixels_are_normalised_on_device():
    from mmpipe.families.towers.common import (
        OPENAI_CLIP_MEAN,
        OPENAI_CLIP_STD,
        normalize_pixels,
    )
    model = mmpipe.build_model(_tiny_cfg()).eval()
    pix, _, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(model.encode_image(pix), model.encode_image(
            normalize_pixels(pix, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, torch.float32)))


def test_bert_and_resnet_towers_build_and_train_a_step():
    cfg = load_config(None, ["model.vision.arch=resnet", "model.vision.image_size=32", "model.text.arch=bert",
                             "model.text.hidden_size=32", "model.text.num_hidden_layers=1",
                             "model.text.num_attention_heads=2", "model.text.intermediate_size=64",
                             "model.text.vocab_size=50", "model.text.max_position_embeddings=16",
                             "model.projection_dim=16"])
    model = mmpipe.build_model(cfg)
    names = [n for n, _ in model.named_parameters()]
    assert "vision.blocks.3.1.conv2.weight" in names and any(n.startswith("text.blocks.0.attention") for n in names)
    pix, ids, mask = _batch()
    loss = model(pix, ids, mask)
    loss.backward()
    assert torch.isfinite(loss) and model.vision.embed.conv1.weight.grad is not None


def test_bad_tower_config_is_one_line():
    with pytest.raises(ConfigError, match="model.vision: .*attention heads"):
        mmpipe.build_model(load_config(None, ["model.vision.hidden_size=30", "model.vision.num_attention_heads=4",
                                              "model.text.vocab_size=10"]))
    with pytest.raises(ConfigError, match="model.text.pooling=pooler is BERT's pooler .* use eos, cls or mean"):
        mmpipe.build_model(load_config(None, ["model.text.pooling=pooler", "model.text.vocab_size=10"]))


def test_retrieval_metrics():
    from mmpipe.families.clip.retrieval import retrieval_metrics
    x = torch.eye(5)
    m = retrieval_metrics(x, x)
    assert m["i2t_r1"] == 1.0 and m["t2i_r1"] == 1.0 and m["chance_r1"] == 0.2
    m = retrieval_metrics(x, x.roll(1, dims=0))
    assert m["i2t_r1"] == 0.0 and m["i2t_r5"] == 1.0
