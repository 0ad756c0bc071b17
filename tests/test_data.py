"""The data path: length-aware batches, the preprocessed cache, WebDataset shards, augmentation
(single-process tests; the multi-process shard run is in test_parity.py's shared launches)."""
from __future__ import annotations

import io
import json
import os
import random
import tarfile

import pytest
from mmpipe.data.pixels import SquarePixels
import torch

from mmpipe.errors import ConfigError


@pytest.fixture(scope="module")
def tok(tiny_data, tmp_path_factory):
    from mmpipe.data.manifest import read_manifest
    from mmpipe.data.tokenizer import train_tokenizer
    words = ["red", "blue", "green", "circle", "square", "small", "large", "a", "the", "on", "left", "right"]
    texts = [s.text for s in read_manifest(tiny_data["train"])] + [" ".join(words)]
    return train_tokenizer(texts, 300, str(tmp_path_factory.mktemp("tok")))


def _word_captions(n, lo, hi, seed=0):
    rng = random.Random(seed)
    words = ["red", "blue", "green", "circle", "square", "small", "large", "a", "the", "on", "left", "right"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


# ---- length-aware batches --------------------------------------------------------------------------
def test_collate_pads_to_the_batch_longest_rounded_up(tok):
    from mmpipe.data.loader import Collate
    items = [{"pixel_values": torch.zeros(3, 4, 4, dtype=torch.uint8), "text": t, "index": i, "bad": []}
             for i, t in enumerate(["red", "a small red circle on the left"])]
    b = Collate(tok, 32, "batch", 4)(items)
    longest = int(b["attention_mask"].sum(1).max())
    assert b["input_ids"].shape[1] == -(-longest // 4) * 4 < 32
    assert Collate(tok, 32, "max_length")(items)["input_ids"].shape[1] == 32
    assert Collate(tok, 6, "batch", 4)(items)["input_ids"].shape[1] == 6  # never above max_length


def test_length_grouping_keeps_padding_under_10_percent_and_layouts_equal(tok):
    from mmpipe.data.loader import Collate
    from mmpipe.data.sampler import MicroBatchSampler
    caps = _word_captions(4096, 3, 60)
    lengths = [len(x) for x in tok(caps, truncation=True, max_length=77)["input_ids"]]
    collate = Collate(tok, 77, "batch", 4)

    def waste(sampler, steps):
        pad = real = 0
        for step in range(steps):
            for mb in sampler.micro_batches(step):
                items = [{"pixel_values": torch.zeros(1), "ids": [1] * lengths[i], "index": i, "bad": []} for i in mb]
                m = collate(items)["attention_mask"]
                pad, real = pad + int((m == 0).sum()), real + int(m.sum())
        return pad / (pad + real)

    grouped = MicroBatchSampler(4096, 16, 8, 1, 0, seed=0, lengths=lengths)
    plain = MicroBatchSampler(4096, 16, 8, 1, 0, seed=0)
    w_grouped, w_plain = waste(grouped, 30), waste(plain, 30)
    print(f"padding waste: grouped {w_grouped:.3f}, ungrouped {w_plain:.3f}")
    assert w_grouped < 0.10 < w_plain, (w_grouped, w_plain)
    # grouping still gives every layout the same micro-batches, and each sample once per epoch
    for step in (0, 3, 31):
        dp = [MicroBatchSampler(4096, 16, 4, 2, r, seed=0, lengths=lengths).micro_batches(step) for r in range(2)]
        assert dp[0] + dp[1] == grouped.micro_batches(step)
    epoch = [i for s in range(grouped.steps_per_epoch) for mb in grouped.micro_batches(s) for i in mb]
    assert len(epoch) == len(set(epoch)) == 4096


# ---- cache --------------------------------------------------------------------------------------
def test_cache_matches_the_direct_path_and_prepare_resumes(tiny_data, tmp_path, tok):
    from mmpipe.data.cache import CachedDataset, open_meta, prepare
    from mmpipe.data.loader import Collate, ImageTextDataset
    from mmpipe.data.manifest import read_manifest
    tok_dir = str(tmp_path / "tok")
    tok.save_pretrained(tok_dir)
    out = str(tmp_path / "cache")
    first = prepare(tiny_data["train"], out, 32, 16, tokenizer=tok_dir, workers=2, chunk=8, max_items=20,
                    progress=False)
    assert first["done_now"] == 20 and first["remaining"] > 0
    with pytest.raises(ConfigError, match="incomplete"):
        open_meta(out)
    second = prepare(tiny_data["train"], out, 32, 16, tokenizer=tok_dir, workers=2, chunk=8, progress=False)
    samples = read_manifest(tiny_data["train"])
    assert second["done_now"] == len(samples) - 20 and second["remaining"] == 0
    assert second["bad"] == 2  # the missing and the corrupt image
    open_meta(out)
    # the same rows as a cache built in one go
    oneshot = str(tmp_path / "oneshot")
    prepare(tiny_data["train"], oneshot, 32, 16, tokenizer=tok_dir, workers=1, progress=False)
    for f in ("images.u8", "tokens.npy", "status.u8"):
        assert open(os.path.join(out, f), "rb").read() == open(os.path.join(oneshot, f), "rb").read(), f

    direct, cached = ImageTextDataset(samples, SquarePixels(32)), CachedDataset(out, SquarePixels(32))
    collate = Collate(tok, 16)
    for mb in ([0, 1, 2, 3], [len(samples) - 3, len(samples) - 2, len(samples) - 1, 5]):  # incl. bad rows
        a, b = collate([direct[i] for i in mb]), collate([cached[i] for i in mb])
        diff = (a["pixel_values"].int() - b["pixel_values"].int()).abs().max()
        assert diff <= 1, diff  # within 1/255 per pixel
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["index"], b["index"])
        assert [p for p, _ in a["bad"]] == [p for p, _ in b["bad"]]
    assert any(b for i in range(len(samples)) for b in cached[i]["bad"])


def test_cache_refuses_a_mismatched_run(tiny_data, tmp_path):
    from mmpipe.data.cache import check_compatible, open_meta, prepare
    out = str(tmp_path / "c")
    prepare(tiny_data["train"], out, 32, 16, workers=1, progress=False)
    meta = open_meta(out)
    with pytest.raises(ConfigError, match="data.decode_size=32"):
        check_compatible(meta, out, 48, 16, None)
    with pytest.raises(ConfigError, match="--max-length 20"):
        check_compatible(meta, out, 32, 20, None)
    with pytest.raises(ConfigError, match="another build"):
        prepare(tiny_data["train"], out, 48, 16, workers=1, progress=False)


def test_augmentation_runs_after_the_cache_and_is_seeded(tiny_data, tmp_path):
    from mmpipe.data.cache import CachedDataset, prepare
    from mmpipe.data.pixels import Augment
    out = str(tmp_path / "c")
    prepare(tiny_data["train"], out, 48, 16, workers=1, progress=False)
    aug = Augment("crop_flip", 32, [0.5, 1.0], seed=0)
    ds = CachedDataset(out, SquarePixels(32, augment=aug))
    a, a2, b = ds[(3, 0)]["pixel_values"], ds[(3, 0)]["pixel_values"], ds[(3, 1)]["pixel_values"]
    assert a.shape == (3, 32, 32) and a.dtype == torch.uint8
    assert torch.equal(a, a2)  # same (seed, epoch, sample): same crop, in any worker or layout
    assert not torch.equal(a, b)  # a new epoch draws a new crop: the cache does not freeze it


# ---- shards -------------------------------------------------------------------------------------
def write_shards(out_dir, samples, per_shard, bad_every=0):
    """img2dataset layout: KEY.jpg + KEY.txt (odd keys use KEY.json {"caption"})."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for s in range(0, len(samples), per_shard):
        path = os.path.join(out_dir, f"{s // per_shard:05d}.tar")
        with tarfile.open(path, "w") as tar:
            for k, (img, text) in enumerate(samples[s:s + per_shard]):
                key = f"{s + k:06d}"
                data = open(img, "rb").read() if not (bad_every and (s + k) % bad_every == 0) else b"not a jpeg"
                if (s + k) % 2:
                    members = [(f"{key}.jpg", data), (f"{key}.json", json.dumps({"caption": text}).encode())]
                else:
                    members = [(f"{key}.jpg", data), (f"{key}.txt", text.encode())]
                for name, payload in members:
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
        paths.append(path)
    return paths


def test_shards_split_by_rank_and_worker(tiny_data, tmp_path, tok):
    from torch.utils.data import DataLoader

    from mmpipe.data.loader import Collate
    from mmpipe.data.manifest import read_manifest
    from mmpipe.data.shards import ShardStream, expand, iter_tar
    good = [(s.image, s.text) for s in read_manifest(tiny_data["train"]) if os.path.isfile(s.image)][:64]
    write_shards(str(tmp_path / "sh"), good, 8, bad_every=16)
    urls = expand(str(tmp_path / "sh" / "{00000..00007}.tar"))
    assert [k for k, _, _ in iter_tar(urls[1])] == [f"{i:06d}" for i in range(8, 16)]
    assert all(t for _, _, t in iter_tar(urls[1]))  # .txt and .json captions both read
    seen = {}
    for rank in range(2):
        stream = ShardStream(urls, 2, rank, 2, 4, Collate(tok, 16), SquarePixels(32), shuffle_buffer=5)
        keys, bad = [], []
        for i, b in enumerate(DataLoader(stream, batch_size=None, num_workers=2)):
            assert b["pixel_values"].shape == (4, 3, 32, 32)
            keys += b["keys"]
            bad += [p for p, _ in b["bad"]]
            if i == 5:
                break
        seen[rank] = keys
        shards = {k.split("/")[0] for k in keys}
        assert shards <= {os.path.basename(u) for u in urls[rank::2]}  # only this rank's shards
        assert len(shards) >= 2  # both workers contributed
        # the corrupt samples (keys 0, 16, 32, 48) all sit in rank 0's shards: counted there, by name
        assert all(int(p.split("/")[1]) % 16 == 0 for p in bad) and (bool(bad) == (rank == 0))
    assert not set(seen[0]) & set(seen[1])
    with pytest.raises(ConfigError, match="fewer than the data-parallel degree"):
        ShardStream(urls[:1], 2, 1, 2, 4, Collate(tok, 16), SquarePixels(32))


def test_missing_shard_is_one_line(tmp_path):
    from mmpipe.data.shards import expand
    with pytest.raises(ConfigError, match=r"2 of 2 shards not found"):
        expand(str(tmp_path / "{0..1}.tar"))


# ---- micro_batch_size: auto ------------------------------------------------------------------------
def test_auto_micro_batch_picks_the_largest_size_that_fits(tiny_data, tok):
    from helpers import TINY

    from mmpipe.config.resolve import build_family
    from mmpipe.config.schema import load_config
    from mmpipe.data.manifest import read_manifest
    from mmpipe.data.source import TrainSource
    from mmpipe.planning.measure import build_layers
    from mmpipe.parallel.schedules import Order
    from mmpipe.planning.memory import RunShape, stage_memory
    from mmpipe.planning.micro_batch import auto_micro_batch, probe_batch
    from mmpipe.planning.profiler import profile_layers
    cfg = load_config(TINY, [f"model.text.vocab_size={len(tok)}", "model.text.eos_token_id=3",
                             "model.text.max_position_embeddings=16", "train.batch_size=48"])
    spec = build_family(cfg.model, 0)
    source = TrainSource("manifest", samples=read_manifest(tiny_data["train"]))
    parts = [0, 5, len(spec.layer_names())]
    layers = build_layers(spec)
    dev = torch.device("cpu")

    def peak(m):  # measured independently of the search: every stage of the 2-stage layout, under either order
        costs = profile_layers(layers, probe_batch(cfg, spec, source, tok, m, dev), timed=False)
        return max(max(stage_memory(costs, parts, 48 // m, "fp32", shape=RunShape(order=Order(name))))
                   for name in ("1f1b", "zb_h1"))

    peaks = {m: peak(m) for m in (4, 6, 8)}
    assert peaks[4] < peaks[6] < peaks[8]  # activations grow with the micro-batch
    budget = (peaks[6] + peaks[8]) // 2  # 6 fits, 8 does not
    m, probed = auto_micro_batch(cfg, spec, source, tok, 2, 1, parts, frozenset(), frozenset(), budget, dev)
    assert m == 6, (m, probed)
    assert probed[m] <= budget and all(p > budget for mm, p in probed.items() if mm > m)
    with pytest.raises(ConfigError, match="even a micro-batch of 2"):  # the smallest a contrastive loss takes
        auto_micro_batch(cfg, spec, source, tok, 2, 1, parts, frozenset(), frozenset(), 1000, dev)


def test_profile_counts_activations_and_frozen_layers_run_forward_only(tok):
    from helpers import TINY

    from mmpipe.config.resolve import build_family
    from mmpipe.config.schema import load_config
    from mmpipe.planning.measure import build_layers
    from mmpipe.planning.profiler import profile_layers
    cfg = load_config(TINY, [f"model.text.vocab_size={len(tok)}", "model.text.eos_token_id=3",
                             "model.text.max_position_embeddings=16"])
    spec = build_family(cfg.model, 0)
    names = spec.layer_names()
    vision = frozenset(n for n in names if n.startswith("vision."))
    x = (torch.randint(0, 255, (4, 3, 32, 32), dtype=torch.uint8), torch.randint(5, 50, (4, 16)),
         torch.ones(4, 16, dtype=torch.int64))
    full = profile_layers(build_layers(spec), x, repeats=2, warmup=1)
    frozen = profile_layers(build_layers(spec, forward_only=vision), x, repeats=2, warmup=1)
    for a, b in zip(full, frozen):
        assert a.name == b.name and a.out_bytes == b.out_bytes > 0
        if a.name in vision:
            # no autograd graph: nothing saved for backward (timings are for benchmarks, not tests)
            assert b.act_bytes < a.act_bytes
    blocks = [c for c in full if c.name.startswith("vision.blocks.")]
    assert blocks[0].act_bytes > 4 * blocks[0].out_bytes  # a transformer block keeps several activations
    # what a stage boundary after it sends: image tokens, caption ids, mask (3 messages); one gradient
    assert (blocks[0].out_tensors, blocks[0].grad_tensors) == (3, 1)
    assert 0 < blocks[0].grad_bytes < blocks[0].out_bytes
    text = [c for c in full if c.name.startswith("text.blocks.")][0]  # + the text hidden states
    assert (text.out_tensors, text.grad_tensors) == (4, 2)
    x8 = tuple(torch.cat([t, t]) for t in x)
    full8 = profile_layers(build_layers(spec), x8, timed=False)
    assert abs(full8[2].act_bytes / full[2].act_bytes - 2) < 0.1  # linear in the micro-batch


def test_the_timed_backward_computes_no_gradient_for_the_models_inputs():
    """The engine never asks for the pixels' gradient (DeepSpeed's first stage loads its inputs without
    one), so the profiler's timed passes do not either: a patch embedding's input gradient was 300 of the
    318 ms it priced for Qwen2.5-VL's, and placed the whole ViT on the second stage. Round 0 (a warm-up,
    where bytes and what a boundary sends back are measured) keeps it; the next layer's float inputs
    want theirs."""
    from mmpipe.planning.profiler import profile_layers

    class Seen(torch.nn.Module):
        def __init__(self, name):
            super().__init__()
            self.name, self.lin, self.seen = name, torch.nn.Linear(6, 6), []

        def forward(self, acts):  # a pipeline layer: a tuple of tensors in, a tensor out
            x = acts[0] if isinstance(acts, tuple) else acts
            self.seen.append(x.requires_grad)
            return self.lin(x)
    first, second = Seen("embed"), Seen("block")
    profile_layers([first, second], (torch.randn(4, 6),), repeats=2, warmup=1, workspace=False)
    assert first.seen == [True, False, False] and second.seen == [True] * 3


# ---- one rule whatever the file is called or holds ------------------------------------------------
@pytest.mark.parametrize("name", ["m.CSV", "m.Csv", "m.TSV", "m.JSONL", "m.Json", "m.txt", "manifest"])
def test_manifest_format_does_not_depend_on_the_extension_case(tmp_path, name):
    from mmpipe.data.manifest import read_manifest
    rows = [("a.jpg", "a red circle"), ("b.jpg", "a blue, square")]
    if name.lower().endswith((".json", ".jsonl")) or name == "manifest":
        text = "".join(json.dumps({"image": i, "text": t}) + "\n" for i, t in rows)
    elif name.lower().endswith(".tsv") or name == "m.txt":
        text = "image\ttext\n" + "".join(f"{i}\t{t}\n" for i, t in rows)
    else:
        text = 'image,text\n' + "".join(f'{i},"{t}"\n' for i, t in rows)
    (tmp_path / name).write_text(text)
    got = read_manifest(str(tmp_path / name), require_usable=False)
    assert [(os.path.basename(s.image), s.text, s.error) for s in got] == [(i, t, None) for i, t in rows]


def test_a_32_bit_integer_image_is_a_bad_sample_with_its_reason(tmp_path):
    import numpy as np
    from PIL import Image

    from mmpipe.data.decode import decode_sample
    path = str(tmp_path / "i32.tif")
    Image.fromarray((np.arange(32 * 32).reshape(32, 32) * 100_000).astype(np.int32), mode="I").save(path)
    assert Image.open(path).mode == "I"
    pixels, why = decode_sample(path, "a caption", 32)
    assert pixels is None and "32-bit integer image (mode I)" in why


def test_a_shard_caption_list_reads_as_in_a_manifest(tiny_data, tmp_path):
    from mmpipe.data.manifest import read_manifest
    from mmpipe.data.shards import iter_tar
    image = next(s.image for s in read_manifest(tiny_data["train"]) if os.path.isfile(s.image))
    caps = {"000000": {"caption": ["", "a red circle", "other"]}, "000001": {"text": "plain"},
            "000002": {"caption": [3]}}
    path = str(tmp_path / "00000.tar")
    with tarfile.open(path, "w") as tar:
        for key, d in caps.items():
            for name, payload in ((f"{key}.jpg", open(image, "rb").read()), (f"{key}.json", json.dumps(d).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    got = {k: t for k, _, t in iter_tar(path)}
    assert got["000000"] == "a red circle" and got["000001"] == "plain"
    assert got["000002"] == [3]  # not text: the decode reports it as a bad sample, as a manifest row's
    m = tmp_path / "m.jsonl"
    m.write_text(json.dumps({"image": image, "caption": ["", "a red circle", "other"]}) + "\n")
    assert read_manifest(str(m))[0].text == got["000000"]


# ---- the worker hand-off: one buffer a micro-batch -------------------------------------------------
def test_a_workers_batch_travels_as_one_buffer_and_comes_back_equal():
    """``data.handoff``: the collate's tensors packed into one buffer (inline in the message under
    ``INLINE_BYTES``, else one shared-memory storage), rebuilt as equal tensors of the same dtypes and
    shapes; torch's own hand-off sends one shared-memory storage (a descriptor round trip) per tensor."""
    import io

    import torch
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's shared-memory reductions with it

    from mmpipe.data.handoff import INLINE_BYTES, PackedBatch

    def storages(obj) -> int:  # shared-memory storages the message carries (torch's storage reducers called)
        calls, saved = [], dict(ForkingPickler._extra_reducers)
        for t, f in saved.items():
            if t is torch.UntypedStorage:
                ForkingPickler._extra_reducers[t] = lambda x, f=f: calls.append(1) or f(x)
        try:
            ForkingPickler(io.BytesIO()).dump(obj)
        finally:
            ForkingPickler._extra_reducers.clear()
            ForkingPickler._extra_reducers.update(saved)
        return len(calls)
    small = {"pixel_values": torch.randint(0, 255, (4, 3, 8, 8), dtype=torch.uint8),
             "input_ids": torch.arange(12).reshape(4, 3), "attention_mask": torch.ones(4, 3, dtype=torch.int64),
             "row_keys": torch.zeros(4, 1, 2, dtype=torch.int64), "patches": torch.randn(5, 7),
             "empty": torch.zeros(0, 3), "keys": ["a", "b", "c", "d"], "bad": [("x.jpg", "corrupt")], "truncated": 1}
    large = dict(small, pixel_values=torch.randint(0, 255, (4, 3, 300, 300), dtype=torch.uint8))
    assert storages({k: v.clone() if torch.is_tensor(v) else v for k, v in small.items()}) == 6
    for batch, shared in ((small, 0), (large, 1)):
        packed = PackedBatch.pack(batch)
        assert (packed.buffer.numel() > INLINE_BYTES) == bool(shared)
        assert storages(packed) == shared
        back = ForkingPickler.loads(ForkingPickler.dumps(packed)).unpack()
        assert set(back) == set(batch)
        for k, v in batch.items():
            if torch.is_tensor(v):
                assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v), k
            else:
                assert back[k] == v, k


def test_a_loader_with_workers_gives_the_in_process_loaders_batches(tiny_data, tok):
    import mmpipe
    from helpers import TINY

    from mmpipe.config.resolve import build_family
    from mmpipe.data.source import build_train_loader, open_source
    from mmpipe.parallel.topology import Topology
    got = {}
    for workers in (0, 2):
        cfg = mmpipe.load_config(TINY, [f"data.train={tiny_data['train']}", f"data.num_workers={workers}", "model.text.vocab_size=300",
                                        "parallel.pipeline_stages=1", "train.steps=3"])
        fam = build_family(cfg.model, 0)
        src = open_source(cfg, True, family=fam)
        loader = build_train_loader(cfg, src, tok, fam.collate(tok, cfg.data),
                                    Topology(world_size=1, pipeline_stages=1, micro_batch_size=4, batch_size=16),
                                    0, 0, True, fam)
        got[workers] = list(loader)
    assert len(got[0]) == len(got[2]) == 12
    for a, b in zip(got[0], got[2]):
        assert set(a) == set(b)
        for k in a:
            assert torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k], k
