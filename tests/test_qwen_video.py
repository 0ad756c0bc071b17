"""Video for the Qwen families (``qwen2_5_vl``, ``qwen3_vl``, ``qwen3_5``): short videos written by PyAV's own
encoder (and a directory of frames) give transformers' ids, grids and logits when its processor is fed the same
decoded frames and samples them itself (Qwen2.5-VL's scaled time positions, Qwen3's timestamp text); packed =
unpacked; an undecodable video is one bad sample; Qwen3-VL with videos, images and text in packed rows trains
alike at P = 1 and P = 2, and its export answers a video through transformers as ``mmpipe generate --video``."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from qwen_fixtures import loaded_model as _loaded
from qwen_fixtures import resolved_family, write_chat
from helpers import TINY_CONFIGS, Runs, train_losses
from PIL import Image
from test_parity import _weights, assert_weights_close


WRITERS = {"qwen2_5_vl": "write_tiny_qwen2_5_vl", "qwen3_vl": "write_tiny_qwen3_vl", "qwen3_5": "write_tiny_qwen3_5",
           "qwen3_vl_moe": "write_tiny_qwen3_vl_moe"}  # (a MoE sibling: video as its dense family's)
# sampled at 1 frame a second, at least 2 frames: the 16-frame clip at 4 fps gives 4 frames (2 temporal patches,
# Qwen2.5-VL's time index 0 and 4), the 6-frame one at 3 fps 2 frames
VIDEO_DATA = {"video_fps": 1.0, "video_min_frames": 2}


def write_video(path: str, frames: int, width: int, height: int, fps: int, seed: int = 0) -> str:
    """A video of random frames, encoded by PyAV (MPEG-4 part 2)."""
    import av
    rng = np.random.default_rng(seed)
    with av.open(path, "w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(frames):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("video")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (96, 160, 3), dtype=np.uint8)).save(d / "im.png")
    frames = d / "frames"
    frames.mkdir()
    for k in range(4):
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(frames / f"{k:03d}.png")
    (d / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(200))
    return {"image": str(d / "im.png"), "long": write_video(str(d / "long.mp4"), 16, 96, 64, 4, seed=1),
            "short": write_video(str(d / "short.mp4"), 6, 64, 128, 3, seed=2), "frames": str(frames),
            "broken": str(d / "broken.mp4"), "dir": str(d)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from mmpipe.families.qwen_vl import tiny
    root = tmp_path_factory.mktemp("video_dirs")
    return {name: getattr(tiny, fn)(str(root / name), seed=1) for name, fn in WRITERS.items()}


ROWS = [(["<video>"], "what happens?", "a square moves", [], ["long"]),
        (["<image>"], "what colour is it?", "red", ["image"], []),
        ([], "what is two plus two?", "four", [], []),
        (["<image>", "<video>"], "is it the same?", "no", ["image"], ["short"]),
        (["<video>"], "how many frames?", "four", [], ["frames"])]


def _chat(path, media, rows) -> str:
    return write_chat(path, rows, media)


def _family(name: str, d: str, tmp_path, **data):
    return resolved_family(name, d, yaml_path=tmp_path / f"{name}.yaml", **{"max_length": 1024, **VIDEO_DATA, **data})


def _decoded(source, fps_of_frames: float):
    """All the frames of ``source`` and their metadata, as a user hands them to the processor (a file decoded by
    PyAV; a frames directory at its frame rate)."""
    from transformers.video_utils import VideoMetadata, load_video
    if os.path.isdir(source):
        files = sorted(os.listdir(source))
        frames = np.stack([np.asarray(Image.open(os.path.join(source, f)).convert("RGB")) for f in files])
        return frames, VideoMetadata(total_num_frames=len(files), fps=fps_of_frames, frames_indices=np.arange(len(files)))
    return load_video(source, backend="pyav")


@pytest.mark.parametrize("name", list(WRITERS))
def test_video_rows_are_transformers_fed_by_its_own_processor(name, dirs, media, tmp_path):
    """Rows with a video file, an image, text only, an image and a video, a directory of frames: mmpipe's ids are
    the processor's (which samples the decoded frames itself at data.video_fps), its grids the processor's
    (Qwen3: one per temporal patch), and its logits and loss transformers' within 1e-5."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmpipe.families.chat import read_chat
    cfg, fam, tok = _family(name, dirs[name], tmp_path)
    ds, collate = fam.dataset(read_chat(_chat(tmp_path / "chat.jsonl", media, ROWS)), tok, cfg.data), \
        fam.collate(tok, cfg.data)
    b = collate([ds[i] for i in range(len(ROWS))])
    assert b["bad"] == []
    proc = AutoProcessor.from_pretrained(dirs[name])
    proc.image_processor.size = {"shortest_edge": 4096, "longest_edge": 65536}
    proc.video_processor = fam.native_video(cfg.data).processor  # (the run's fps and frame bounds)
    texts = [proc.apply_chat_template([{"role": "user", "content": [{"type": m[1:-1]} for m in marks] +
                                        [{"type": "text", "text": "\n" + q}]},
                                       {"role": "assistant", "content": [{"type": "text", "text": a}]}])
             for marks, q, a, _, _ in ROWS]
    decoded = [_decoded(media[k], VIDEO_DATA["video_fps"]) for _, _, _, _, vids in ROWS for k in vids]
    file_videos = [i for i, (_, _, _, _, vids) in enumerate(ROWS) for k in vids]
    enc = proc(text=texts, images=[Image.open(media["image"]).convert("RGB")] * 2, videos=[v for v, _ in decoded],
               video_metadata=[m for _, m in decoded], do_sample_frames=True, return_tensors="pt", padding=True)
    assert len(file_videos) == 3
    mask, theirs = b["attention_mask"].bool(), enc["attention_mask"].bool()
    for i in range(len(ROWS)):
        assert b["input_ids"][i][mask[i]].tolist() == enc["input_ids"][i][theirs[i]].tolist(), i
    per_video = [[[1, h, w]] * t if fam.video_style == "qwen3" else [[t, h, w]]  # Qwen3: an item per temporal patch
                 for t, h, w in enc["video_grid_thw"].tolist()]
    images = enc["image_grid_thw"].tolist()
    # mmpipe's visual items in token order: row 0's video, row 1's image, row 3's image and video, row 4's frames
    assert b["image_grid_thw"].tolist() == per_video[0] + images + per_video[1] + per_video[2]
    assert enc["video_grid_thw"][:, 0].tolist() == [2, 1, 2]  # 4, 2 and 4 frames sampled
    if fam.video_style == "qwen3":
        stamps = tok.decode(b["input_ids"][0][mask[0]])
        assert "<0.6 seconds>" in stamps and "<3.1 seconds>" in stamps  # frames 0, 5 | 10, 15 of the 4 fps clip
    else:
        assert enc["second_per_grid_ts"].tolist() == [2.0, 2.0, 2.0]  # 1 sampled frame a second: time index 0, 4
    hf = AutoModelForImageTextToText.from_pretrained(dirs[name]).eval()
    model = _loaded(fam).eval()
    moe = getattr(fam, "aux_coef", 0)  # a MoE family: its outputs carry the router statistics, its loss the aux loss
    with torch.no_grad():
        inputs = [b[k] for k in fam.inputs]
        logits, loss = model.eval_outputs(*inputs), model(*inputs, b["labels"])
        out = hf(**enc, **({"output_router_logits": True} if moe else {}))
    if moe:
        from mmpipe.families.qwen_vl.experts import aux_loss
        logits, stats = logits
        torch.testing.assert_close(aux_loss(stats), out.aux_loss, rtol=0, atol=1e-5)
        loss = loss - moe * out.aux_loss
    torch.testing.assert_close(logits[mask], out.logits[theirs], rtol=0, atol=1e-5)
    total, count = 0.0, 0
    for i in range(len(ROWS)):  # transformers' logits, mmpipe's labels: the token-mean loss
        lg, lb = out.logits[i][theirs[i]][:-1], b["labels"][i][mask[i]][1:]
        total += torch.nn.functional.cross_entropy(lg, lb, ignore_index=-100, reduction="sum")
        count += int((lb != -100).sum())
    torch.testing.assert_close(loss, total / count, rtol=0, atol=1e-5)


