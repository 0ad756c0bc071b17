"""Qwen3.5 (``model.type: qwen3_5``): transformers' arithmetic (a directory written offline, fed by its own
processor), packed rows whose samples never share a GatedDeltaNet's conv window or recurrent state (and a test
that sees the leak when they do), cuts inside the ViT and between linear-attention layers, LoRA against peft,
export back to ``Qwen3_5ForConditionalGeneration`` answering as ``mmpipe generate``. Layout parity (P2 x DP2)
and resume with ``test_parity``'s checks, here (the family's reference run made once)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from helpers import TINY_CONFIGS, train_losses
from PIL import Image
from qwen_fixtures import check_generates_as_mmpipe, resolved_family, write_chat
from qwen_fixtures import write_images as _images
from test_parity import _weights, assert_weights_close, check_layout_parity, check_resume, reference

import mmpipe

TINY_Q35 = TINY_CONFIGS["qwen3_5"]


@pytest.fixture(scope="module")
def q35_dir(tmp_path_factory):
    from mmpipe.families.qwen_vl.tiny import write_tiny_qwen3_5
    return write_tiny_qwen3_5(str(tmp_path_factory.mktemp("q35") / "dir"), seed=1)


def _family(d: str, attention: str = "sdpa", **data):
    return resolved_family("qwen3_5", d, attention=attention, **data)


def _chat(tmp_path, rows) -> str:
    return write_chat(tmp_path / "chat.jsonl", rows)


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


def _packed_and_unpacked(q35_dir, tmp_path, attention="sdpa"):
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
    if attention != "sdpa":  # the model's attention (the rows are the same)
        fam = _family(q35_dir, attention)[1]
    return fam, single, packed


def _loss_and_grads(model, fam, b):
    model.zero_grad()
    loss = model(*[b[k] for k in fam.inputs], b["labels"], torch.tensor(float((b["labels"] != -100).sum())))
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
def test_packed_rows_give_the_unpacked_loss_and_every_gradient(q35_dir, tmp_path, attention):
    """Rows of three samples each: the loss and every gradient within 1e-5 of the six rows alone (each
    GatedDeltaNet's conv and recurrence restart at each sample, full attention stays within it: through the
    block-diagonal mask, or by span boundaries with ``model.attention: varlen``)."""
    from mmpipe.parallel.plain import plain_model
    fam, single, packed = _packed_and_unpacked(q35_dir, tmp_path, attention)
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
    a, ga = _loss_and_grads(model, fam, single)
    b, gb = _loss_and_grads(model, fam, packed)
    assert not torch.allclose(b, a, rtol=1e-5, atol=1e-6), (a, b)  # the tolerance above sees the leak
    worst = max(((gb[k] - ga[k]).abs().max() / ga[k].abs().max()).item() for k in ga if ".linear_attn." in k)
    assert worst > 1e-2, worst


def test_the_trainer_peers_collator_gives_mmpipes_tokens_and_loss(q35_dir, tmp_path):
    """``mmpipe bench peers --family qwen3_5``'s Trainer side: its collator (the directory's Qwen3VLProcessor,
    ``<image>`` marks as image items, assistant-only labels) gives mmpipe's ids and labels, and the Trainer's
    loss on a padded batch of mixed sizes and a text-only sample is mmpipe's; a text-only micro-batch sends
    ms-swift's zero image through the ViT (every rank's backward reaches the same parameters)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmpipe.bench.peers_vlm import check_same_tokens
    from mmpipe.bench.trainer_worker import Collate, dummy_vision, encode, token_mean_loss
    from mmpipe.families.chat import read_chat
    from mmpipe.parallel.plain import plain_model
    paths = _images(tmp_path)
    train = _chat(tmp_path, [(["<image>"], "what colour are the shapes?", "red", paths[:1]),
                             ([], "what is two plus two?", "four", []),
                             (["<image>", "<image>"], "how many shapes are there?", "three and two", paths[1:3]),
                             (["<image>"], "where is the shape?", "at the top left", paths[3:4])])
    cfg, fam, tok = _family(q35_dir, padding="batch", pad_multiple=1)
    rows = [json.loads(line) for line in open(train)]
    assert check_same_tokens(cfg, train, q35_dir, list(range(len(rows))), len(rows)) == len(rows)
    proc = AutoProcessor.from_pretrained(q35_dir)
    batch = Collate(proc.tokenizer.pad_token_id)([encode(proc, r, os.path.dirname(train), 256) for r in rows])
    hf = AutoModelForImageTextToText.from_pretrained(q35_dir).eval()
    ds = fam.dataset(read_chat(train), tok, cfg.data)
    ours = fam.collate(tok, cfg.data)([ds[i] for i in range(len(rows))])
    model = plain_model(fam).eval()
    for name in fam.layer_names():
        fam.load_pretrained(model.get_submodule(name), name)
    with torch.no_grad():
        labels = batch.pop("labels")
        loss = token_mean_loss(hf)
        out = hf(**batch)
        theirs = loss(out, labels, num_items_in_batch=(labels[:, 1:] != -100).sum()) if loss else \
            hf(**batch, labels=labels).loss
        want = model(*[ours[k] for k in fam.inputs], ours["labels"])
        assert dummy_vision(hf) == 0
    torch.testing.assert_close(theirs, want, rtol=0, atol=1e-5)


