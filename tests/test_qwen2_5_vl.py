"""Qwen2.5-VL at native resolution (``model.type: qwen2_5_vl``): transformers' arithmetic, multimodal
rotary positions (packed rows restart per sample in all three sections), cuts inside the ViT and
the decoder, export back to ``Qwen2_5_VLForConditionalGeneration`` answering as ``mmpipe generate``.
Layout parity (P2 x DP2) and resume with ``test_parity``'s checks, here (the family's reference run made
once); on another layout: test_elastic.py."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from helpers import TINY_CONFIGS, train_losses
from PIL import Image
from test_parity import _weights, assert_weights_close, check_layout_parity, check_resume, reference

import mmpipe

TINY_QWEN = TINY_CONFIGS["qwen2_5_vl"]


def _family(attention="sdpa"):
    from mmpipe.config.resolve import build_family
    cfg = mmpipe.load_config(TINY_QWEN, [f"model.attention={attention}"])
    model = cfg.model
    from mmpipe.config.fields import thawed_copy
    model = thawed_copy(model)
    model.llm.vocab_size, model.image_token_id = 120, 119
    return build_family(model, 0), cfg


def _rows(image_id: int, counts: list, text=(5, 6, 7)) -> list:
    """Token rows: each image's run wrapped in vision start (117) / end (118) between text."""
    rows = []
    for row in counts:
        ids = [3, 4]
        for n in row:
            ids += [117] + [image_id] * n + [118] + list(text)
        rows.append(ids)
    return rows


def _grids(sizes) -> torch.Tensor:
    return torch.tensor([[1, h, w] for h, w in sizes], dtype=torch.int64)


