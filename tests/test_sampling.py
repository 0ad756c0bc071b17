"""What a step draws: the micro-batch sampler (layout-independent, resumable, another batch size),
eval padding, manifests, synthetic data, the tokenizer, reduced-size JPEG decode."""
from __future__ import annotations

import itertools
import json

import pytest
import torch

from mmpipe.errors import DataError


# ---- sampler -----------------------------------------------------------------------------------
def test_micro_batches_are_layout_independent_and_resumable():
    from mmpipe.data.sampler import MicroBatchSampler
    single = MicroBatchSampler(100, 4, 8, 1, 0, seed=3)
    for step in (0, 1, 5, 12):  # 12 crosses an epoch (3 steps per epoch)
        ref = single.micro_batches(step)
        dp = [MicroBatchSampler(100, 4, 4, 2, r, seed=3).micro_batches(step) for r in range(2)]
        assert dp[0] + dp[1] == ref
        assert len({i for mb in ref for i in mb}) == 32
    resumed = list(itertools.islice(iter(MicroBatchSampler(100, 4, 8, 1, 0, seed=3, start_step=5)), 8))
    assert [[i for i, _ in mb] for mb in resumed] == single.micro_batches(5)
    assert all(epoch == 1 for mb in resumed for _, epoch in mb)  # step 5 is in epoch 1: it seeds augmentation


def test_a_resume_with_another_batch_or_micro_batch_size_continues_the_epoch():
    from mmpipe.data.sampler import MicroBatchSampler
    from mmpipe.errors import DataError
    before = MicroBatchSampler(100, 4, 2, 1, 0, seed=3)  # batch 8: 12 steps per epoch
    seen = [i for step in range(5) for i in before.global_batch_indices(step)]
    at = before.position(5)
    assert at == {"epoch": 0, "offset": 0, "micro_batch": 10, "micro_batch_size": 4, "sample": 40}
    for mb, acc in ((4, 4), (8, 2), (3, 5)):  # batch 16 (same micro-batch), 16, 15 (re-cut)
        after = MicroBatchSampler(100, mb, acc, 1, 0, seed=3, start_step=5, start_at=at)
        epoch0 = [i for step in range(5, 5 + 60 // (mb * acc)) for i in after.global_batch_indices(step)]
        assert len(seen + epoch0) == len(set(seen + epoch0)) and 100 - len(seen + epoch0) < mb * acc
        assert after._locate(5 + 60 // (mb * acc))[:2] == (1, 0)  # then epoch 1, cut as usual
        assert after.micro_batches(5 + 60 // (mb * acc)) == MicroBatchSampler(100, mb, acc, 1, 0, seed=3).micro_batches(
            100 // (mb * acc))
    same = MicroBatchSampler(100, 4, 2, 1, 0, seed=3, start_step=5, start_at=at)  # the same batch: as before
    assert [same.micro_batches(s) for s in range(5, 30)] == [before.micro_batches(s) for s in range(5, 30)]
    lengths = list(range(100))
    grouped = MicroBatchSampler(100, 4, 2, 1, 0, seed=3, lengths=lengths).position(5)
    with pytest.raises(DataError, match="micro-batch size is 4, this run's 8"):
        MicroBatchSampler(100, 8, 1, 1, 0, seed=3, start_step=5, lengths=lengths, start_at=grouped)


def test_eval_batches_pad_to_full_micro_batches():
    from mmpipe.data.sampler import eval_batches
    mbs, n = eval_batches(list(range(10)), 4)
    assert n == 10 and len(mbs) == 3 and all(len(mb) == 4 for mb in mbs) and mbs[-1][-1] == 9


# ---- manifests, tokenizer, synthetic data -------------------------------------------------------
def test_manifest_jsonl_and_csv_with_alias_keys(tmp_path):
    from mmpipe.data.manifest import read_manifest
    (tmp_path / "a.jsonl").write_text('{"image_path": "x/1.jpg", "caption": "one"}\n\n{"image": "/abs/2.jpg", "text": "two"}\n')
    s = read_manifest(str(tmp_path / "a.jsonl"))
    assert s[0].image == str(tmp_path / "x" / "1.jpg") and s[0].text == "one" and s[1].image == "/abs/2.jpg"
    (tmp_path / "b.csv").write_text('image,text\nimg.jpg,"a, caption"\n')
    assert read_manifest(str(tmp_path / "b.csv"))[0].text == "a, caption"
    (tmp_path / "c.jsonl").write_text('{"picture": "x.jpg"}\n')
    with pytest.raises(DataError, match="c.jsonl line 1"):
        read_manifest(str(tmp_path / "c.jsonl"))


def test_synth_writes_learnable_pairs_and_tokenizer_trains(tmp_path):
    from PIL import Image

    from mmpipe.data.manifest import read_manifest
    from mmpipe.data.synth import COLORS, SHAPES, synth
    from mmpipe.data.tokenizer import eos_id, load_tokenizer, train_tokenizer
    info = synth(str(tmp_path), 30, size=40, progress=False)
    train = read_manifest(info["train"])
    assert len(train) == 27 and len(read_manifest(info["val"])) == 3
    for s in train[:5]:
        with Image.open(s.image) as im:
            assert im.format == "JPEG" and im.size == (40, 40)
        assert any(c in s.text for c in COLORS) and any(sh in s.text for sh in SHAPES)
    tok = train_tokenizer([s.text for s in train], 120, str(tmp_path / "tok"))
    tok2 = load_tokenizer(str(tmp_path / "tok"))
    enc = tok2(["a large red circle"], padding="max_length", max_length=10)
    ids = enc["input_ids"][0]
    assert ids[0] == tok.cls_token_id and eos_id(tok2) in ids and ids[-1] == tok2.pad_token_id
    assert tok2.unk_token_id not in ids[1:ids.index(eos_id(tok2))]


def test_tokenizer_ids_are_the_same_in_every_process(tmp_path, tiny_data):
    """Each run (and each layout) trains its own tokenizer: the ids must not depend on the process."""
    import subprocess
    import sys
    code = ("import sys, json; from mmpipe.data.manifest import read_manifest; "
            "from mmpipe.data.tokenizer import train_tokenizer; "
            "t = train_tokenizer([s.text for s in read_manifest(sys.argv[1])], 300, sys.argv[2]); "
            "print(json.dumps(sorted(t.get_vocab().items())))")
    outs = [subprocess.run([sys.executable, "-c", code, tiny_data["train"], str(tmp_path / f"t{i}")],
                           capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            for i in range(2)]
    assert outs[0] == outs[1] and len(json.loads(outs[0])) > 20


def test_reduced_size_jpeg_decode_stays_close_to_full_decode(tmp_path):
    """load_image decodes a large JPEG at 1/2 scale (draft); the result must match a full decode +
    the same resize/crop to within a few grey levels on average."""
    import numpy as np
    from PIL import Image

    from mmpipe.bench.data import make_photos
    from mmpipe.data.decode import load_image
    path = make_photos(str(tmp_path), 1, 640, 480, seed=3)[0]
    fast = load_image(path, 224)
    with Image.open(path) as im:
        im = im.convert("RGB").resize((224, 224), Image.BILINEAR, box=(80, 0, 560, 480))
    full = torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1)
    assert fast.shape == full.shape == (3, 224, 224) and fast.dtype == torch.uint8
    assert (fast.float() - full.float()).abs().mean() < 4.0
