"""Chat data for VLMs: LLaVA JSON and ms-swift JSONL give the same ids and labels; <image> expands
to the patch count; only assistant turns are learned; truncation never cuts an image's tokens; a
marker/image count mismatch is one line naming the file and the entry or line."""
from __future__ import annotations

import json

import pytest

from mmpipe.data.pixels import SquarePixels

from mmpipe.families.chat import (
    IMAGE,
    ChatEncoder,
    add_chat_tokens,
    read_chat,
    read_llava_json,
    read_swift_jsonl,
)

N = 9  # image tokens per image (a 3x3 patch grid)
CONV = [("user", "<image>\nwhat colour is the circle?"), ("assistant", "red"),
        ("user", "and how many shapes?"), ("assistant", "two")]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from mmpipe.data.tokenizer import train_tokenizer
    t = train_tokenizer(["what colour is the circle", "red two shapes how many and", "a system prompt"], 200,
                        str(tmp_path_factory.mktemp("chat_tok")))
    return add_chat_tokens(t)


def _write_both(tmp_path, conv, images=("img/a.jpg",), system=None):
    llava = [{"id": "s1", "image": images[0] if images else None,
              "conversations": ([{"from": "system", "value": system}] if system else [])
              + [{"from": "human" if r == "user" else "gpt", "value": t} for r, t in conv]}]
    if not images:
        del llava[0]["image"]
    (tmp_path / "llava.json").write_text(json.dumps(llava))
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": r, "content": t} for r, t in conv]
    (tmp_path / "swift.jsonl").write_text(json.dumps({"messages": msgs, "images": list(images)}) + "\n")
    return (read_llava_json(str(tmp_path / "llava.json"), image_folder=str(tmp_path)),
            read_swift_jsonl(str(tmp_path / "swift.jsonl")))


def test_llava_and_swift_give_the_same_ids_and_labels(tok, tmp_path):
    a, b = _write_both(tmp_path, CONV, system="a system prompt")
    assert a[0].error is None and b[0].error is None and a[0].images == b[0].images
    image_id = tok.convert_tokens_to_ids(IMAGE)
    enc = ChatEncoder(tok, image_id, lambda _: N, 128)
    ea, eb = enc.encode(a[0]), enc.encode(b[0])
    assert ea.input_ids == eb.input_ids and ea.labels == eb.labels
    ids, labels = ea.input_ids, ea.labels
    assert ids.count(image_id) == N  # <image> became exactly the patch count
    start = ids.index(image_id)
    assert ids[start:start + N] == [image_id] * N
    learned = tok.decode([t for t in labels if t != -100])
    assert learned.split() == ["red", "<|end|>", "two", "<|end|>"]  # every assistant turn, with its end token
    # system text, prompts, role markers and the image are not learned
    assert all(lab == -100 for t, lab in zip(ids, labels) if t == image_id)
    assert all(lab == -100 for lab in labels[:start + N])


def test_truncation_never_cuts_through_an_image(tok, tmp_path):
    image_id = tok.convert_tokens_to_ids(IMAGE)
    two = [("user", "<image> what colour is the circle?"), ("assistant", "red"),
           ("user", "<image> how many?"), ("assistant", "two")]
    (tmp_path / "two.jsonl").write_text(json.dumps({"messages": [{"role": r, "content": t} for r, t in two],
                                                    "images": ["a.jpg", "b.jpg"]}) + "\n")
    sample = read_chat(str(tmp_path / "two.jsonl"))[0]
    full = ChatEncoder(tok, image_id, lambda _: N, 1000).encode(sample)
    second = [i for i, t in enumerate(full.input_ids) if t == image_id][N]  # first token of image 2
    cut = ChatEncoder(tok, image_id, lambda _: N, second + 3).encode(sample)  # would cut image 2 after 3 tokens
    assert cut.truncated and cut.dropped is None
    assert cut.input_ids.count(image_id) == N and len(cut.images) == 1  # image 1 whole, image 2 gone
    assert len(cut.input_ids) == second and any(t != -100 for t in cut.labels)
    dropped = ChatEncoder(tok, image_id, lambda _: N, 5).encode(sample)  # not even image 1 fits
    assert dropped.dropped and "first image" in dropped.dropped and dropped.input_ids == []


