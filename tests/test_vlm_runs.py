"""VLM training runs (multi-process, CPU + gloo), sharing the VLM's runs with test_parity: the
token-mean loss under a different accumulation split, ms-swift's freeze flags at P = 2 with the
vision tower alone (forward-only) on stage 0, and unusable chat lines skipped with one line each."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from helpers import train_losses
from test_parity import assert_weights_close, reference

import mmpipe
from mmpipe.train.checkpoint_weights import load_model_weights


def test_accumulation_split_does_not_change_the_step(family_runs_of):
    """Micro-batch 4 x accumulation 2 and micro-batch 2 x accumulation 4 (the reference) see the
    same global batches: with the loss a mean over all label tokens of the step (not a mean of
    per-micro-batch means) the weights are the same."""
    runs = family_runs_of("vlm")
    ref = reference(runs)
    out, _ = runs.get("p2_mbs4", 2, ["parallel.pipeline_stages=2", "parallel.micro_batch_size=4"],
                      flags=["--stop-at", "4"])
    np.testing.assert_allclose(train_losses(out), train_losses(ref)[:4], rtol=1e-4)
    w = load_model_weights(os.path.join(out, "checkpoints"), "global_step4")
    assert_weights_close(w, load_model_weights(os.path.join(ref, "checkpoints"), "global_step4"))


def test_micro_batch_means_would_differ(family_runs_of, tiny_chat_data):
    """The micro-batches the runs train on (the sampler's, for the reference's 6 steps) hold
    different numbers of label tokens, and some hold no image at all (what makes the layout and
    accumulation tests able to fail)."""
    from mmpipe.config.resolve import build_family
    from mmpipe.data.sampler import MicroBatchSampler
    from mmpipe.data.tokenizer import load_tokenizer
    from mmpipe.families.chat import read_chat
    from mmpipe.families.chat.loss import label_tokens
    ref = reference(family_runs_of("vlm"))
    tok = load_tokenizer(os.path.join(ref, "tokenizer"))
    cfg = mmpipe.load_config(os.path.join(ref, "config.yaml"))
    fam = build_family(cfg.model, 0)
    ds = fam.dataset(read_chat(tiny_chat_data["train"]), tok, cfg.data)
    collate = fam.collate(tok, cfg.data)
    sampler = MicroBatchSampler(len(ds), 2, 4, 1, 0, cfg.train.seed)
    batches = [collate([ds[i] for i in mb]) for step in range(6) for mb in sampler.micro_batches(step)]
    counts = [label_tokens(b["labels"]) for b in batches]
    assert len(set(counts)) > 2, counts
    assert any(b["pixel_values"].shape[0] == 0 for b in batches)
    assert any(b["pixel_values"].shape[0] > 0 for b in batches)


def frozen_run(runs, tmp_path, schedule: str = "auto") -> tuple:
    """P = 2 with the vision tower and projector frozen, cut after the projector by a plan file (no profile):
    ``parallel.schedule`` auto (which takes frozen_first) or another."""
    cfg = mmpipe.load_config(runs.config, ["model.llm.vocab_size=200", "model.image_token_id=199"])
    from mmpipe.config.resolve import build_family
    names = build_family(cfg.model, 0).layer_names()
    vision = [n for n in names if n.startswith("vision.")]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"stages": [vision, names[len(vision):]]}))
    return runs.get("frozen" if schedule == "auto" else f"frozen_{schedule}", 2,
                    ["parallel.pipeline_stages=2", "optim.freeze_vit=true", "optim.freeze_aligner=true",
                     f"parallel.plan={plan}", f"parallel.schedule={schedule}"], flags=["--stop-at", "3"])


def test_freeze_vit_and_aligner_stage0_forward_only(family_runs_of, tmp_path):
    runs = family_runs_of("vlm")
    out, proc = frozen_run(runs, tmp_path)
    vision = [n for n in json.load(open(os.path.join(out, "plan.json")))["layers"] if n.startswith("vision.")]
    log = proc.stdout + proc.stderr
    assert f"stage 0: vision.embed .. {vision[-1]} ({len(vision)} layers, forward-only)" in log
    init = mmpipe.build_model(mmpipe.load_config(os.path.join(out, "config.yaml"))).state_dict()
    sd = load_model_weights(os.path.join(out, "checkpoints"), "global_step3")
    frozen = [k for k in sd if k.startswith(("vision.", "projector."))]
    assert frozen and all(torch.equal(sd[k], init[k]) for k in frozen)
    assert not torch.equal(sd["llm.blocks.0.mlp.up_proj.weight"], init["llm.blocks.0.mlp.up_proj.weight"])
    ckpt = os.path.join(out, "checkpoints", "global_step3")
    stage0 = torch.load(os.path.join(ckpt, "mp_rank_00_model_states.pt"), weights_only=False)["optimizer"]
    stage1 = torch.load(os.path.join(ckpt, "mp_rank_01_model_states.pt"), weights_only=False)["optimizer"]
    assert stage0["state"] == {}  # the frozen vision stage holds no optimizer state
    assert {g["name"] for g in stage1["param_groups"]} == {"llm"}  # nor does the frozen projector


def test_frozen_first_at_p2_trains_bit_for_bit_as_1f1b(family_runs_of, tmp_path):
    """The frozen stage forward only (``parallel.schedule: auto`` takes frozen_first, without a profile: it does
    a subset of 1F1B's work) against 1F1B on the same cut: the same losses and weights, bit for bit (P = 3 and
    P2 x DP2: tests/test_schedule_contract.py)."""
    runs = family_runs_of("vlm")
    first, _ = frozen_run(runs, tmp_path)
    plain, _ = frozen_run(runs, tmp_path, "1f1b")
    plans = [json.load(open(os.path.join(o, "plan.json"))) for o in (first, plain)]
    assert [(p["schedule"], p["frozen_stages"]) for p in plans] == [("frozen_first", 1), ("1f1b", 0)]
    assert train_losses(first) == train_losses(plain) and len(train_losses(first)) == 3
    a = load_model_weights(os.path.join(first, "checkpoints"), "global_step3")
    b = load_model_weights(os.path.join(plain, "checkpoints"), "global_step3")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_unusable_chat_lines_are_skipped_with_one_line_each(family_runs_of, tiny_chat_data):
    """A full epoch (9 steps of 8 > 66 lines) meets every line once."""
    runs = family_runs_of("vlm")
    out, proc = runs.get("p1_epoch", 1, ["parallel.pipeline_stages=1", "train.steps=9"], "python")
    log = proc.stdout + proc.stderr
    warnings = [line for line in log.splitlines() if "skipped bad sample" in line]
    assert any("does_not_exist.jpg" in w for w in warnings)
    assert any("corrupt.jpg" in w for w in warnings)
    n_lines = sum(1 for _ in open(tiny_chat_data["train"]))
    assert any(f"train.jsonl line {n_lines}" in w and "0 image(s)" in w for w in warnings), warnings
    assert len(warnings) == 3
    rec = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in x]
    assert rec[-1]["bad_samples"] == 3


def test_generate_from_a_pipelined_checkpoint_matches_the_plain_model(family_runs_of, tiny_chat_data, capsys):
    """`mmpipe generate` (transformers' generate with the KV cache, on the P = 2 run's checkpoint)
    continues greedily exactly as mmpipe's own plain model does without a cache."""
    from mmpipe.cli.generate import Generator
    from mmpipe.cli.main import main
    from mmpipe.families.chat import IMAGE, read_chat
    ref = reference(family_runs_of("vlm"))
    sample = next(s for s in read_chat(tiny_chat_data["val"]) if s.images)
    question = sample.messages[0][1].replace(IMAGE, "").strip()
    g = Generator(ref)
    got = g.generate_ids(question, sample.images[0], max_new_tokens=6, stop=False)
    model = mmpipe.build_model(mmpipe.load_config(os.path.join(ref, "config.yaml"))).eval()
    model.load_state_dict(mmpipe.load_weights(ref))
    ids, pix = g.prompt(question, sample.images[0])
    pix = pix["pixel_values"]
    want = []
    with torch.no_grad():
        for _ in range(6):
            logits = model.eval_outputs(pix, ids, torch.ones_like(ids))
            nxt = int(logits[0, -1].argmax())
            want.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    assert got == want and len(got) == 6
    assert main(["generate", "--run", ref, "--image", sample.images[0], "--prompt", question]) == 0
    assert capsys.readouterr().out.strip() == g.answer(question, sample.images[0])