def test_rope_positions_are_transformers_and_restart_per_packed_sample():
    from transformers import Qwen2_5_VLModel

    from mmpipe.families.qwen_vl.positions import rope_positions
    fam, _ = _family()
    hf = Qwen2_5_VLModel(fam.hf_cfg)
    grids = _grids([(4, 6), (10, 4), (2, 8)])  # 6, 10, 4 merged tokens: wide, tall, flat
    counts = [int(g.prod()) // 4 for g in grids]
    rows = _rows(119, [counts[:2], counts[2:]])
    T = max(map(len, rows))
    ids, mask = torch.zeros(2, T, dtype=torch.int64), torch.zeros(2, T, dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    ours = rope_positions(ids, grids, mask, 119, 2)
    want, _ = hf.get_rope_index(ids, mm_token_type_ids=(ids == 119).int(), image_grid_thw=grids, attention_mask=mask)
    assert torch.equal(ours[:, mask.bool()], want[:, mask.bool()])
    assert not torch.equal(ours[0], ours[1]) and not torch.equal(ours[1], ours[2])  # three sections, not one line
    # the two rows packed into one: each sample gets exactly its positions alone (all three sections)
    n0, n1 = len(rows[0]), len(rows[1])
    packed = torch.tensor([rows[0] + rows[1]])
    segments = torch.tensor([[1] * n0 + [2] * n1])
    got = rope_positions(packed, grids, segments, 119, 2)
    assert torch.equal(got[:, 0, :n0], ours[:, 0, :n0]) and torch.equal(got[:, 0, n0:], ours[:, 1, :n1])


@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
def test_packed_rows_give_the_unpacked_loss_and_gradients(attention):
    """varlen: the decoder by the packed row's span boundaries, the ViT by its window / image spans whole
    (transformers hands them over for a flash-named implementation)."""
    from mmpipe.families.qwen_vl.positions import rope_positions
    from mmpipe.parallel.plain import plain_model
    fam, _ = _family(attention)
    model = plain_model(fam).train()
    g = torch.Generator().manual_seed(0)
    grids = _grids([(4, 6), (6, 6), (4, 4)])
    pixels = torch.randn(int(grids.prod(1).sum()), 1176, generator=g)
    counts = [int(x.prod()) // 4 for x in grids]
    rows = _rows(119, [counts[:2], counts[2:]])

    def grads(ids, mask, labels):
        model.zero_grad()
        pos = rope_positions(ids, grids, mask, 119, 2)
        loss = model(pixels, grids, ids, mask, pos, labels)
        loss.backward()
        return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}

    T = max(map(len, rows))
    ids, mask = torch.zeros(2, T, dtype=torch.int64), torch.zeros(2, T, dtype=torch.int64)
    labels = torch.full((2, T), -100)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
        labels[i, :len(r)] = torch.tensor([t if t < 117 else -100 for t in r])
    flat = [t for r in rows for t in r]
    pids = torch.tensor([flat])
    seg = torch.tensor([[1] * len(rows[0]) + [2] * len(rows[1])])
    plabels = torch.tensor([[t if t < 117 else -100 for t in flat]])
    plabels[0, len(rows[0])] = -100  # packing hides each sample's first label (nothing predicts across samples)
    a, ga = grads(ids, mask, labels)
    b, gb = grads(pids, seg, plabels)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for k in ga:
        torch.testing.assert_close(gb[k], ga[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")
    assert ga["vision.blocks.0.attn.qkv.weight"].abs().sum() > 0  # the images train


def test_p3_with_cuts_inside_the_vit_and_inside_the_decoder(family_runs_of, tmp_path):
    """Stage 0 ends inside the ViT's blocks, stage 1 inside the decoder: variable patch and token
    counts cross both cuts; losses and weights equal the reference run's."""
    runs = family_runs_of("qwen2_5_vl")
    ref = reference(runs)
    plan = tmp_path / "cuts.json"
    stages = [["vision.embed", "vision.blocks.0", "vision.blocks.1"],
              ["vision.blocks.2", "vision.blocks.3", "merger", "llm.embed", "llm.blocks.0"],
              ["llm.blocks.1", "llm.blocks.2", "llm.head"]]
    plan.write_text(json.dumps({"stages": stages}))
    out, _ = runs.get("p3_cuts", 3, ["parallel.pipeline_stages=3", f"parallel.plan={plan}"], flags=["--stop-at", "4"])
    with open(os.path.join(out, "plan.json")) as fh:
        assert json.load(fh)["stages"] == stages
    np.testing.assert_allclose(train_losses(out), train_losses(ref)[:4], rtol=1e-5)
    assert_weights_close(_weights(out, 4), _weights(ref, 4), rtol=1e-5)


def test_exported_run_answers_through_transformers_as_mmpipe_generate(family_runs_of, tiny_native_chat_data,
                                                                      tmp_path):
    """Export -> ``Qwen2_5_VLForConditionalGeneration`` + ``AutoProcessor``: the processor's prompt
    (``apply_chat_template`` with image items) is training's ids, and greedy ``generate`` gives
    ``mmpipe generate``'s tokens, on held-out images of sizes no training image had."""
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    from mmpipe.cli.generate import Generator
    from mmpipe.data.synth import make_vlm_sample
    from mmpipe.train.export import export
    ref = reference(family_runs_of("qwen2_5_vl"))
    out, _, _ = export(ref, str(tmp_path / "qwen_hf"))
    hf, proc = Qwen2_5_VLForConditionalGeneration.from_pretrained(out).eval(), AutoProcessor.from_pretrained(out)
    g = Generator(ref)
    import random
    for k, size in enumerate([(150, 50), (44, 44), (64, 170)]):
        im, qa = make_vlm_sample(random.Random(k), 48)
        path = str(tmp_path / f"held_out_{k}.png")
        im.resize(size).save(path)
        question = qa[0][0]
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        enc = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        enc = proc(text=enc, images=[Image.open(path).convert("RGB")], return_tensors="pt")
        ids, _ = g.prompt(question, path)
        assert enc["input_ids"].tolist() == ids.tolist()
        with torch.no_grad():
            got = hf.generate(**enc, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
        want = g.generate_ids(question, path, max_new_tokens=8)
        assert got[:len(want)] == want and (len(want) == 8 or want[-1] in g.stop)


@pytest.fixture(scope="module")
def clean_native_chat(tmp_path_factory):
    """Mixed-size chat data without unusable lines (the peft loop reads every row as it is)."""
    from conftest import MIXED_SIZES

    from mmpipe.data.synth import synth_vlm
    d = tmp_path_factory.mktemp("qwen_lora_chat")
    info = synth_vlm(str(d), 60, val_fraction=0.1, seed=3, text_only=0.3, progress=False, sizes=MIXED_SIZES)
    return {"dir": str(d), "train": info["train"], "val": info["val"]}


def test_lora_on_two_stages_equals_a_peft_loop_on_transformers(clean_native_chat, tmp_path_factory):
    """``optim.train_type: lora`` (ms-swift's defaults: all-linear on the decoder, the ViT and merger
    frozen) at P = 2 against ``peft.get_peft_model`` on ``Qwen2_5_VLForConditionalGeneration``: the
    same initial weights and adapters, data, token-mean loss, clipping and AdamW give the same losses
    and adapters."""
    from helpers import Runs
    from test_lora import LORA_SETS, STEPS, peft_reference

    from mmpipe.families.lora import adapter_state
    runs = Runs(tmp_path_factory.mktemp("qwen_lora_runs"), clean_native_chat, TINY_QWEN)
    out, _ = runs.get("lora_p2", 2, LORA_SETS + ["parallel.pipeline_stages=2"], flags=["--stop-at", str(STEPS)])
    ref_losses, at_stop, init, _ = peft_reference(out, clean_native_chat, steps=STEPS)
    np.testing.assert_allclose(train_losses(out), ref_losses, rtol=1e-5, atol=1e-6)
    got = adapter_state(mmpipe.load_weights(out, STEPS))
    assert got.keys() == at_stop.keys() and len(got) == 42  # q k v o gate up down x 3 decoder blocks x (A, B)
    assert all(k.startswith("llm.blocks.") for k in got)
    for k in got:
        torch.testing.assert_close(got[k], at_stop[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
    assert any(not torch.equal(got[k], init[k]) for k in got if ".lora_B." in k)


def test_the_trainer_peers_collator_gives_mmpipes_tokens_and_loss(clean_native_chat, tmp_path):
    """``mmpipe bench peers --family qwen2_5_vl``'s Trainer side: its collator (the directory's processor,
    ``<image>`` marks as image items, assistant-only labels) gives mmpipe's ids and labels, and the
    Trainer's loss (a token mean over the batch; Qwen2.5-VL declines ``num_items_in_batch``) on a padded
    batch of mixed sizes and a text-only sample is mmpipe's."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmpipe.bench.peers_vlm import check_same_tokens
    from mmpipe.bench.trainer_worker import Collate, dummy_vision, encode, token_mean_loss
    from mmpipe.config.registry import get_family
    from mmpipe.config.resolve import resolve_family
    from mmpipe.data.tokenizer import load_tokenizer
    from mmpipe.families.chat import read_chat
    from mmpipe.families.qwen_vl.tiny import write_tiny_qwen2_5_vl
    from mmpipe.parallel.plain import plain_model
    d = write_tiny_qwen2_5_vl(str(tmp_path / "qwen"), seed=2)
    (tmp_path / "run.yaml").write_text(f"model: {{type: qwen2_5_vl, pretrained: {d}}}\n"
                                       "data: {max_length: 256, num_workers: 0, padding: batch, pad_multiple: 1}\n")
    cfg = mmpipe.load_config(str(tmp_path / "run.yaml"))
    train = clean_native_chat["train"]
    rows = [json.loads(line) for line in open(train)]
    assert check_same_tokens(cfg, train, d, list(range(len(rows))), len(rows)) == len(rows)
    pick = [next(i for i, r in enumerate(rows) if not r.get("images"))] + [i for i, r in enumerate(rows) if r.get("images")][:3]
    proc = AutoProcessor.from_pretrained(d)
    batch = Collate(proc.tokenizer.pad_token_id)([encode(proc, rows[i], os.path.dirname(train), 256) for i in pick])
    hf = AutoModelForImageTextToText.from_pretrained(d).eval()
    tok = get_family("qwen2_5_vl").prepare_tokenizer(load_tokenizer(d))
    cfg, fam = resolve_family(cfg, tok)
    ds = fam.dataset([read_chat(train)[i] for i in pick], tok, cfg.data)
    ours = fam.collate(tok, cfg.data)([ds[i] for i in range(len(pick))])
    with torch.no_grad():
        labels = batch.pop("labels")
        theirs = token_mean_loss(hf)(hf(**batch), labels, num_items_in_batch=(labels[:, 1:] != -100).sum())
        want = plain_model(fam).eval()(*[ours[k] for k in fam.inputs], ours["labels"])
        assert dummy_vision(hf) == 0
    torch.testing.assert_close(theirs, want, rtol=0, atol=1e-5)


SIZES = [(60, 40), (100, 130), (200, 90), (48, 180), (150, 150)]  # five sizes: 4 to 16 image tokens each


def test_loss_and_logits_are_transformers_fed_by_its_own_processor(tmp_path):
    """A Qwen2.5-VL directory written offline (random weights, byte-level BPE with Qwen2-VL's special
    tokens and ChatML template, Qwen2-VL's processor with small pixel bounds): mmpipe's encoder and
    collate give the processor's ids, patches and grids, and the model its loss and logits, on a
    batch of multi-image, single-image and text-only samples over five image sizes."""
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    from mmpipe.config.resolve import resolve_family
    from mmpipe.data.tokenizer import load_tokenizer
    from mmpipe.families.chat import read_chat
    from mmpipe.families.qwen_vl.tiny import write_tiny_qwen2_5_vl
    from mmpipe.parallel.plain import plain_model
    d = write_tiny_qwen2_5_vl(str(tmp_path / "qwen"), seed=1)
    rng = np.random.default_rng(0)
    paths = []
    for k, (w, h) in enumerate(SIZES):
        paths.append(str(tmp_path / f"im{k}.png"))
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(paths[-1])
    rows = [(["<image>", "<image>"], "what colour are the shapes?", "red", paths[:2]),
            ([], "what is two plus two?", "four", []),
            (["<image>"], "how many shapes are there?", "three", paths[2:3]),
            (["<image>", "<image>"], "where is the shape?", "at the top left", paths[3:])]
    with open(tmp_path / "chat.jsonl", "w") as fh:
        for marks, q, a, ims in rows:
            fh.write(json.dumps({"messages": [{"role": "user", "content": "".join(marks) + "\n" + q},
                                              {"role": "assistant", "content": a}], "images": ims}) + "\n")
    (tmp_path / "run.yaml").write_text(
        f"model: {{type: qwen2_5_vl, pretrained: {d}}}\n"
        "data: {max_length: 256, min_pixels: 3136, max_pixels: 50176, num_workers: 0}\n")
    cfg = mmpipe.load_config(str(tmp_path / "run.yaml"))
    fam_cls = __import__("mmpipe.config.registry", fromlist=["get_family"]).get_family("qwen2_5_vl")
    tok = fam_cls.prepare_tokenizer(load_tokenizer(d))
    cfg, fam = resolve_family(cfg, tok)
    ds, collate = fam.dataset(read_chat(str(tmp_path / "chat.jsonl")), tok, cfg.data), fam.collate(tok, cfg.data)
    b = collate([ds[i] for i in range(len(rows))])
    assert len({tuple(g.tolist()) for g in b["image_grid_thw"]}) == 5
    # transformers' own path: the processor renders list content and expands each image
    proc = AutoProcessor.from_pretrained(d)
    proc.image_processor.size = {"shortest_edge": 3136, "longest_edge": 50176}
    texts = [proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}] * len(marks) +
                                        [{"type": "text", "text": "\n" + q}]},
                                       {"role": "assistant", "content": [{"type": "text", "text": a}]}])
             for marks, q, a, _ in rows]
    enc = proc(text=texts, images=[Image.open(p).convert("RGB") for p in paths], return_tensors="pt", padding=True)
    mask = b["attention_mask"].bool()
    for i in range(len(rows)):  # the same ids (each side padded its own way)
        theirs = enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist()
        assert b["input_ids"][i][mask[i]].tolist() == theirs
    torch.testing.assert_close(b["pixel_values"], enc["pixel_values"], rtol=0, atol=0)
    assert torch.equal(b["image_grid_thw"], enc["image_grid_thw"])
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(d).eval()
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


@pytest.mark.parametrize("key,nprocs,sets", [
    # checkpointing recomputes each block from its inputs: the grid's derived spans and rotary table
    # are found again on the same tensor
    ("p2_ckpt", 2, ["parallel.pipeline_stages=2", "parallel.activation_checkpointing=all"]),
    # ZeRO-3 over two ranks whose micro-batches differ in images (some none: every rank still runs every
    # vision block, on a zero merge unit, so the parameter gathers match)
    ("dp2_zero3", 2, ["parallel.pipeline_stages=1", "parallel.zero_stage=3"]),
])
def test_checkpointing_and_zero3_train_as_the_reference(family_runs_of, key, nprocs, sets):
    if key == "p2_ckpt" and not os.environ.get("MMPIPE_ALL_LAYOUTS"):
        pytest.skip("by hand with MMPIPE_ALL_LAYOUTS=1 (CI's time; the VLM's pipelined checkpointing runs in "
                    "test_activation_checkpointing.py)")
    runs = family_runs_of("qwen2_5_vl")
    ref = reference(runs)
    out, _ = runs.get(key, nprocs, sets, flags=["--stop-at", "4"])
    np.testing.assert_allclose(train_losses(out), train_losses(ref)[:4], rtol=1e-5)
    assert_weights_close(_weights(out, 4), _weights(ref, 4), rtol=1e-5)


def test_pipeline_times_data_parallel_trains_as_the_reference_and_resumes_exactly(family_runs_of):
    """Every family's P2 x DP2 parity and stop-and-resume (``test_parity``'s checks), here beside the family's
    other layouts so its reference run is made once per CI worker."""
    runs = family_runs_of("qwen2_5_vl")
    check_layout_parity("qwen2_5_vl", runs, "p2dp2", 4, "deepspeed", ["parallel.pipeline_stages=2"], loss_rtol=1e-4)
    check_resume("qwen2_5_vl", runs)