def test_marker_count_mismatch_and_bad_lines_name_the_place(tok, tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join([
        json.dumps({"messages": [{"role": "user", "content": "<image><image> hi"}, {"role": "assistant",
                                                                                  "content": "x"}],
                    "images": ["a.jpg"]}),
        "{not json",
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}),
        json.dumps({"messages": [{"role": "user", "content": "<video>what happens?"},
                                 {"role": "assistant", "content": "x"}], "videos": ["v.mp4"]}),
    ]) + "\n")
    rows = read_chat(str(p))
    assert rows[3].error is None and rows[3].videos == (str(tmp_path / "v.mp4"),) and rows[3].where == f"{p} line 4"
    # a family without video input drops it, named (skipped and counted, not trained blind)
    from mmpipe.families.chat.encoder import ChatEncoder
    dropped = ChatEncoder(tok, tok.convert_tokens_to_ids("<image>"), lambda _: 4, 64,
                          no_video="model.type=vlm has no video input").encode(rows[3])
    assert dropped.dropped == "model.type=vlm has no video input" and dropped.input_ids == []
    assert rows[0].error == "2 <image> marker(s) but 1 image(s)" and rows[0].where == f"{p} line 1"
    assert rows[1].error.startswith("not JSON") and rows[1].where == f"{p} line 2"
    assert rows[2].error is None and rows[2].images == ()  # text-only samples are fine
    llava = tmp_path / "bad.json"
    llava.write_text(json.dumps([{"id": "q7", "image": "a.jpg", "conversations": [{"from": "human", "value": "hi"},
                                                                                 {"from": "gpt", "value": "yo"}]}]))
    row = read_chat(str(llava))[0]
    assert row.error == "0 <image> marker(s) but 1 image(s)" and row.where == f"{llava} entry 0 (id q7)"
    llava.write_text(json.dumps([{"id": "v1", "video": "v.mp4", "conversations": [
        {"from": "human", "value": "<video>what happens?"}, {"from": "gpt", "value": "yo"}]}]))
    row = read_chat(str(llava))[0]
    assert row.error is None and row.videos == (str(tmp_path / "v.mp4"),)
    llava.write_text(json.dumps([{"id": "v2", "video": ["v.mp4", "w.mp4"], "conversations": [
        {"from": "human", "value": "<video><video><video>what happens?"}, {"from": "gpt", "value": "yo"}]}]))
    assert read_chat(str(llava))[0].error == "3 <video> marker(s) but 2 video(s)"  # (missing marks are added)


def test_swift_rows_without_image_tags_get_them_as_ms_swift_adds_them(tok, tmp_path):
    """ms-swift's Template._add_default_tags: the missing <image> tags go at the start of the first
    message after the system turn; the sample then encodes as the same row written with the tags."""
    p = tmp_path / "notag.jsonl"
    sys_turn = {"role": "system", "content": "be brief"}
    q, a = {"role": "user", "content": "what colour is the circle?"}, {"role": "assistant", "content": "red"}
    p.write_text("\n".join(json.dumps(r) for r in [
        {"messages": [sys_turn, q, a], "images": ["a.jpg", "b.jpg"]},
        {"messages": [sys_turn, {**q, "content": "<image><image>what colour is the circle?"}, a],
         "images": ["a.jpg", "b.jpg"]},
        {"messages": [{**q, "content": "<image> and <image>"}, a], "images": ["a.jpg"]},
    ]) + "\n")
    rows = read_chat(str(p))
    assert rows[0].error is None and rows[0].messages == rows[1].messages
    assert rows[0].messages[1] == ("user", "<image><image>what colour is the circle?")
    enc = ChatEncoder(tok, tok.convert_tokens_to_ids(IMAGE), lambda _: N, 128)
    assert enc.encode(rows[0]).input_ids == enc.encode(rows[1]).input_ids
    assert rows[2].error == "2 <image> marker(s) but 1 image(s)"  # more tags than images stays an error