def test_generate_and_eval_read_chat_data_as_training_does(family_runs_of, tiny_chat_data, tmp_path):
    """Issue 29: markers that do not match --image are one line (item 16); --eval passes a system
    turn as context and scores the first user turn (item 3), reads LLaVA image names against the
    run's data.image_folder, and skips an image that is missing, naming it, without stopping (item 4)."""
    import shutil

    import yaml

    from mmpipe.cli.generate import Generator, exact_match
    from mmpipe.errors import ConfigError
    from mmpipe.families.chat import read_chat
    ref = reference(family_runs_of("vlm"))
    g = Generator(ref)
    image = next(s for s in read_chat(tiny_chat_data["val"]) if s.images).images[0]
    with pytest.raises(ConfigError, match="2 <image> markers but one --image"):
        g.prompt("<image> <image> what colour?", image)
    with pytest.raises(ConfigError, match="marker.* but no --image"):
        g.prompt("<image>\nwhat colour?", None)
    run = str(tmp_path / "run")  # the run, trained on a LLaVA layout: images named relative to data.image_folder
    shutil.copytree(ref, run)
    with open(os.path.join(run, "config.yaml")) as fh:
        cfg = yaml.safe_load(fh)
    cfg["data"]["image_folder"] = os.path.dirname(image)
    with open(os.path.join(run, "config.yaml"), "w") as fh:
        yaml.safe_dump(cfg, fh)
    conv = [{"from": "system", "value": "answer in one word"}, {"from": "human", "value": "<image>\nwhat colour is it?"},
            {"from": "gpt", "value": "red"}]
    rows = [{"id": "a", "image": os.path.basename(image), "conversations": conv},
            {"id": "b", "image": "missing.jpg", "conversations": conv}]
    (tmp_path / "eval.json").write_text(json.dumps(rows))
    r = exact_match(run, str(tmp_path / "eval.json"), progress=False)
    assert r["n"] == 1 and r["examples"][0]["question"] == "what colour is it?" and r["examples"][0]["want"] == "red"
    assert len(r["skipped"]) == 1 and "(id b)" in r["skipped"][0] and "missing.jpg" in r["skipped"][0]


