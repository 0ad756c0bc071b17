"""Chat data for VLMs: LLaVA JSON and ms-swift JSONL give the same ids and labels; <image> expands
to the patch count; only assistant turns are learned; truncation never cuts an image's tokens; a
marker/image count mismatch is one line naming the file and the entry or line."""
from __future__ import annotations

import json

import pytest

from mmpipe.data.chat import (IMAGE, ChatEncoder, add_chat_tokens, read_chat, read_llava_json,
                              read_swift_jsonl)

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
    enc = ChatEncoder(tok, image_id, N, 128)
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
    full = ChatEncoder(tok, image_id, N, 1000).encode(sample)
    second = [i for i, t in enumerate(full.input_ids) if t == image_id][N]  # first token of image 2
    cut = ChatEncoder(tok, image_id, N, second + 3).encode(sample)  # would cut image 2 after 3 tokens
    assert cut.truncated and cut.dropped is None
    assert cut.input_ids.count(image_id) == N and len(cut.images) == 1  # image 1 whole, image 2 gone
    assert len(cut.input_ids) == second and any(t != -100 for t in cut.labels)
    dropped = ChatEncoder(tok, image_id, N, 5).encode(sample)  # not even image 1 fits
    assert dropped.dropped and "first image" in dropped.dropped and dropped.input_ids == []


def test_marker_count_mismatch_and_bad_lines_name_the_place(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join([
        json.dumps({"messages": [{"role": "user", "content": "<image><image> hi"}, {"role": "assistant",
                                                                                  "content": "x"}],
                    "images": ["a.jpg"]}),
        "{not json",
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}),
    ]) + "\n")
    rows = read_chat(str(p))
    assert rows[0].error == "2 <image> marker(s) but 1 image(s)" and rows[0].where == f"{p} line 1"
    assert rows[1].error.startswith("not JSON") and rows[1].where == f"{p} line 2"
    assert rows[2].error is None and rows[2].images == ()  # text-only samples are fine
    llava = tmp_path / "bad.json"
    llava.write_text(json.dumps([{"id": "q7", "image": "a.jpg", "conversations": [{"from": "human", "value": "hi"},
                                                                                 {"from": "gpt", "value": "yo"}]}]))
    row = read_chat(str(llava))[0]
    assert row.error == "0 <image> marker(s) but 1 image(s)" and row.where == f"{llava} entry 0 (id q7)"
