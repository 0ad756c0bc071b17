"""Sequence packing (``data.packing``) and attention without a dense mask: a packed micro-batch
gives the unpacked samples' token-mean loss and gradients (same label tokens, attention within a
sample, positions restarting per sample); the decoder's mask-free causal path equals the masked one."""
from __future__ import annotations

import pytest
import torch
from helpers import TINY_VLM

import mmpipe


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A length-skewed chat set (one or two turns, some without an image) and the tiny VLM on it."""
    from mmpipe.data.synth import synth_vlm
    from mmpipe.data.tokenizer import train_tokenizer
    from mmpipe.families.chat import add_chat_tokens, chat_texts, read_chat
    d = tmp_path_factory.mktemp("pack")
    info = synth_vlm(str(d), 24, val_fraction=0.05, size=32, seed=7, text_only=0.3, progress=False)
    samples = read_chat(info["train"])
    tok = add_chat_tokens(train_tokenizer(chat_texts(samples), 120, str(d / "tok")))
    cfg = mmpipe.load_config(TINY_VLM, [f"model.llm.vocab_size={len(tok)}", f"model.image_token_id={tok.convert_tokens_to_ids('<image>')}",
                                        "model.llm.max_position_embeddings=128", "data.max_length=96",
                                        "model.llm.arch=llama"])
    return samples, tok, cfg


def _loss_and_grads(model, batches, n_tokens):
    model.zero_grad(set_to_none=True)
    total = 0.0
    for b in batches:
        loss = model(b["pixel_values"], b["input_ids"], b["attention_mask"], b["labels"], torch.tensor(float(n_tokens)))
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
def test_a_packed_batch_trains_as_its_samples_unpacked(chat, attention, monkeypatch):
    """sdpa: the packed rows through the block-diagonal mask; varlen: through their span boundaries (no mask
    is built: ``packed_mask`` would raise)."""
    from mmpipe.config.schema import replace
    from mmpipe.families.chat import PackedChatDataset, masks, plan_packs
    from mmpipe.families.chat.loss import label_tokens
    samples, tok, cfg = chat
    model = mmpipe.build_model(replace(cfg, model__attention=attention))
    if attention == "varlen":
        monkeypatch.setattr(masks, "packed_mask", lambda *a: (_ for _ in ()).throw(AssertionError("a dense mask")))
    fam = model.family
    ds = fam.dataset(samples, tok, cfg.data)
    packed = PackedChatDataset(ds, cfg.data.max_length)
    assert len(packed) < len(ds) / 2  # it packs: fewer than half as many rows
    assert sorted(i for p in packed.packs for i in p) == list(range(len(ds)))  # every sample once, none split
    assert all(sum(ds.lengths[i] for i in p) <= cfg.data.max_length for p in packed.packs)
    collate = fam.collate(tok, cfg.data)
    unpacked = [collate([ds[i], ds[i + 1]]) for i in range(0, len(ds) - 1, 2)] + \
        ([collate([ds[len(ds) - 1]])] if len(ds) % 2 else [])
    rows = [collate([packed[j] for j in range(k, min(k + 2, len(packed)))]) for k in range(0, len(packed), 2)]
    n = sum(label_tokens(b["labels"]) for b in unpacked)
    assert sum(label_tokens(b["labels"]) for b in rows) == n  # exactly the same label tokens
    assert sum(int(b["pixel_values"].shape[0]) for b in rows) == sum(int(b["pixel_values"].shape[0]) for b in unpacked)
    want, gw = _loss_and_grads(model, unpacked, n)
    got, gg = _loss_and_grads(model, rows, n)
    assert abs(got - want) < 1e-5 * abs(want)
    assert gg.keys() == gw.keys()
    for k in gw:
        torch.testing.assert_close(gg[k], gw[k], atol=1e-5, rtol=1e-4, msg=lambda m: f"{k}: {m}")
    # first-fit decreasing never splits a sample and leaves unusable (length 0) ones out
    assert plan_packs([5, 0, 3, 4, 2], 7) == [[0, 4], [2, 3]]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decoder_attention_without_a_dense_mask_is_exact(chat, arch):
    """Right-padded rows run sdpa's causal path with no (B,1,T,T) mask: the real tokens' outputs are
    those of the additive causal+padding mask; left padding still gets the dense mask."""
    from mmpipe.config.fields import thawed_copy
    from mmpipe.config.resolve import build_family
    from mmpipe.families.towers.common import causal_padding_mask
    from mmpipe.families.chat import masks as m
    _, _, cfg = chat
    model_cfg = thawed_copy(cfg.model)
    model_cfg.llm.arch = arch
    block = build_family(model_cfg).build_layer("llm.blocks.0").eval()
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 12, 32, generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 8:], mask[2, 5:] = 0, 0
    assert m.mask_kind(mask) == "causal" and m.attention_inputs(mask, h.dtype)[1] is None
    left = mask.flip(1)
    assert m.mask_kind(left) == "dense"
    base = type(block).__mro__[1]  # transformers' own decoder layer
    pos = torch.arange(12)[None]
    with torch.no_grad():
        for mk in (mask, left):
            fast = block(h, mk)
            ref = base.forward(block, h, attention_mask=causal_padding_mask(mk, h.dtype), position_ids=pos,
                               position_embeddings=block.rotary(h, pos))
            ref = ref[0] if isinstance(ref, tuple) else ref
            keep = mk.bool()
            torch.testing.assert_close(fast[keep], ref[keep], atol=1e-6, rtol=0)


def test_unusable_samples_are_reported_when_packing(chat, tmp_path):
    """A sample that cannot be packed (its image is missing, or nothing of it fits) is reported in the
    bad list of a pack once per epoch, as an unpacked run reports it; the rest train."""
    from mmpipe.families.chat import ChatSample, PackedChatDataset
    samples, tok, cfg = chat
    fam = mmpipe.build_model(cfg).family
    broken = ChatSample((("user", "<image>\nwhat colour?"), ("assistant", "red")), (str(tmp_path / "gone.jpg"),),
                        where="broken.jsonl line 1")
    unfit = ChatSample((("user", "<image>\n" + "what colour " * 60), ("assistant", "red")), (samples[0].images[0]
                       if samples[0].images else str(tmp_path / "x.jpg"),), where="long.jsonl line 1")
    ds = fam.dataset([broken] + list(samples) + [unfit], tok, cfg.data)
    packed = PackedChatDataset(ds, cfg.data.max_length)
    bad = [b for j in range(len(packed)) for b in packed[j]["bad"]]
    where = " ".join(f"{a} {b}" for a, b in bad)
    assert "gone.jpg" in where and "long.jsonl line 1" in where, bad
    assert sum(len(packed[j]["keys"]) for j in range(len(packed))) == len(samples)


def test_packing_with_no_sample_that_fits_names_the_first_ones_reason(chat):
    from mmpipe.errors import DataError
    from mmpipe.families.chat import PackedChatDataset
    samples, tok, cfg = chat
    fam = mmpipe.build_model(cfg).family
    image_first = [s for s in samples if s.images and s.messages[0][1].startswith("<image>")]
    ds = fam.dataset(image_first, tok, mmpipe.load_config(TINY_VLM, ["data.max_length=8"]).data)
    with pytest.raises(DataError, match=rf"to pack \(the first, {image_first[0].where}: .*data.max_length=8"):
        PackedChatDataset(ds, 8)