def test_packed_video_rows_give_the_unpacked_loss_and_gradients(dirs, media, tmp_path):
    """Qwen3-VL (DeepStack at the video positions too): the five rows as two packed rows give the loss and every
    gradient of the rows alone (within 1e-5)."""
    from mmpipe.families.chat import read_chat
    cfg, fam, tok = _family("qwen3_vl", dirs["qwen3_vl"], tmp_path)
    recs = read_chat(_chat(tmp_path / "chat.jsonl", media, ROWS))
    single = fam.collate(tok, cfg.data)([fam.dataset(recs, tok, cfg.data)[i] for i in range(len(ROWS))])
    pcfg, _, _ = _family("qwen3_vl", dirs["qwen3_vl"], tmp_path, packing=True, max_length=10 ** 4)
    packs = fam.dataset(recs, tok, pcfg.data)
    packs.packs = [[0, 1, 2], [3, 4]]
    packed = fam.collate(tok, cfg.data)([packs[0], packs[1]])
    model = _loaded(fam).train()

    def loss_and_grads(b):
        model.zero_grad()
        loss = model(*[b[k] for k in fam.inputs], b["labels"], torch.tensor(float((b["labels"] != -100).sum())))
        loss.backward()
        return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    a, ga = loss_and_grads(single)
    c, gc = loss_and_grads(packed)
    torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6)
    for k in ga:
        torch.testing.assert_close(gc[k], ga[k], rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")


def test_a_video_that_cannot_be_decoded_is_one_bad_sample_named(dirs, media, tmp_path):
    """A corrupt file and a missing one: each sample is dropped with the file and why (``data check`` and the
    loader report it), the next usable sample takes its place; nothing crashes."""
    from mmpipe.families.chat import read_chat
    cfg, fam, tok = _family("qwen2_5_vl", dirs["qwen2_5_vl"], tmp_path)
    media = dict(media, missing=os.path.join(media["dir"], "missing.mp4"))
    rows = [(["<video>"], "what happens?", "x", [], ["broken"]), (["<video>"], "what happens?", "y", [], ["missing"]),
            (["<video>"], "what happens?", "z", [], ["short"])]
    ds = fam.dataset(read_chat(_chat(tmp_path / "bad.jsonl", media, rows)), tok, cfg.data)
    assert ds.lengths[:2] == [0, 0] and ds.lengths[2] > 0
    item = ds[0]
    assert item["index"] == 2 and [where.rsplit(" ", 2)[-2:] for where, _ in item["bad"]] == [["line", "1"], ["line", "2"]]
    (_, broken), (_, missing) = item["bad"]
    assert f"{media['broken']}: cannot read the video" in broken, broken
    assert f"{media['missing']}: no such file" in missing, missing


# ---- runs --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def video_runs(tmp_path_factory, tiny_native_chat_data, media):
    """The tiny native-resolution chat data plus 16 rows with videos (two sizes, 4-8 frames; some with an image
    too), for the tiny Qwen3-VL."""
    d = tmp_path_factory.mktemp("video_runs")
    clips = [write_video(str(d / f"clip{k}.mp4"), 8 if k % 2 else 4, 96 if k % 2 else 64, 64, 2, seed=10 + k)
             for k in range(4)]
    rows = [json.loads(line) for line in open(tiny_native_chat_data["train"])]
    usable = [r for r in rows if r.get("images")]
    for k in range(16):
        base = usable[k % len(usable)]
        q = base["messages"][0]["content"].replace("<image>", "").strip()
        rows.insert(3 * k, {"messages": [{"role": "user", "content": ("<image>" if k % 3 == 0 else "") + "<video>\n" + q},
                                         base["messages"][1]],
                            "images": base["images"] if k % 3 == 0 else [], "videos": [clips[k % 4]]})
    train = d / "train.jsonl"
    base_dir = os.path.dirname(tiny_native_chat_data["train"])
    with open(train, "w") as fh:
        for r in rows:
            r = dict(r)
            r["images"] = [p if os.path.isabs(p) else os.path.join(base_dir, p) for p in r.get("images", [])]
            fh.write(json.dumps(r) + "\n")
    from mmpipe.families.qwen_vl.tiny import write_tiny_qwen3_vl
    model = write_tiny_qwen3_vl(str(d / "model"), seed=3)  # (its tokenizer and ChatML template: what users bring)
    runs = Runs(d, {"train": str(train), "val": tiny_native_chat_data["val"]}, TINY_CONFIGS["qwen3_vl"])
    runs.model = model
    return runs


# the profiler's placement is tested elsewhere: cost by parameters here (the profile of every video grid is minutes)
PACKED = ["data.packing=true", "data.max_length=256", "train.batch_size=4", "data.video_fps=2",
          "data.video_min_frames=2", "data.log_samples=true", "parallel.profile=false",
          "model.llm.max_position_embeddings=null"]


def _sets(runs) -> list:
    return PACKED + [f"model.pretrained={runs.model}"]


@pytest.mark.parametrize("key,nprocs,sets", [
    ("packed_p2", 2, ["parallel.pipeline_stages=2"]),
    # ZeRO-3 over two ranks whose micro-batches differ in videos and images (some none): the same collectives
    ("packed_dp2_z3", 2, ["parallel.pipeline_stages=1", "parallel.zero_stage=3"]),
])
def test_video_packed_with_images_trains_as_one_process(video_runs, key, nprocs, sets):
    """Packed rows of videos, images and text, from a Qwen3-VL directory: P = 2 and DP2 with ZeRO-3 train the losses
    (rtol 1e-5) and weights of P = 1, whose micro-batches held videos."""
    one, _ = video_runs.get("packed_p1", 1, ["parallel.pipeline_stages=1"] + _sets(video_runs), "python",
                            flags=["--stop-at", "3"])
    other, _ = video_runs.get(key, nprocs, sets + _sets(video_runs), flags=["--stop-at", "3"])
    trained = [k for line in open(os.path.join(one, "samples", "rank0.jsonl")) for k in json.loads(line)["keys"]]
    video_lines = {n for n, line in enumerate(open(video_runs.data["train"]), 1) if json.loads(line).get("videos")}
    assert sum(int(k.rsplit(" ", 1)[-1]) in video_lines for k in trained) >= 4, trained  # the steps met videos
    np.testing.assert_allclose(train_losses(other), train_losses(one), rtol=1e-5)
    assert_weights_close(_weights(other, 3), _weights(one, 3), rtol=1e-5, atol=1e-5 if "z3" in key else 1e-6)


def test_exported_run_answers_a_video_through_transformers_as_mmpipe_generate(video_runs, media, tmp_path):
    """The P = 1 run exported -> ``Qwen3VLForConditionalGeneration`` + its processor (the run's video sampling):
    the processor's prompt for a video (decoded by PyAV, sampled by the processor) is ``mmpipe generate --video``'s
    ids, and greedy ``generate`` gives its tokens."""
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    from mmpipe.cli.generate import Generator
    from mmpipe.train.export import export
    run, _ = video_runs.get("packed_p1", 1, ["parallel.pipeline_stages=1"] + _sets(video_runs), "python",
                            flags=["--stop-at", "3"])
    out, _, _ = export(run, str(tmp_path / "hf"))
    hf, proc = Qwen3VLForConditionalGeneration.from_pretrained(out).eval(), AutoProcessor.from_pretrained(out)
    g = Generator(run)
    question = "what happens?"
    frames, meta = _decoded(media["long"], 2.0)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}]
    enc = proc(text=proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), videos=[frames],
               video_metadata=[meta], do_sample_frames=True, return_tensors="pt")
    ids, _ = g.prompt(question, video=media["long"])
    assert enc["input_ids"].tolist() == ids.tolist()
    with torch.no_grad():
        got = hf.generate(**enc, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
    want = g.generate_ids(question, video=media["long"], max_new_tokens=8)
    assert got[:len(want)] == want and (len(want) == 8 or want[-1] in g.stop)


@pytest.mark.parametrize("name", list(WRITERS))
def test_generate_places_media_as_the_template_and_eval_scores_video_rows(name, dirs, media, tmp_path):
    """``mmpipe generate --image X --prompt Q``'s ids are transformers' processor's for an image item then the text
    (the family joins a marker-less image to the text as its chat template does: no newline for Qwen); ``--eval``
    asks video rows with their videos; an unreadable image is named as an image, not as a video."""
    from transformers import AutoProcessor

    from mmpipe.errors import ConfigError
    from mmpipe.families.chat.generate import ChatGenerator, exact_match
    cfg, fam, tok = _family(name, dirs[name], tmp_path, min_pixels=4096, max_pixels=65536)
    gen = ChatGenerator(cfg, fam, tok, _loaded(fam).state_dict())
    proc = AutoProcessor.from_pretrained(dirs[name])
    proc.image_processor.size = {"shortest_edge": 4096, "longest_edge": 65536}
    q = "what colour is it?"
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
                                    add_generation_prompt=True, tokenize=False)
    enc = proc(text=[text], images=[Image.open(media["image"]).convert("RGB")], return_tensors="pt")
    assert gen.prompt(q, media["image"])[0].tolist() == enc["input_ids"].tolist()
    bad = os.path.join(media["dir"], "corrupt.jpg")
    with open(bad, "wb") as fh:
        fh.write(b"\xff\xd8\xff\xe0 not a jpeg" * 3)
    with pytest.raises(ConfigError, match=r"^--image .*corrupt.jpg: cannot read the image"):
        gen.prompt(q, bad, video=media["long"])
    chat = _chat(tmp_path / "eval.jsonl", dict(media, bad=bad), ROWS + [(["<image>"], q, "red", ["bad"], [])])
    out = exact_match(gen, str(tmp_path), chat, progress=False, max_new_tokens=2)
    assert out["n"] == len(ROWS), out["skipped"]  # the three video questions among them
    assert sum(bool(r["videos"]) for r in out["examples"]) == 3
    assert len(out["skipped"]) == 1 and f"line 6: image {bad}: cannot read the image" in out["skipped"][0]