def test_llava_json_video_rows_get_their_marks(tmp_path):
    """LLaVA JSON: a ``video`` without a ``<video>`` mark gets one as ms-swift adds them (at the start of the first
    user turn); a row that marks its video with ``<image>`` and has no image (LLaVA-Video's data) keeps it there as
    the video's; a row with an image and a video keeps its image mark for the image."""
    from mmpipe.families.chat.records import VIDEO
    conv = lambda q: [{"from": "human", "value": q}, {"from": "gpt", "value": "a cat"}]  # noqa: E731
    p = tmp_path / "video.json"
    p.write_text(json.dumps([{"id": 1, "video": "a.mp4", "conversations": conv("what happens?")},
                             {"id": 2, "video": "a.mp4", "conversations": conv(f"{IMAGE}\nwhat happens?")},
                             {"id": 3, "video": "a.mp4", "conversations": conv(f"{VIDEO}\nwhat happens?")},
                             {"id": 4, "video": "a.mp4", "image": "b.jpg", "conversations": conv(f"{IMAGE}\nsame?")}]))
    rows = read_chat(str(p))
    assert [r.error for r in rows] == [None] * 4
    assert rows[0].messages[0] == ("user", f"{VIDEO}what happens?")
    assert rows[1].messages[0] == rows[2].messages[0] == ("user", f"{VIDEO}\nwhat happens?")
    assert rows[3].messages[0] == ("user", f"{VIDEO}{IMAGE}\nsame?") and rows[3].images and rows[3].videos


def test_chat_batches_hold_every_image_in_order_and_skip_bad_samples(tok, tmp_path):
    """Real JPEGs: a batch of a two-image sample, a text-only one and one whose image is missing
    (replaced by the next usable sample and reported); images stacked in order, labels padded -100."""
    import torch

    from mmpipe.data.synth import synth
    from mmpipe.families.chat import ChatCollate, ChatDataset
    info = synth(str(tmp_path / "imgs"), 4, val_fraction=0.0, size=32, seed=0, progress=False)
    paths = [json.loads(line)["image"] for line in open(info["train"])]
    paths = [p if p.startswith("/") else str(tmp_path / "imgs" / p) for p in paths]
    rows = [{"messages": [{"role": "user", "content": "<image><image> what colour?"},
                          {"role": "assistant", "content": "red"}], "images": paths[:2]},
            {"messages": [{"role": "user", "content": "how many?"}, {"role": "assistant", "content": "two"}]},
            {"messages": [{"role": "user", "content": "<image> what?"}, {"role": "assistant", "content": "red"}],
             "images": [str(tmp_path / "missing.jpg")]},
            {"messages": [{"role": "user", "content": "<image> shape?"}, {"role": "assistant", "content": "circle"}],
             "images": paths[2:3]}]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    image_id = tok.convert_tokens_to_ids(IMAGE)
    ds = ChatDataset(read_chat(str(tmp_path / "chat.jsonl")), ChatEncoder(tok, image_id, lambda _: N, 64), SquarePixels(32))
    batch = ChatCollate(tok.pad_token_id, SquarePixels(32))([ds[i] for i in range(4)])
    assert batch["pixel_values"].shape == (4, 3, 32, 32) and batch["pixel_values"].dtype == torch.uint8
    assert [int(i) for i in batch["index"]] == [0, 1, 3, 3]  # row 2's missing image: the next usable row
    assert batch["bad"] == [(str(tmp_path / "missing.jpg"), "missing file")]
    assert int((batch["input_ids"] == image_id).sum()) == 4 * N  # one run of N tokens per image (2 + 0 + 1 + 1)
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    assert (labels[mask == 0] == -100).all() and (ids[mask == 0] == tok.pad_token_id).all()
    assert (labels[ids == image_id] == -100).all() and (labels != -100).sum() >= 4