# ---- runs --------------------------------------------------------------------------------------------------
CUTS = [["vision.embed", "vision.blocks.0"],  # a cut inside the ViT ...
        ["vision.blocks.1", "merger", "llm.embed", "llm.blocks.0"],  # ... and between two linear-attention blocks
        ["llm.blocks.1", "llm.blocks.2", "llm.blocks.3", "llm.head"]]


@pytest.mark.parametrize("key,nprocs,launcher,sets", [
    ("p1", 1, "python", ["parallel.pipeline_stages=1"]),
    # every block recomputed from its input in backward (activation checkpointing)
    ("p3_cuts", 3, "deepspeed", ["parallel.pipeline_stages=3", "parallel.activation_checkpointing=all"]),
    # ZeRO-3 over two ranks whose micro-batches differ in images, each step's samples regrouped among the
    # ranks (data.balance: cost); ZeRO-3 with checkpointing is refused (tests/test_errors.py)
    ("dp2_z3_cost", 2, "deepspeed", ["parallel.pipeline_stages=1", "parallel.zero_stage=3", "data.balance=cost"]),
])
def test_layouts_train_as_the_reference(family_runs_of, tmp_path, key, nprocs, launcher, sets):
    """P = 1; P = 3 cut inside the ViT and between linear-attention blocks (patches, tokens and segment ids
    cross both cuts) with activation checkpointing; DP2 with ZeRO-3 and cost-balanced micro-batches: the losses
    (rtol 1e-5) and weights of the P = 2 reference; P2 x DP2 and the resume below."""
    runs = family_runs_of("qwen3_5")
    ref = reference(runs)
    if key == "p3_cuts":
        plan = tmp_path / "cuts.json"
        plan.write_text(json.dumps({"stages": CUTS}))
        sets = sets + [f"parallel.plan={plan}"]
    out, _ = runs.get(key, nprocs, sets, launcher, flags=["--stop-at", "4"])
    if key == "p3_cuts":
        with open(os.path.join(out, "plan.json")) as fh:
            assert json.load(fh)["stages"] == CUTS
        fam = mmpipe.build_model(mmpipe.load_config(os.path.join(out, "config.yaml"))).family
        assert [fam.layer_kind(n) for n in ("llm.blocks.0", "llm.blocks.1", "llm.blocks.3")] == \
            ["linear_attention", "linear_attention", "full_attention"]
    np.testing.assert_allclose(train_losses(out), train_losses(ref)[:4], rtol=1e-5)
    # regrouped samples sum their gradients in another order: Adam's first steps lift that float noise
    # on a rarely-seen embedding row to a few 1e-6 (measured 3.9e-6 on one element of 3296)
    assert_weights_close(_weights(out, 4), _weights(ref, 4), rtol=1e-5, atol=1e-5 if key == "dp2_z3_cost" else 1e-6)