@pytest.mark.parametrize("name", list(WRITERS))
def test_frames_in_natural_order_budgeted_webm_counted_and_short_clips_named(name, dirs, media, tmp_path):
    """A frames directory is taken in natural order (frame_2 before frame_10) and sampled to the frame budget as a
    file is; a WebM / Matroska clip, whose header holds no frame count, is counted and planned as its MP4 twin; a
    one-frame clip is refused in words; a budget whose minimum is above its maximum is one line."""
    import av

    from mmpipe.errors import ConfigError
    from mmpipe.families.qwen_vl.video import frame_files
    cfg, fam, _ = _family(name, dirs[name], tmp_path, video_max_frames=8)
    native = fam.native_video(cfg.data)
    unpadded = tmp_path / "unpadded"
    unpadded.mkdir()
    for k in range(1, 41):
        Image.fromarray(np.full((64, 64, 3), k, dtype=np.uint8)).save(unpadded / f"frame_{k}.png")
    assert [os.path.basename(f) for f in frame_files(str(unpadded))][:12] == [f"frame_{k}.png" for k in range(1, 13)]
    plan = native.plan(str(unpadded))
    assert len(plan.indices) == 8 and plan.indices[0] == 0 and plan.indices[-1] >= 30  # spread over the 40 frames
    frames = native._frames(str(unpadded), plan)
    assert [int(f[0, 0, 0]) for f in frames] == [i + 1 for i in plan.indices]  # frame_{i+1} holds value i + 1
    twins = {}
    for ext, codec in (("mp4", "mpeg4"), ("webm", "libvpx-vp9"), ("mkv", "mpeg4")):
        path = write_video(str(tmp_path / f"clip.{ext}"), 8, 64, 64, 4, seed=3) if ext == "mp4" else None
        if path is None:
            path = str(tmp_path / f"clip.{ext}")
            with av.open(path, "w") as out:
                st = out.add_stream(codec, rate=4)
                st.width, st.height, st.pix_fmt = 64, 64, "yuv420p"
                for k in range(8):
                    fr = av.VideoFrame.from_ndarray(np.full((64, 64, 3), 30 * k, dtype=np.uint8), format="rgb24")
                    for p in st.encode(fr):
                        out.mux(p)
                for p in st.encode():
                    out.mux(p)
            with av.open(path) as c:
                assert c.streams.video[0].frames == 0  # the container records no count
        twins[ext] = native.plan(path)
        assert len(native._frames(path, twins[ext])) == len(twins[ext].indices)
    assert twins["webm"].indices == twins["mkv"].indices == twins["mp4"].indices
    assert twins["webm"].grid == twins["mp4"].grid
    one = write_video(str(tmp_path / "one.mp4"), 1, 64, 64, 4)
    with pytest.raises(ValueError, match=r"^1 frame: a video needs at least 2 \(one temporal patch\)$"):
        native.plan(one)
    for key, lo, hi in (("frames", 64, 4), ("pixels", 200000, 5000)):
        with pytest.raises(ConfigError, match=rf"^data.video_min_{key}={lo} is above data.video_max_{key}={hi}"):
            _family(name, dirs[name], tmp_path, **{f"video_min_{key}": lo, f"video_max_{key}": hi})