SIGLIP_TOWER = ["model.vision.arch=siglip_vit", "model.vision_feature_layer=-1",
                "model.vision_feature_select_strategy=full"]


def test_a_siglip_tower_vlm_trains_alike_on_p2_x_dp2_and_exports(family_runs_of, tmp_path):
    """LLaVA with SigLIP's ViT (last layer, every patch): P2 x DP2 trains like one process, and the run
    exports to a LlavaForConditionalGeneration + processor that give its logits on an image prompt
    (16 image tokens: SigLIP has no class token)."""
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from helpers import assert_same_training
    from mmpipe.data.synth import make_image
    from mmpipe.train.export import export
    runs = family_runs_of("vlm")
    one = runs.get("siglip_p1", 1, SIGLIP_TOWER + ["parallel.pipeline_stages=1"], "python",
                   flags=["--stop-at", "4"])[0]
    p2dp2 = runs.get("siglip_p2dp2", 4, SIGLIP_TOWER + ["parallel.pipeline_stages=2", "parallel.zero_stage=1"],
                     flags=["--stop-at", "4"])[0]
    assert_same_training(p2dp2, one)
    out, kind, _ = export(one, str(tmp_path / "llava_siglip"))
    assert kind == "LlavaForConditionalGeneration"
    hf, proc = LlavaForConditionalGeneration.from_pretrained(out).eval(), AutoProcessor.from_pretrained(out)
    assert hf.config.vision_config.model_type == "siglip_vision_model"
    ours = mmpipe.build_model(mmpipe.load_config(os.path.join(one, "config.yaml"))).eval()
    ours.load_state_dict(mmpipe.load_weights(one))
    png = str(tmp_path / "shape.png")
    import random
    make_image(random.Random(3), 32)[0].save(png)
    text = proc.apply_chat_template([{"role": "user", "content": "<image>\nwhat colour are the shapes?"}],
                                    add_generation_prompt=True)
    enc = proc(text=text, images=Image.open(png), return_tensors="pt")
    assert int((enc["input_ids"] == ours.family.image_token_id).sum()) == ours.family.n_image_tokens() == 16
    with torch.no_grad():
        got = hf(**enc).logits
        want = ours.eval_outputs(enc["pixel_values"], enc["input_ids"], enc["attention_mask"])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