# two stages cut between two linear-attention blocks: a packed row's segment ids cross the cut with its hidden states
PACKED_CUTS = [["vision.embed", "vision.blocks.0", "vision.blocks.1", "merger", "llm.embed", "llm.blocks.0"],
               ["llm.blocks.1", "llm.blocks.2", "llm.blocks.3", "llm.head"]]


def test_packed_rows_train_alike_on_one_process_and_on_two_stages(family_runs_of, tmp_path):
    """Rows packing three or more samples each: P = 2, cut between linear-attention blocks, trains the losses
    (rtol 1e-5) and weights of P = 1 (with packed = unpacked in process, above: packed = unpacked at P = 2 too);
    and in bf16 (its rounding: losses within 1e-3, weights within a bf16 step) P = 2 trains as P = 1."""
    runs = family_runs_of("qwen3_5")
    plan = tmp_path / "cut.json"
    plan.write_text(json.dumps({"stages": PACKED_CUTS}))
    packed = ["data.packing=true", "data.max_length=128", "train.batch_size=4", "data.log_samples=true"]
    one, _ = runs.get("packed_p1", 1, ["parallel.pipeline_stages=1"] + packed, "python", flags=["--stop-at", "3"])
    two, _ = runs.get("packed_p2", 2, ["parallel.pipeline_stages=2", f"parallel.plan={plan}"] + packed,
                      flags=["--stop-at", "3"])
    mbs = [json.loads(line) for line in open(os.path.join(two, "samples", "rank0.jsonl"))]
    assert mbs and sum(len(m["keys"]) for m in mbs) >= 3 * 2 * len(mbs), [len(m["keys"]) for m in mbs]  # 2 rows each
    np.testing.assert_allclose(train_losses(two), train_losses(one), rtol=1e-5)
    # (atol 2e-6: one recurrent projection's element of ~0.01 lands 1.3e-6 apart on some CPUs, at the base commit too)
    assert_weights_close(_weights(two, 3), _weights(one, 3), rtol=1e-5, atol=2e-6)
    bf16 = ["train.precision=bf16"]
    one, _ = runs.get("bf16_p1", 1, ["parallel.pipeline_stages=1"] + bf16, "python", flags=["--stop-at", "3"])
    two, _ = runs.get("bf16_p2", 2, ["parallel.pipeline_stages=2", f"parallel.plan={plan}"] + bf16,
                      flags=["--stop-at", "3"])
    np.testing.assert_allclose(train_losses(two), train_losses(one), rtol=1e-3)  # (measured 5e-5)
    assert_weights_close(_weights(two, 3), _weights(one, 3), rtol=1e-2, atol=4e-3)  # (one bf16 step: 2e-3 measured)


def test_pipeline_times_data_parallel_trains_as_the_reference_and_resumes_exactly(family_runs_of):
    """Every family's P2 x DP2 parity and stop-and-resume (``test_parity``'s checks), here beside the family's
    other layouts so its reference run is made once per CI worker."""
    runs = family_runs_of("qwen3_5")
    check_layout_parity("qwen3_5", runs, "p2dp2", 4, "deepspeed", ["parallel.pipeline_stages=2"], loss_rtol=1e-5)
    check_resume("qwen3_5", runs)


def test_resume_from_the_pipeline_onto_one_process_is_exact(family_runs_of, tmp_path):
    """The P = 2 reference's step-4 checkpoint continued at P = 1 (``test_elastic``'s check): steps 5-6 equal."""
    from test_elastic import check_resume_on_another_layout
    check_resume_on_another_layout(family_runs_of("qwen3_5"), tmp_path, "el_p1", 1, "python",
                                   ["parallel.pipeline_stages=1"])