def test_a_chat_batch_trains_the_vlm_plain_model(tok, tmp_path):
    """Data and model agree: a collated chat batch (images + a text-only sample) gives a finite loss
    whose gradients reach the vision tower, the projector and the LM."""
    import torch

    import mmpipe
    from mmpipe.data.synth import synth
    from mmpipe.families.chat import ChatCollate, ChatDataset
    info = synth(str(tmp_path / "imgs"), 2, val_fraction=0.0, size=32, seed=0, progress=False)
    paths = [json.loads(line)["image"] for line in open(info["train"])]
    paths = [p if p.startswith("/") else str(tmp_path / "imgs" / p) for p in paths]
    rows = [{"messages": [{"role": "user", "content": "<image> what colour?"}, {"role": "assistant", "content": "red"}],
             "images": paths[:1]},
            {"messages": [{"role": "user", "content": "how many?"}, {"role": "assistant", "content": "two"}]}]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    image_id = tok.convert_tokens_to_ids(IMAGE)
    cfg = mmpipe.load_config(None, ["model.type=vlm", "model.vision.hidden_size=32", "model.vision.num_hidden_layers=2",
                                    "model.vision.num_attention_heads=4", "model.vision.intermediate_size=64",
                                    "model.vision.image_size=32", "model.vision.patch_size=8",
                                    "model.llm.hidden_size=32", "model.llm.num_hidden_layers=2",
                                    "model.llm.num_attention_heads=4", "model.llm.num_key_value_heads=2",
                                    "model.llm.intermediate_size=64", f"model.llm.vocab_size={len(tok)}",
                                    f"model.image_token_id={image_id}"])
    model = mmpipe.build_model(cfg)
    ds = ChatDataset(read_chat(str(tmp_path / "chat.jsonl")), ChatEncoder(tok, image_id, lambda _: 16, 64), SquarePixels(32))
    b = ChatCollate(tok.pad_token_id, SquarePixels(32))([ds[0], ds[1]])
    loss = model(b["pixel_values"], b["input_ids"], b["attention_mask"], b["labels"])
    assert torch.isfinite(loss) and loss > 0
    loss.backward()
    for prefix in ("vision.blocks.0.", "projector.", "llm.blocks.1."):
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters()
                   if n.startswith(prefix)), prefix


def test_synth_vlm_writes_a_learnable_chat_set(tok, tmp_path, capsys):
    """``mmpipe data synth --kind vlm``: ms-swift JSONL that the chat reader takes without a bad row,
    image and text-only samples, short exact answers, no constant answer right more than a third of
    the time, and answers that follow the image (one shape -> "one", with a position question)."""
    from collections import Counter

    from mmpipe.cli.main import main
    from mmpipe.families.chat import ChatDataset
    assert main(["data", "synth", "--kind", "vlm", "--out", str(tmp_path / "vlm"), "--n", "120", "--size", "32"]) == 0
    assert "chat samples" in capsys.readouterr().out
    train, val = read_chat(str(tmp_path / "vlm" / "train.jsonl")), read_chat(str(tmp_path / "vlm" / "val.jsonl"))
    assert len(train) == 108 and len(val) == 12 and all(s.error is None for s in train + val)
    with_image = [s for s in train if s.images]
    assert 0 < len(train) - len(with_image) < len(train) // 3  # some text-only samples
    answers = Counter(t for s in train for r, t in s.messages if r == "assistant")
    assert max(answers.values()) / sum(answers.values()) < 1 / 3 and all(len(a.split()) <= 4 for a in answers)
    both = 0
    for s in with_image:
        qa = {q.replace("<image>\n", ""): a for q, a in zip([t for r, t in s.messages if r == "user"],
                                                             [t for r, t in s.messages if r == "assistant"])}
        if "where is the shape?" in qa and "how many shapes are there?" in qa:  # a position is asked of one shape
            both += 1
            assert qa["how many shapes are there?"] == "one", qa
    assert both > 0
    ds = ChatDataset(train, ChatEncoder(tok, tok.convert_tokens_to_ids(IMAGE), lambda _: N, 64), SquarePixels(32))
    assert all(ds[i]["bad"] == [] for i in range(len(ds)))


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_the_tokenizers_own_chat_template_is_used(tmp_path):
    """With a chat template (a ChatML one, as Qwen2's tokenizer has), the ids are the rendered
    conversation's and exactly each assistant turn (its text and its end marker) is learned; only
    <image> is added to the tokenizer (no plain-template role markers)."""
    from mmpipe.data.tokenizer import train_tokenizer
    from mmpipe.families.chat import ChatSample
    t = train_tokenizer(["what colour is the circle", "red two shapes how many and", "user assistant"], 200,
                        str(tmp_path / "tok"))
    t.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    t.chat_template = CHATML
    add_chat_tokens(t)
    assert "<|user|>" not in t.get_vocab() and IMAGE in t.get_vocab()
    image_id = t.convert_tokens_to_ids(IMAGE)
    enc = ChatEncoder(t, image_id, lambda _: N, 128).encode(ChatSample(tuple(CONV), ("x.jpg",)))
    rendered = t.apply_chat_template([{"role": r, "content": c} for r, c in CONV], tokenize=False)
    want = []
    for k, part in enumerate(rendered.split(IMAGE)):
        want += ([image_id] * N if k else []) + t(part, add_special_tokens=False)["input_ids"]
    assert enc.input_ids == want
    learned = [i for i, lab in zip(enc.input_ids, enc.labels) if lab != -100]
    end = t.convert_tokens_to_ids("<|im_end|>")
    assert learned == t("red", add_special_tokens=False)["input_ids"] + [end] + \
        t("two", add_special_tokens=False)["input_ids"] + [end]
    # generation prompt: the conversation so far, then the assistant header
    prompt = ChatEncoder(t, image_id, lambda _: N, 128).prompt_ids(CONV[:1], ("x.jpg",))
    assert t.decode(prompt[-3:]).replace(" ", "").endswith("<|im_start|>assistant")


