"""Qwen3-VL (``model.type: qwen3_vl``): transformers' arithmetic with DeepStack (a directory written offline,
fed by its own processor), packed = unpacked, DeepStack's features carried across any pipeline cut (between the
decoder layers they feed too): P = 1, 3 and P2 x DP2 train as the P = 2 reference; export back to
``Qwen3VLForConditionalGeneration``."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from helpers import TINY_CONFIGS, train_losses
from PIL import Image
from qwen_fixtures import resolved_family, write_chat
from qwen_fixtures import loaded_model as _loaded
from qwen_fixtures import write_images as _images
from test_parity import _weights, assert_weights_close, check_layout_parity, reference

import mmpipe

TINY_Q3VL = TINY_CONFIGS["qwen3_vl"]


@pytest.fixture(scope="module")
def q3vl_dir(tmp_path_factory):
    from mmpipe.families.qwen_vl.tiny import write_tiny_qwen3_vl
    return write_tiny_qwen3_vl(str(tmp_path_factory.mktemp("q3vl") / "dir"), seed=1)


def _family(d: str, **data):
    return resolved_family("qwen3_vl", d, **data)


def _chat(tmp_path, rows) -> str:
    return write_chat(tmp_path / "chat.jsonl", rows)


def test_loss_and_logits_are_transformers_fed_by_its_own_processor(q3vl_dir, tmp_path):
    """mmpipe's encoder and collate give the processor's ids, patches and grids (five image sizes, two-image,
    one-image and text-only rows), and the model transformers' loss and logits (within 1e-5), DeepStack's
    features included (without them the logits differ: the comparison sees them)."""
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    from mmpipe.families.chat import read_chat
    paths = _images(tmp_path)
    rows = [(["<image>", "<image>"], "what colour are the shapes?", "red", paths[:2]),
            ([], "what is two plus two?", "four", []),
            (["<image>"], "how many shapes are there?", "three", paths[2:3]),
            (["<image>", "<image>"], "where is the shape?", "at the top left", paths[3:])]
    cfg, fam, tok = _family(q3vl_dir)
    assert [n for n in fam.layer_names() if not n.startswith("llm.blocks")] == [
        "vision.embed", "vision.blocks.0", "deepstack.0", "vision.blocks.1", "deepstack.1", "vision.blocks.2",
        "merger", "llm.embed", "llm.head"]
    ds, collate = fam.dataset(read_chat(_chat(tmp_path, rows)), tok, cfg.data), fam.collate(tok, cfg.data)
    b = collate([ds[i] for i in range(len(rows))])
    assert len({tuple(g.tolist()) for g in b["image_grid_thw"]}) == 5
    proc = AutoProcessor.from_pretrained(q3vl_dir)
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
    hf = Qwen3VLForConditionalGeneration.from_pretrained(q3vl_dir).eval()
    ours = _loaded(fam).eval()
    kw = dict(input_ids=b["input_ids"], attention_mask=b["attention_mask"], pixel_values=b["pixel_values"],
              image_grid_thw=b["image_grid_thw"], mm_token_type_ids=(b["input_ids"] == fam.image_token_id).int(),
              labels=b["labels"])
    with torch.no_grad():
        inputs = [b[k] for k in fam.inputs]
        logits = ours.eval_outputs(*inputs)
        loss = ours(*inputs, b["labels"])
        out = hf(**kw)
        for merger in hf.model.visual.deepstack_merger_list:  # DeepStack off: the logits move
            merger.linear_fc2.weight.zero_(), merger.linear_fc2.bias.zero_()
        flat = hf(**kw)
    torch.testing.assert_close(loss, out.loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[mask], out.logits[mask], rtol=0, atol=1e-5)
    assert (logits[mask] - flat.logits[mask]).abs().max() > 1e-3
    assert (b["labels"] != -100).sum() > 10 and out.loss > 1.0  # a real loss over the answers


def _packed_and_unpacked(q3vl_dir, tmp_path):
    """Six samples (images of five sizes, a text-only one) as six rows, and as two packed rows of three."""
    from mmpipe.families.chat import read_chat
    paths = _images(tmp_path)
    rows = [(["<image>"], "what colour are the shapes?", "red", paths[:1]),
            ([], "what is two plus two?", "four", []),
            (["<image>", "<image>"], "how many shapes are there?", "three and two", paths[1:3]),
            (["<image>"], "where is the shape?", "at the top left", paths[3:4]),
            (["<image>"], "what kind of shape is shown?", "a circle", paths[4:5]),
            ([], "what number comes after one?", "two", [])]
    cfg, fam, tok = _family(q3vl_dir)
    recs = read_chat(_chat(tmp_path, rows))
    ds, collate = fam.dataset(recs, tok, cfg.data), fam.collate(tok, cfg.data)
    single = collate([ds[i] for i in range(6)])
    pcfg, _, _ = _family(q3vl_dir, packing=True, max_length=10**4)
    packs = fam.dataset(recs, tok, pcfg.data)
    packs.packs = [[0, 1, 2], [3, 4, 5]]  # three samples a row
    packed = collate([packs[0], packs[1]])
    assert packed["attention_mask"].max() == 3
    return fam, single, packed


def test_packed_rows_give_the_unpacked_loss_and_every_gradient(q3vl_dir, tmp_path):
    """Rows of three samples each: the loss and every gradient (DeepStack's mergers' too) within 1e-5 of the six
    rows alone (each sample's DeepStack features land on its own image positions, attention stays within it)."""
    fam, single, packed = _packed_and_unpacked(q3vl_dir, tmp_path)
    model = _loaded(fam).train()

    def loss_and_grads(b):
        model.zero_grad()
        loss = model(*[b[k] for k in fam.inputs], b["labels"], torch.tensor(float((b["labels"] != -100).sum())))
        loss.backward()
        return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    a, ga = loss_and_grads(single)
    b, gb = loss_and_grads(packed)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert ga.keys() == gb.keys() and any(k.startswith("deepstack.1.") for k in ga)
    assert ga["deepstack.1.linear_fc2.weight"].abs().max() > 0  # DeepStack's second merger is trained
    for k in ga:
        torch.testing.assert_close(gb[k], ga[k], rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")


def test_deepstack_features_travel_with_the_hidden_states_and_are_priced_at_every_cut():
    """The activation tuple after each layer (the profiler's ``out_tensors``, what a cut sends): the patches gain
    one DeepStack tensor per tap, the merger's features keep them, decoder layer k adds the k-th and drops it; a
    micro-batch without images runs the same tuple (empty features) with every parameter in its backward."""
    from mmpipe.parallel.plain import plain_model
    cfg = mmpipe.load_config(TINY_Q3VL, ["model.llm.vocab_size=120", "model.image_token_id=5"])
    fam = mmpipe.build_model(cfg).family
    model = plain_model(fam)
    b = fam.example_batch(2, 40, torch.device("cpu"))
    floats = {}
    acts = tuple(b[k] for k in fam.inputs)
    for name in fam.layer_names()[:-1]:
        acts = fam.layer(name).step(model.get_submodule(name), acts)
        floats[name] = sum(1 for t in acts if t.is_floating_point())
    assert floats == {"vision.embed": 1, "vision.blocks.0": 1, "deepstack.0": 2, "vision.blocks.1": 2,
                      "deepstack.1": 3, "vision.blocks.2": 3, "merger": 3, "llm.embed": 3, "llm.blocks.0": 2,
                      "llm.blocks.1": 1, "llm.blocks.2": 1, "llm.blocks.3": 1}
    # no image in the micro-batch: empty features, and still a gradient (zero) for every parameter
    text = dict(b, pixel_values=b["pixel_values"][:0], image_grid_thw=b["image_grid_thw"][:0],
                input_ids=torch.where(b["input_ids"] == fam.image_token_id, 0, b["input_ids"]))
    from mmpipe.families.qwen_vl.positions import rope_positions
    text["position_ids"] = rope_positions(text["input_ids"], text["image_grid_thw"], text["attention_mask"],
                                          fam.image_token_id, 2)
    model.zero_grad()
    model(*[text[k] for k in fam.inputs], text["input_ids"]).backward()
    assert all(p.grad is not None for p in model.parameters())


# ---- runs --------------------------------------------------------------------------------------------------
# a cut after DeepStack's first tap inside the ViT (patches and one feature tensor cross it), and a cut between
# the two decoder layers DeepStack feeds (the second tap's features cross it, the first's are already added)
CUTS = [["vision.embed", "vision.blocks.0", "deepstack.0"],
        ["vision.blocks.1", "deepstack.1", "vision.blocks.2", "merger", "llm.embed", "llm.blocks.0"],
        ["llm.blocks.1", "llm.blocks.2", "llm.blocks.3", "llm.head"]]


@pytest.mark.parametrize("key,nprocs,launcher,sets", [
    ("p1", 1, "python", ["parallel.pipeline_stages=1"]),
    ("p3_cuts", 3, "deepspeed", ["parallel.pipeline_stages=3", "parallel.activation_checkpointing=all"]),
])
def test_layouts_train_as_the_reference(family_runs_of, tmp_path, key, nprocs, launcher, sets):
    """P = 1; P = 3 cut inside the ViT after a DeepStack tap and between the decoder layers DeepStack feeds, with
    activation checkpointing: the losses (rtol 1e-5) and weights of the P = 2 reference (the planner's cut)."""
    runs = family_runs_of("qwen3_vl")
    ref = reference(runs)
    if key == "p3_cuts":
        plan = tmp_path / "cuts.json"
        plan.write_text(json.dumps({"stages": CUTS}))
        sets = sets + [f"parallel.plan={plan}"]
    out, _ = runs.get(key, nprocs, sets, launcher, flags=["--stop-at", "4"])
    if key == "p3_cuts":
        with open(os.path.join(out, "plan.json")) as fh:
            assert json.load(fh)["stages"] == CUTS
    np.testing.assert_allclose(train_losses(out), train_losses(ref)[:4], rtol=1e-5)
    assert_weights_close(_weights(out, 4), _weights(ref, 4), rtol=1e-5, atol=1e-6)


def test_pipeline_times_data_parallel_trains_as_the_reference(family_runs_of):
    """P2 x DP2 (``test_parity``'s check): losses, carried metrics and weights of the P = 2 reference."""
    check_layout_parity("qwen3_vl", family_runs_of("qwen3_vl"), "p2dp2", 4, "deepspeed",
                        ["parallel.pipeline_stages=2"], loss_rtol=1e-5)