def test_exported_run_answers_through_transformers_as_mmpipe_generate(family_runs_of, q35_dir, tmp_path):
    """A run from the offline directory (its byte-level BPE tokenizer: AutoTokenizer gives a ``qwen3_5`` directory
    ``Qwen3_5Tokenizer`` whatever it saved) exported -> ``Qwen3_5ForConditionalGeneration`` + ``AutoProcessor``
    (``Qwen3VLProcessor``): the processor's prompt is training's ids, and greedy ``generate`` (its cache: the
    GatedDeltaNet conv and recurrent states, the full-attention keys and values) gives ``mmpipe generate``'s
    tokens, on held-out images of sizes no training image had."""
    from transformers import AutoProcessor, Qwen3_5ForConditionalGeneration

    from mmpipe.train.export import export
    runs = family_runs_of("qwen3_5")
    ref, _ = runs.get("p1_pretrained", 1, ["parallel.pipeline_stages=1", f"model.pretrained={q35_dir}",
                                           "model.llm.max_position_embeddings=null", "train.steps=2"], "python")
    out, _, _ = export(ref, str(tmp_path / "q35_hf"))
    hf, proc = Qwen3_5ForConditionalGeneration.from_pretrained(out).eval(), AutoProcessor.from_pretrained(out)
    assert type(proc).__name__ == "Qwen3VLProcessor"
    check_generates_as_mmpipe(hf, proc, ref, tmp_path, [(150, 50), (44, 44), (64, 170)])


def test_lora_equals_a_peft_loop_on_transformers(family_runs_of):
    """``optim.train_type: lora`` (all-linear on the decoder, as ms-swift's: in a linear-attention block
    ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` and ``out_proj``; in a full-attention block
    q, k, v, o; the MLPs) against ``peft.get_peft_model`` on ``Qwen3_5ForConditionalGeneration``: the same
    initial weights and adapters, data, token-mean loss, clipping and AdamW give the same losses and adapters."""
    from test_lora import LORA_SETS, STEPS, peft_reference

    from mmpipe.families.lora import adapter_state
    runs = family_runs_of("qwen3_5")
    out, _ = runs.get("lora_p1", 1, LORA_SETS + ["parallel.pipeline_stages=1"], "python", flags=["--stop-at", str(STEPS)])
    ref_losses, at_stop, init, _ = peft_reference(out, runs.data, steps=STEPS)
    np.testing.assert_allclose(train_losses(out), ref_losses, rtol=1e-5, atol=1e-6)
    got = adapter_state(mmpipe.load_weights(out, STEPS))
    adapted = {k.split(".lora_")[0].rsplit(".", 1)[1] for k in got}
    assert adapted == {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "k_proj",
                       "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, adapted
    for k in got:
        torch.testing.assert_close(got[k], at_stop[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
    assert any(not torch.equal(got[k], init[k]) for k in got if ".lora_B." in k)


def test_a_packed_config_is_sized_on_the_meta_device():
    """The memory plan of a packed Qwen3.5 run (``mmpipe plan``, ``bench gpu``'s prediction) profiles on the meta
    device, where a packed row has no segment values to split by: the linear-attention layers run it whole (the
    same shapes) instead of failing ("Cannot copy out of meta tensor")."""
    from mmpipe.config.groups import frozen_layout, resolve_groups
    from mmpipe.planning.measure import meta_profile
    from mmpipe.planning.offline import resolve_for_plan
    cfg = mmpipe.load_config(TINY_Q35, ["data.packing=true"])
    rcfg, family = resolve_for_plan(cfg)
    _, frozen, forward_only = frozen_layout(family, resolve_groups(rcfg.optim, type(family)))
    prof = meta_profile(rcfg, family, 2, forward_only, frozen)
    assert [la["name"] for la in prof["layers"]] == family.layer_names()
    assert all(la["act_bytes"] > 0 for la in prof["layers"] if la["name"].startswith("llm.blocks."))