# ---- ShareGPT / ms-swift spellings (issue 29, items 10, 11, 13) -----------------------------------------
def _swift(tmp_path, rows) -> list:
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return read_swift_jsonl(str(tmp_path / "d.jsonl"))


def test_sharegpt_roles_are_mapped_and_unknown_ones_refused(tmp_path):
    turn = "<image>\nwhat colour?"
    rows = [{"messages": [{"role": "user", "content": turn}, {"role": r, "content": "red"}], "images": ["a.jpg"]}
            for r in ("assistant", "chatgpt", "bot", "gpt", "Assistant")]
    rows.append({"messages": [{"role": "human", "content": turn}, {"role": "narrator", "content": "red"}],
                 "images": ["a.jpg"]})
    got = _swift(tmp_path, rows)
    for s in got[:5]:  # learned as the assistant's turn
        assert s.error is None and [r for r, _ in s.messages] == ["user", "assistant"], s
    assert got[5].error == ("unknown role 'narrator' (known: human, user, gpt, bot, chatgpt, assistant, system)")
    llava = [{"image": "a.jpg", "conversations": [{"from": "human", "value": turn}, {"from": "chatgpt", "value": "red"}]},
             {"image": "a.jpg", "conversations": [{"from": "human", "value": turn}, {"from": "oracle", "value": "x"}]}]
    (tmp_path / "l.json").write_text(json.dumps(llava))
    a, b = read_llava_json(str(tmp_path / "l.json"))
    assert a.error is None and a.messages[1][0] == "assistant" and "unknown role 'oracle'" in b.error


def test_swift_images_as_one_path_or_as_path_dicts(tmp_path):
    msgs = [{"role": "user", "content": "<image>\nwhat colour?"}, {"role": "assistant", "content": "red"}]
    two = [{"role": "user", "content": "<image><image>\nsame?"}, {"role": "assistant", "content": "yes"}]
    got = _swift(tmp_path, [{"messages": msgs, "images": "pics/a.jpg"},
                            {"messages": two, "images": [{"path": "a.jpg"}, {"path": "/abs/b.jpg", "bytes": None}]},
                            {"messages": msgs, "images": [{"bytes": "xyz"}]}])
    assert got[0].error is None and got[0].images == (str(tmp_path / "pics" / "a.jpg"),)
    assert got[1].error is None and got[1].images == (str(tmp_path / "a.jpg"), "/abs/b.jpg")
    assert "bytes without a path" in got[2].error


