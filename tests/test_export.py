"""`mmpipe export`: a pipelined run's checkpoint as a transformers directory, loaded back with
transformers' own classes and processors, gives mmpipe's outputs (fp32, within 1e-5)."""
from __future__ import annotations

import os

import pytest
import torch
from PIL import Image
from test_parity import reference

import mmpipe
from mmpipe.data.pixels import SquarePixels


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

    from mmpipe.cli.main import main
    from mmpipe.data.decode import load_image
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

    from mmpipe.train.export import export
    ref = reference(family_runs_of("vlm"))
    out, kind, _ = export(ref, str(tmp_path / "llava_hf"))
    assert kind == "LlavaForConditionalGeneration"
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

    from mmpipe.cli.main import main
    ref = reference(runs)
    out = str(tmp_path / "bf16")
    assert main(["export", "--run", ref, "--out", out, "--dtype", "bf16", "--step", "4"]) == 0
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as fh:
        assert all(fh.get_tensor(k).dtype == torch.bfloat16 for k in fh.keys())
    capsys.readouterr()
    import shutil
    empty = tmp_path / "no_checkpoints"
    empty.mkdir()
    shutil.copy(os.path.join(ref, "config.yaml"), empty / "config.yaml")
    for args, expect in ((["--run", str(tmp_path / "nothing")], "no config.yaml"),
                         (["--run", ref, "--step", "5"], "no checkpoint for step 5"),
                         (["--run", str(empty)], f"{empty}: not a run directory")):
        assert main(["export", *args, "--out", str(tmp_path / "x")]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expect in err[0], err


BERT_TOWER = ["model.text.arch=bert", "model.text.hidden_size=32", "model.text.num_hidden_layers=2",
              "model.text.num_attention_heads=2", "model.text.intermediate_size=64"]


def test_clip_vit_bert_run_exports_to_vision_text_dual_encoder(runs, tmp_path):
    """CLIP ViT + BERT pooled by its pooler, trained at P=2 -> VisionTextDualEncoderModel + its
    processor; transformers' image/text embeddings equal mmpipe's on a real image and caption."""
    from transformers import VisionTextDualEncoderModel, VisionTextDualEncoderProcessor

    from mmpipe.cli.main import main
    from mmpipe.data.decode import load_image
    run, _ = runs.get("bert_pooler_p2", 2, ["parallel.pipeline_stages=2", "model.text.pooling=pooler", *BERT_TOWER])
    out = str(tmp_path / "vtde")
    assert main(["export", "--run", run, "--out", out]) == 0
    hf = VisionTextDualEncoderModel.from_pretrained(out).eval()
    proc = VisionTextDualEncoderProcessor.from_pretrained(out)
    cfg = mmpipe.load_config(os.path.join(run, "config.yaml"))
    ours = mmpipe.build_model(cfg).eval()
    ours.load_state_dict(mmpipe.load_weights(run))
    assert not torch.equal(ours.state_dict()["text.head.pooler.dense.weight"],
                           mmpipe.build_model(cfg).state_dict()["text.head.pooler.dense.weight"])  # it trained
    png, caption = _png(tmp_path, 32), "a small red circle at the top left"
    enc = proc(text=[caption, "two blue squares"], images=[Image.open(png)], return_tensors="pt", padding=True)
    with torch.no_grad():
        want_img = ours.encode_image(load_image(png, 32).unsqueeze(0))
        want_txt = ours.encode_text(enc["input_ids"], enc["attention_mask"])
        got_img = hf.get_image_features(pixel_values=enc["pixel_values"]).pooler_output
        got_txt = hf.get_text_features(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).pooler_output
    assert enc["attention_mask"][1].sum() < enc["attention_mask"][0].sum()  # padding is exercised
    torch.testing.assert_close(got_img, want_img, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_txt, want_txt, atol=1e-5, rtol=0)


def test_resnet_run_exports_in_mmpipe_format(runs, tiny_data, tmp_path, capsys):
    """A ResNet image tower has no transformers dual encoder: ``auto`` writes mmpipe's format (the
    pretrained BERT directory's config travels, its weights do not) and ``mmpipe.build_model(out)``
    is the trained model; ``--format hf`` says why not in one line."""
    import shutil

    from transformers import BertConfig, BertModel

    from mmpipe.cli.main import main
    bert_dir = str(tmp_path / "bert")
    torch.manual_seed(0)
    BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                         vocab_size=320, max_position_embeddings=16), add_pooling_layer=False).save_pretrained(bert_dir)
    from mmpipe.data.manifest import read_manifest
    from mmpipe.data.tokenizer import train_tokenizer
    train_tokenizer([r.text for r in read_manifest(tiny_data["train"])], 300, bert_dir)  # "its" tokenizer
    unset = [f"model.vision.{f}=null" for f in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                 "intermediate_size", "patch_size")]
    run, _ = runs.get("resnet_bert_p1", 1, ["parallel.pipeline_stages=1", "model.vision.arch=resnet", *unset,
                                             "model.text.arch=bert", f"model.text.pretrained={bert_dir}"],
                      launcher="python")
    out = str(tmp_path / "own")
    capsys.readouterr()
    assert main(["export", "--run", run, "--out", out]) == 0
    said = capsys.readouterr().out
    assert "in mmpipe's format" in said and "no dual encoder with a resnet image tower" in said, said
    assert main(["export", "--run", run, "--out", str(tmp_path / "x"), "--format", "hf"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--format hf: transformers has no dual encoder with a resnet" in err[0], err
    ours = mmpipe.build_model(mmpipe.load_config(os.path.join(run, "config.yaml"))).eval()
    ours.load_state_dict(mmpipe.load_weights(run))
    shutil.rmtree(bert_dir)  # the export stands alone
    got = mmpipe.build_model(out).eval()
    assert got.state_dict().keys() == ours.state_dict().keys()
    assert all(torch.equal(got.state_dict()[k], v) for k, v in ours.state_dict().items())
    pix = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    ids = torch.randint(5, 300, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(got.encode_image(pix), ours.encode_image(pix), atol=0, rtol=0)
        torch.testing.assert_close(got.encode_text(ids, torch.ones_like(ids)),
                                   ours.encode_text(ids, torch.ones_like(ids)), atol=0, rtol=0)


def test_damaged_or_incomplete_checkpoints_are_one_line_in_every_reader(family_runs_of, tmp_path, capsys):
    """A truncated weight file: one line from ``mmpipe export``, ``mmpipe generate`` and
    ``mmpipe.load_weights`` (as from ``--resume``); ``export --step N`` of a checkpoint the run
    never completed (newer than ``latest``, no COMPLETE marker) is refused, not exported."""
    import shutil

    from mmpipe.cli.main import main
    ref = reference(family_runs_of("vlm"))
    run = str(tmp_path / "damaged")
    shutil.copytree(ref, run)
    step6 = os.path.join(run, "checkpoints", "global_step6")
    for f in os.listdir(step6):
        if f.startswith("layer_") or f.startswith("mp_rank_"):
            open(os.path.join(step6, f), "r+b").truncate(100)
    capsys.readouterr()
    image = _png(tmp_path, 32)
    for argv in (["export", "--run", run, "--out", str(tmp_path / "x")],
                 ["generate", "--run", run, "--image", image, "--prompt", "<image>\nwhat colour are the shapes?"]):
        assert main(argv) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "cannot read" in err[0] and "global_step6" in err[0], err
    with pytest.raises(mmpipe.MmpipeError, match="cannot read .*global_step6"):
        mmpipe.load_weights(run)
    assert set(mmpipe.load_weights(run, step=4)) == set(mmpipe.load_weights(ref))  # an earlier step still reads
    with open(os.path.join(run, "checkpoints", "latest"), "w") as fh:  # step 6 as a save cut short
        fh.write("global_step4")
    os.remove(os.path.join(step6, "COMPLETE"))
    assert main(["export", "--run", run, "--out", str(tmp_path / "y"), "--step", "6"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "global_step6 is incomplete" in err[0], err
    assert not os.path.exists(tmp_path / "y")


def test_build_model_takes_a_run_directory_or_says_what_it_expects(runs, tmp_path):
    ref = reference(runs)
    model = mmpipe.build_model(ref)  # the run's resolved config and its latest weights
    want = mmpipe.load_weights(ref)
    got = model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(mmpipe.ConfigError, match=r"not a run config \(.yaml\), a run directory"):
        mmpipe.build_model(str(tmp_path))


def test_a_tied_vlm_trained_at_p1_exports_in_mmpipe_format_whole(family_runs_of, tiny_chat_data, tmp_path, capsys):
    """Issue 29, item 14: at P = 1 the tied head and embedding are one tensor, which safetensors
    refuses to save twice; the export used to die leaving a directory with only its config. Now the
    export is whole (written beside, renamed when complete), loads back with the same weights, and
    a directory that is not an export is refused in one line, untouched."""
    from mmpipe.cli.main import main
    from mmpipe.train.export import export
    run = family_runs_of("vlm").get("p1", 1, ["parallel.pipeline_stages=1"], "python", flags=["--stop-at", "4"])[0]
    out, kind, _ = export(run, str(tmp_path / "own"), fmt="mmpipe")
    assert kind == "mmpipe" and sorted(os.listdir(tmp_path)) == ["own"]  # no partial directory left
    model = mmpipe.build_model(out)
    want = mmpipe.load_weights(run)
    got = model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert got["llm.head.lm_head.weight"].data_ptr() == got["llm.embed.embed_tokens.weight"].data_ptr()
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    assert main(["export", "--run", run, "--out", str(keep), "--format", "mmpipe"]) == 2
    assert "is not an earlier mmpipe export" in capsys.readouterr().err and os.listdir(keep) == ["notes.txt"]
    out2, _, _ = export(run, out, fmt="mmpipe")  # an earlier export is replaced whole
    assert out2 == out and sorted(os.listdir(tmp_path)) == ["mine", "own"]


def test_the_exported_vlm_answers_through_transformers_as_mmpipe_generate_does(family_runs_of, tiny_chat_data,
                                                                               tmp_path):
    """Issue 29, items 1 and 9: transformers' standard message form renders as training did (list
    content, no Python list in the prompt), the processor adds no [CLS]/[SEP], and `generate` with
    the exported defaults stops where training's turns end - the same tokens as `mmpipe generate`."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from mmpipe.cli.generate import Generator
    from mmpipe.families.chat import IMAGE, read_chat
    from mmpipe.train.export import export
    ref = reference(family_runs_of("vlm"))
    out, _, _ = export(ref, str(tmp_path / "llava_hf"))
    hf, proc = LlavaForConditionalGeneration.from_pretrained(out).eval(), AutoProcessor.from_pretrained(out)
    sample = next(s for s in read_chat(tiny_chat_data["val"]) if s.images)
    question = sample.messages[0][1].replace(IMAGE, "").strip()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True)
    assert text == f"<|user|>\n<image>\n{question}<|end|>\n<|assistant|>\n"
    enc = proc(text=text, images=Image.open(sample.images[0]).convert("RGB"), return_tensors="pt")
    g = Generator(ref)
    ids, _ = g.prompt(question, sample.images[0])
    assert enc["input_ids"].tolist() == ids.tolist()  # nothing added around the prompt
    end = g.tok.convert_tokens_to_ids("<|end|>")
    assert end in ([hf.generation_config.eos_token_id] if isinstance(hf.generation_config.eos_token_id, int)
                   else hf.generation_config.eos_token_id)
    with torch.no_grad():
        got = hf.generate(**enc, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    want = g.generate_ids(question, sample.images[0], max_new_tokens=12)
    assert got[:len(want)] == want and (len(want) == 12 or want[-1] in g.stop)


def test_the_exported_processor_gives_training_pixels_on_a_photo(tmp_path):
    """Issue 29, item 6: on a 640x480 JPEG (and an odd portrait PNG) the exported image processor,
    given the image as a user opens it, gives exactly the pixels a VLM run trains on: a full decode,
    the shortest edge resized with antialiased bilinear, then the centre crop."""
    import random

    from transformers import AutoImageProcessor

    from mmpipe.data.synth import make_vlm_sample
    from mmpipe.families.towers.common import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, normalize_pixels
    from mmpipe.families.towers.hf import image_processor
    from mmpipe.families.chat import ChatDataset, ChatEncoder, ChatSample
    im, _ = make_vlm_sample(random.Random(4), 480, width=640)
    im.save(tmp_path / "photo.jpg", quality=90)
    rng = torch.Generator().manual_seed(0)
    Image.fromarray(torch.randint(0, 256, (501, 333, 3), generator=rng, dtype=torch.uint8).numpy()).save(
        tmp_path / "portrait.png")
    image_processor(32, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD).save_pretrained(tmp_path / "proc")
    proc = AutoImageProcessor.from_pretrained(tmp_path / "proc")

    class Enc(ChatEncoder):  # only images matter here
        def __init__(self):
            pass

        def encode(self, s):
            from types import SimpleNamespace
            return SimpleNamespace(dropped=None, images=list(s.images), input_ids=[], labels=[], truncated=False)
    for name, size in (("photo.jpg", 32), ("portrait.png", 32)):
        path = str(tmp_path / name)
        ds = ChatDataset([ChatSample((("user", "<image>\nq"), ("assistant", "a")), (path,))], Enc(), SquarePixels(size))
        ours = normalize_pixels(ds[0]["images"][0][None], OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, torch.float32)
        theirs = proc(Image.open(path), return_tensors="pt")["pixel_values"]
        torch.testing.assert_close(theirs, ours, atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def roundtrip_data(tmp_path_factory):
    """Colour questions: training images 160x120, held-out ones 640x480 JPEGs (as a phone's photo,
    4:3; the shapes inside the centre square the processor keeps)."""
    from mmpipe.data.synth import synth_vlm
    d = tmp_path_factory.mktemp("roundtrip")
    q = ("what colour are the shapes?",)
    train = synth_vlm(str(d / "train"), 300, val_fraction=0.01, size=120, width=160, seed=5, text_only=0.0,
                      progress=False, questions=q)["train"]
    val = synth_vlm(str(d / "val"), 12, val_fraction=1.0, size=480, width=640, seed=6, text_only=0.0,
                    progress=False, questions=q)["val"]
    return {"dir": str(d), "train": train, "val": val}


CHATML_TOKENIZER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "chatml_tokenizer")


@pytest.mark.parametrize("arch,tokenizer", [("llama", None), ("qwen2", CHATML_TOKENIZER)], ids=["llama", "qwen2-chatml"])
def test_round_trip_as_a_user_does_it(roundtrip_data, tmp_path, arch, tokenizer):
    """Issue 29's acceptance: train a tiny VLM until `mmpipe generate` answers held-out questions
    right, export it, load it with LlavaForConditionalGeneration + AutoProcessor, build the prompt
    with apply_chat_template on transformers' message form, feed the 640x480 JPEG through the
    processor, call generate with its defaults: the same answer, stopped at the end of the turn.
    Llama-arch with mmpipe's own tokenizer and template (<|end|>), and qwen2-arch with a Qwen2-style
    ChatML tokenizer (<|im_end|> ends a turn, EOS is <|endoftext|>, a default system turn)."""
    from helpers import TINY_VLM, launch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from mmpipe.cli.generate import Generator
    from mmpipe.families.chat import IMAGE, read_chat
    from mmpipe.train.export import export
    run = str(tmp_path / "run")
    sets = [f"data.train={roundtrip_data['train']}", f"data.val={roundtrip_data['val']}", f"train.output_dir={run}",
            f"model.llm.arch={arch}", "train.steps=400", "optim.lr=2e-3", "parallel.micro_batch_size=8",
            "train.keep_checkpoints=1"]
    if tokenizer:
        sets += [f"data.tokenizer={tokenizer}", "data.max_length=64"]
    launch(1, ["--config", TINY_VLM] + [a for s in sets for a in ("--set", s)], launcher="python")
    g = Generator(run)
    held_out = [(s.messages[0][1].replace(IMAGE, "").strip(), s.messages[1][1], s.images[0])
                for s in read_chat(roundtrip_data["val"])]
    ours = [g.answer(q, image) for q, _, image in held_out]
    assert sum(a == want for a, (_, want, _) in zip(ours, held_out)) >= 1, ours  # it learned something

    out, _, _ = export(run, str(tmp_path / "hf"))
    hf, proc = LlavaForConditionalGeneration.from_pretrained(out).eval(), AutoProcessor.from_pretrained(out)
    eos = hf.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    end = g.tok.convert_tokens_to_ids("<|im_end|>" if tokenizer else "<|end|>")
    assert eos[0] == end
    for (question, _, image), answer in zip(held_out, ours):
        photo = Image.open(image)
        assert photo.format == "JPEG" and photo.size == (640, 480)
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = proc.apply_chat_template(messages, add_generation_prompt=True)
        enc = proc(text=text, images=photo, return_tensors="pt")
        ids, pixels = g.prompt(question, image)
        pixels = pixels["pixel_values"]
        assert enc["input_ids"].tolist() == ids.tolist()
        torch.testing.assert_close(enc["pixel_values"], pixels, atol=1e-6, rtol=0)  # item 6 on a photo
        with torch.no_grad():
            new = hf.generate(**enc)[0, ids.shape[1]:].tolist()
        assert new[-1] in eos, (question, proc.decode(new))  # stopped at the end of the turn
        assert proc.decode(new, skip_special_tokens=True).strip() == answer
