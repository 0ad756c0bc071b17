"""Dropout drawn per sample (``mmpipe.parallel.sample_rng``): a sample's masks do not depend on the
micro-batch it sits in, its row, its padding or its packing, for hidden states, LoRA inputs, attention
probabilities (SDPA's ``dropout_p``) and a flat tower's patches; an activation checkpoint's recompute
draws alike. The runs that rest on it: test_lora.py (LoRA dropout with ``data.balance: cost``) and
test_global_negatives.py (BERT dropout, one micro-batch vs four)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmpipe.data.sample_keys import image_key, key_fields
from mmpipe.parallel.sample_rng import KeyedDropout, Layout

H = 6


def _run(fn, x, rows, images=(), axis="tokens", base=7):
    keys = key_fields(rows, list(images))
    with KeyedDropout(base, Layout(keys["row_keys"], keys["image_keys"]), axis, "layer"):
        return fn(x)


def _samples():
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(n, H, generator=g) for k, n in ((11, 5), (12, 3), (13, 7), (14, 2))}


def _padded(samples, keys, length):
    x = torch.zeros(len(keys), length, H)
    for r, k in enumerate(keys):
        x[r, :len(samples[k])] = samples[k]
    return x


def test_a_samples_mask_follows_the_sample_across_rows_padding_and_packing():
    drop = nn.Dropout(0.5).train()
    s = _samples()
    a = _run(drop, _padded(s, [11, 12], 5), [[(11, 5)], [(12, 3)]])
    b = _run(drop, _padded(s, [13, 12, 11], 9), [[(13, 7)], [(12, 3)], [(11, 5)]])  # regrouped, longer padding
    packed = torch.cat([s[12], s[11], s[14]])[None]
    c = _run(drop, packed, [[(12, 3), (11, 5), (14, 2)]])  # one packed row
    torch.testing.assert_close(a[0, :5], b[2, :5], rtol=0, atol=0)
    torch.testing.assert_close(a[1, :3], b[1, :3], rtol=0, atol=0)
    torch.testing.assert_close(c[0, 3:8], a[0, :5], rtol=0, atol=0)
    torch.testing.assert_close(c[0, :3], a[1, :3], rtol=0, atol=0)
    assert (a[0, :5] == 0).any() and (a[0, :5] != 0).any()  # it drops, and not everything
    torch.testing.assert_close(b[0, 7:], torch.zeros(2, H))  # padding: left as it is
    # another step (base) or another call draws other masks
    assert not torch.equal(_run(drop, _padded(s, [11], 5), [[(11, 5)]], base=8)[0], a[0])
    assert not torch.equal(_run(lambda x: drop(drop(x)), _padded(s, [11], 5), [[(11, 5)]])[0], a[0] * 2)


def test_attention_dropout_follows_the_sample_and_keeps_the_reference_arithmetic():
    g = torch.Generator().manual_seed(1)
    q1, q2 = torch.randn(2, 4, 3, generator=g), torch.randn(2, 6, 3, generator=g)  # (heads, tokens, dim)

    def attn(q):  # causal self-attention of a padded (rows, heads, T, d) batch, dropout 0.3
        return F.scaled_dot_product_attention(q, q, q, is_causal=True, dropout_p=0.3)

    def batch(parts, T):
        x = torch.zeros(len(parts), 2, T, 3)
        for r, p in enumerate(parts):
            x[r, :, :p.shape[1]] = p
        return x
    a = _run(attn, batch([q1, q2], 6), [[(1, 4)], [(2, 6)]])
    b = _run(attn, batch([q2, q1], 8), [[(2, 6)], [(1, 4)]])
    torch.testing.assert_close(a[0, :, :4], b[1, :, :4], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(a[1], b[0, :, :6], rtol=1e-6, atol=1e-6)
    undropped = F.scaled_dot_product_attention(q1[None], q1[None], q1[None], is_causal=True)
    assert not torch.allclose(a[0, :, :4], undropped[0])
    # dropout 0 through the mode: torch's own result
    torch.testing.assert_close(_run(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True), q1[None],
                                    [[(1, 4)]]), undropped)


def test_a_flat_towers_patches_and_image_rows_draw_per_image():
    g = torch.Generator().manual_seed(2)
    p1, p2 = torch.randn(8, H, generator=g), torch.randn(4, H, generator=g)  # two images' patches
    drop = nn.Dropout(0.5).train()
    k1, k2 = image_key(21, 0), image_key(22, 0)
    a = _run(drop, torch.cat([p1, p2]), [[(21, 1)], [(22, 1)]], [(k1, 8), (k2, 4)], axis="vision")
    b = _run(drop, torch.cat([p2, p1]), [[(22, 1)], [(21, 1)]], [(k2, 4), (k1, 8)], axis="vision")
    torch.testing.assert_close(a[:8], b[4:], rtol=0, atol=0)
    # after a 2 x 2 merger: a quarter of the rows, each image's share
    merged = _run(drop, torch.cat([p1[:2], p2[:1]]), [[(21, 1)], [(22, 1)]], [(k1, 8), (k2, 4)], axis="vision")
    assert merged.shape == (3, H)
    rows = _run(drop, torch.stack([p1, p1]), [[(21, 1)], [(22, 1)]], [(k1, -1), (k2, -1)], axis="vision")
    assert not torch.equal(rows[0], rows[1])  # one row per image, each its own key


def test_an_activation_checkpoints_recompute_draws_the_same_masks():
    from mmpipe.parallel.executor import checkpoint
    from mmpipe.parallel.step_loss import Replay
    lin = nn.Sequential(nn.Linear(H, H), nn.Dropout(0.5), nn.Linear(H, 1)).train()
    x = _samples()[13][None]
    keys = key_fields([[(13, 7)]], [])
    replay = Replay(seed=3)
    replay.start(1)
    step = replay.keyed(lambda m, acts: m(acts[0]), "llm.blocks.0", Layout(keys["row_keys"], keys["image_keys"]),
                        "tokens")
    grads = []
    for ckpt in (False, True):
        lin.zero_grad()
        out = checkpoint(step, lin, (x,)) if ckpt else step(lin, (x,))
        out.sum().backward()
        grads.append([p.grad.clone() for p in lin.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_shape_that_does_not_map_falls_back_to_the_slots_draws_and_says_so(recwarn):
    drop = nn.Dropout(0.5).train()
    torch.manual_seed(5)
    want = drop(torch.ones(3, 4))
    torch.manual_seed(5)
    got = _run(drop, torch.ones(3, 4), [[(1, 4)], [(2, 4)]])  # 3 rows, 2 samples
    torch.testing.assert_close(got, want)
    assert any("does not map to the micro-batch's samples" in str(w.message) for w in recwarn)