def test_data_check_reads_chat_data_as_training_does(tiny_chat_data, tmp_path, capsys):
    """Issue 29, item 5: `mmpipe data check` on an ms-swift JSONL and a LLaVA JSON goes through the
    VLM's reader, encoder and image decode: the three bad lines of the fixture, each named; the same
    conversations as LLaVA JSON: none."""
    from helpers import TINY_VLM

    from mmpipe.cli.main import main
    assert main(["data", "check", "--config", TINY_VLM, "--manifest", tiny_chat_data["train"]]) == 0
    text = capsys.readouterr().out
    assert "3 unusable" in text and "does_not_exist.jpg" in text and "corrupt.jpg" in text
    assert "1 <image> marker(s) but 0 image(s)" in text
    good = [json.loads(line) for line in open(tiny_chat_data["train"]) if "does_not_exist" not in line
            and "corrupt" not in line and '"images": []' not in line]
    role = {"user": "human", "assistant": "gpt", "system": "system"}
    llava = [{"id": str(i), **({"image": r["images"][0]} if r.get("images") else {}),
              "conversations": [{"from": role[m["role"]], "value": m["content"]} for m in r["messages"]]}
             for i, r in enumerate(good)]
    path = tmp_path / "llava.json"
    path.write_text(json.dumps(llava))
    assert main(["data", "check", "--config", TINY_VLM, "--manifest", str(path),
                 "--set", f"data.image_folder={tiny_chat_data['dir']}"]) == 0
    assert f"{len(llava)} usable, 0 unusable" in capsys.readouterr().out


def test_truncation_never_cuts_through_touching_images(tok, tmp_path):
    """Issue 29, item 12: two images with no token between them (<image><image>) are two images:
    the cut falls before the second, not through it."""
    image_id = tok.convert_tokens_to_ids(IMAGE)
    two = [("user", "<image><image>\nare they the same?"), ("assistant", "red")]
    (tmp_path / "t.jsonl").write_text(json.dumps({"messages": [{"role": r, "content": t} for r, t in two],
                                                  "images": ["a.jpg", "b.jpg"]}) + "\n")
    sample = read_chat(str(tmp_path / "t.jsonl"))[0]
    full = ChatEncoder(tok, image_id, lambda _: N, 1000).encode(sample)
    second = [i for i, t in enumerate(full.input_ids) if t == image_id][N]
    assert full.input_ids[second - 1] == image_id  # touching
    cut = ChatEncoder(tok, image_id, lambda _: N, second + 3).encode(sample)
    # whole images only: as many image tokens as images kept (the loader's check before the model)
    assert cut.input_ids.count(image_id) == N * len(cut.images)
    assert cut.dropped or len(cut.images) == 1


def test_generation_stops_where_a_chatml_turn_ends(tok):
    """Issue 29, item 2: with a ChatML template the end of an assistant turn is <|im_end|>, not the
    tokenizer's EOS (<|endoftext|>); generation stops at what rendering an assistant message adds
    after its content, as the labels learned it."""
    import copy
    t = copy.deepcopy(tok)
    t.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]},
                         replace_extra_special_tokens=False)
    t.eos_token = "<|endoftext|>"
    t.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\\n{{ m['content'] }}<|im_end|>\\n{% endfor %}"
                       "{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}")
    enc = ChatEncoder(t, t.convert_tokens_to_ids(IMAGE), lambda _: N, 100)
    assert enc.end_of_turn_ids() == [t.convert_tokens_to_ids("<|im_end|>"), t.convert_tokens_to_ids("<|endoftext|>")]
    plain = ChatEncoder(tok, tok.convert_tokens_to_ids(IMAGE), lambda _: N, 100)  # no template: mmpipe's <|end|>
    assert plain.end_of_turn_ids()[0] == tok.convert_tokens_to_ids("<|end|>")
