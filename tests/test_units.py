"""Fast single-process tests of the parts: config, DeepSpeed-config resolution, topology,
partitioner, sampler, manifests, tokenizer, synthetic data, model <-> pipeline layers."""
from __future__ import annotations

import itertools
import json
import math
import os
import random

import pytest
import torch
from conftest import TINY

import mmpipe
from mmpipe.config.schema import load_config, reference
from mmpipe.errors import ConfigError, DataError


# ---- config --------------------------------------------------------------------------------
def test_load_config_and_overrides_track_explicit_keys():
    cfg = load_config(TINY, ["train.steps=7", "optim.lr=3e-3", "model.vision.hidden_size=64"])
    assert cfg.train.steps == 7 and cfg.optim.lr == pytest.approx(3e-3)
    assert cfg.model.vision.hidden_size == 64
    assert "train.steps" in cfg.explicit and "train.batch_size" in cfg.explicit  # from the file
    assert "train.seed" not in cfg.explicit


def test_inf_max_grad_norm_parses():
    assert load_config(None, ["optim.max_grad_norm=inf"]).optim.max_grad_norm == float("inf")


def test_reference_lists_every_key_with_help():
    ref = reference()
    for key in ("`model.vision.arch`", "`parallel.pipeline_stages`", "`train.deepspeed_config`", "`data.tokenizer`"):
        assert key in ref
    import re
    for row in ref.splitlines()[2:]:
        cells = re.split(r"(?<!\\)\|", row)[1:-1]
        assert len(cells) == 3 and cells[2].strip(), row


# ---- DeepSpeed config -------------------------------------------------------------------------
def _write(tmp_path, d):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(d))
    return str(p)


def test_auto_values_are_filled(tmp_path):
    from mmpipe.config.deepspeed import resolve
    path = _write(tmp_path, json.load(open(os.path.join(os.path.dirname(TINY), "..", "ds_configs", "auto.json"))))
    cfg = load_config(TINY, [f"train.deepspeed_config={path}", "train.precision=bf16", "optim.max_grad_norm=2.0"])
    ds, topo = resolve(cfg, world_size=4)
    assert ds["train_batch_size"] == 16 and ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["gradient_accumulation_steps"] == topo.accumulation_steps == 2
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    assert ds["gradient_clipping"] == 0.0  # mmpipe clips, DeepSpeed must not clip again
    assert ds["optimizer"]["params"]["lr"] == pytest.approx(1e-3)
    assert ds["zero_optimization"]["stage"] == 0


def test_concrete_json_value_is_adopted_when_run_config_is_silent(tmp_path):
    from mmpipe.config.deepspeed import resolve
    path = _write(tmp_path, {"gradient_clipping": 1.5, "train_micro_batch_size_per_gpu": 2})
    cfg = load_config(None, [f"train.deepspeed_config={path}", "train.batch_size=8"])
    ds, topo = resolve(cfg, world_size=1)
    assert cfg.optim.max_grad_norm == 1.5 and ds["gradient_clipping"] == 0.0
    assert cfg.parallel.micro_batch_size == 2 and topo.accumulation_steps == 4


def test_gradient_accumulation_mismatch(tmp_path):
    from mmpipe.config.deepspeed import resolve
    path = _write(tmp_path, {"gradient_accumulation_steps": 3})
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=3"):
        resolve(load_config(TINY, [f"train.deepspeed_config={path}"]), world_size=2)


def test_generated_config_when_no_json():
    from mmpipe.config.deepspeed import resolve
    ds, _ = resolve(load_config(TINY), world_size=2)
    assert ds["optimizer"]["type"] == "AdamW" and ds["gradient_accumulation_steps"] == 4


# ---- topology ----------------------------------------------------------------------------------
def test_topology_arithmetic_and_reporting_rank():
    from mmpipe.parallel.topology import Topology
    t = Topology(world_size=4, pipeline_stages=2, micro_batch_size=4, batch_size=32)
    assert (t.data_parallel, t.accumulation_steps) == (2, 4)
    assert t.coords(t.reporting_rank) == (1, 0)
    assert sorted(t.rank_of(s, d) for s in range(2) for d in range(2)) == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="does not divide the world size 3"):
        Topology(world_size=3, pipeline_stages=2, micro_batch_size=4, batch_size=32)


# ---- partitioner -------------------------------------------------------------------------------
def _brute(costs, P, mem=None, cap=None):
    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), P - 1):
        parts = [0, *cuts, n]
        segs = [(sum(costs[a:b]), sum((mem or [0] * n)[a:b])) for a, b in zip(parts, parts[1:])]
        if cap is not None and any(m > cap for _, m in segs):
            continue
        v = max(s for s, _ in segs)
        best = v if best is None else min(best, v)
    return best


@pytest.mark.parametrize("seed", range(25))
def test_min_max_partition_is_optimal(seed):
    from mmpipe.planning.partition import bottleneck, min_max_partition
    rng = random.Random(seed)
    n, P = rng.randint(3, 9), rng.randint(1, 4)
    if P > n:
        P = n
    costs = [rng.uniform(0.1, 10) for _ in range(n)]
    mem = [rng.uniform(0, 5) for _ in range(n)]
    cap = rng.choice([None, 8.0, 12.0])
    expect = _brute(costs, P, mem, cap)
    if expect is None:
        with pytest.raises(ValueError):
            min_max_partition(costs, P, memory=mem, memory_cap=cap)
        return
    parts = min_max_partition(costs, P, memory=mem, memory_cap=cap)
    assert parts[0] == 0 and parts[-1] == n and len(parts) == P + 1
    assert all(a < b for a, b in zip(parts, parts[1:]))
    assert bottleneck(costs, parts) == pytest.approx(expect)
    if cap is not None:
        assert all(sum(mem[a:b]) <= cap for a, b in zip(parts, parts[1:]))


@pytest.mark.parametrize("P", [2, 3, 4])
def test_modality_partition_never_mixes(P):
    from mmpipe.planning.partition import modality_partition
    costs = [5, 3, 3, 3, 3, 1, 1, 1, 1, 1]
    branches = ["image"] * 5 + ["text"] * 5
    parts = modality_partition(costs, branches, P)
    for a, b in zip(parts, parts[1:]):
        assert len(set(branches[a:b])) == 1
    # the costlier image branch gets at least as many stages as the text branch
    image_stages = sum(1 for a in parts[:-1] if branches[a] == "image")
    assert image_stages >= P - image_stages


def _brute_force_segmented(costs, segments, P):
    """Every split of the layers into P contiguous stages that never mixes segments: the best bottleneck."""
    import itertools
    n, best = len(costs), None
    for cut in itertools.combinations(range(1, n), P - 1):
        parts = [0, *cut, n]
        if any(len(set(segments[a:b])) > 1 for a, b in zip(parts, parts[1:])):
            continue
        worst = max(sum(costs[a:b]) for a, b in zip(parts, parts[1:]))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(8))
def test_modality_partition_with_k_segments_is_exact(seed):
    """vision | projector | llm (a VLM's segments): stages never mix segments, each gets at least
    one, and the slowest stage is as fast as the best of all such splits (brute force)."""
    import random

    from mmpipe.planning.partition import bottleneck, modality_partition
    rng = random.Random(seed)
    sizes = [rng.randint(1, 4), rng.randint(1, 2), rng.randint(2, 5)]
    segments = [t for t, k in zip(("vision", "projector", "llm"), sizes) for _ in range(k)]
    costs = [rng.randint(1, 9) for _ in segments]
    for P in range(3, len(costs) + 1):
        parts = modality_partition(costs, segments, P)
        assert len(parts) == P + 1 and all(a < b for a, b in zip(parts, parts[1:]))
        assert all(len(set(segments[a:b])) == 1 for a, b in zip(parts, parts[1:]))
        assert bottleneck(costs, parts) == _brute_force_segmented(costs, segments, P)
    # fewer stages than segments: stages hold whole segments (no boundary inside one), the best
    # such split: vision | projector + llm or vision + projector | llm, whichever is faster
    parts = modality_partition(costs, segments, 2)
    starts = {0, sizes[0], sizes[0] + sizes[1], len(costs)}
    assert set(parts) <= starts and len(parts) == 3
    best = min(bottleneck(costs, [0, b, len(costs)]) for b in (sizes[0], sizes[0] + sizes[1]))
    assert bottleneck(costs, parts) == best
    with pytest.raises(ValueError, match="contiguous"):
        modality_partition([1, 1, 1], ["vision", "llm", "vision"], 2)


def test_modality_partition_divides_stages_by_cost():
    from mmpipe.planning.partition import modality_partition
    costs = [3] * 4 + [1] + [3] * 6  # vision 12, projector 1, llm 18 over 5 stages
    segments = ["vision"] * 4 + ["projector"] + ["llm"] * 6
    assert modality_partition(costs, segments, 5) == [0, 2, 4, 5, 8, 11]  # 2 + 1 + 2 stages: slowest 9


# ---- sampler -----------------------------------------------------------------------------------
def test_micro_batches_are_layout_independent_and_resumable():
    from mmpipe.data.loader import MicroBatchSampler
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
    from mmpipe.data.loader import MicroBatchSampler
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
    from mmpipe.data.loader import eval_batches
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


# ---- model and pipeline layers -----------------------------------------------------------------
def _tiny_cfg():
    return load_config(TINY, ["model.text.vocab_size=50", "model.text.eos_token_id=3",
                              "model.text.max_position_embeddings=16"])


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    pix = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8, generator=g)
    ids = torch.randint(5, 50, (4, 16), generator=g)
    mask = torch.ones(4, 16, dtype=torch.int64)
    for i, n in enumerate((5, 9, 16, 3)):
        ids[i, n - 1] = 3
        ids[i, n:] = 0
        mask[i, n:] = 0
    return pix, ids, mask


def test_pipeline_layers_compute_the_plain_model():
    from mmpipe.config.registry import build_family
    from mmpipe.parallel.layers import PipeLayer, plain_state_key, run_sequential
    cfg = _tiny_cfg()
    model = mmpipe.build_model(cfg)
    family = build_family(cfg)
    layers = [PipeLayer(family, n) for n in family.layer_names()]  # each built alone, like a stage does
    sd = model.state_dict()
    for layer in layers:  # same initial weights, same names
        for k, v in layer.state_dict().items():
            assert torch.equal(v, sd[plain_state_key(layer.name, k)])
    assert sum(len(layer.state_dict()) for layer in layers) == len(sd)
    pix, ids, mask = _batch()
    loss = run_sequential(layers, (pix, ids, mask))
    torch.testing.assert_close(loss, model(pix, ids, mask), rtol=0, atol=0)
    for layer in layers:
        layer.eval()
    with torch.no_grad():
        feats = run_sequential(layers, (pix, ids, mask))
        d = feats.shape[1] // 2
        torch.testing.assert_close(feats[:, :d], model.encode_image(pix))
        torch.testing.assert_close(feats[:, d:], model.encode_text(ids, mask))


def test_padding_does_not_change_text_features():
    model = mmpipe.build_model(_tiny_cfg()).eval()
    _, ids, mask = _batch()
    with torch.no_grad():
        a = model.encode_text(ids, mask)
        ids2 = ids.clone()
        ids2[mask == 0] = 7  # garbage in padded positions must be ignored
        b = model.encode_text(ids2, mask)
    torch.testing.assert_close(a, b)


def test_uint8_pixels_are_normalised_on_device():
    from mmpipe.families.towers.common import (
        OPENAI_CLIP_MEAN,
        OPENAI_CLIP_STD,
        normalize_pixels,
    )
    model = mmpipe.build_model(_tiny_cfg()).eval()
    pix, _, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(model.encode_image(pix), model.encode_image(
            normalize_pixels(pix, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, torch.float32)))


def test_bert_and_resnet_towers_build_and_train_a_step():
    cfg = load_config(None, ["model.vision.arch=resnet", "model.vision.image_size=32", "model.text.arch=bert",
                             "model.text.hidden_size=32", "model.text.num_hidden_layers=1",
                             "model.text.num_attention_heads=2", "model.text.intermediate_size=64",
                             "model.text.vocab_size=50", "model.text.max_position_embeddings=16",
                             "model.projection_dim=16"])
    model = mmpipe.build_model(cfg)
    names = [n for n, _ in model.named_parameters()]
    assert "vision.blocks.3.1.conv2.weight" in names and any(n.startswith("text.blocks.0.attention") for n in names)
    pix, ids, mask = _batch()
    loss = model(pix, ids, mask)
    loss.backward()
    assert torch.isfinite(loss) and model.vision.embed.conv1.weight.grad is not None


def test_bad_tower_config_is_one_line():
    with pytest.raises(ConfigError, match="model.vision: .*attention heads"):
        mmpipe.build_model(load_config(None, ["model.vision.hidden_size=30", "model.vision.num_attention_heads=4",
                                              "model.text.vocab_size=10"]))
    with pytest.raises(ConfigError, match="model.text.pooling=pooler is BERT's pooler .* use eos, cls or mean"):
        mmpipe.build_model(load_config(None, ["model.text.pooling=pooler", "model.text.vocab_size=10"]))


def test_retrieval_metrics():
    from mmpipe.families.clip.retrieval import retrieval_metrics
    x = torch.eye(5)
    m = retrieval_metrics(x, x)
    assert m["i2t_r1"] == 1.0 and m["t2i_r1"] == 1.0 and m["chance_r1"] == 0.2
    m = retrieval_metrics(x, x.roll(1, dims=0))
    assert m["i2t_r1"] == 0.0 and m["i2t_r5"] == 1.0


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


def test_readme_config_reference_is_in_sync():
    readme = open(os.path.join(os.path.dirname(TINY), "..", "README.md")).read()
    a = readme.index("<!-- config-reference:start")
    table = readme[readme.index("\n", a) + 1:readme.index("<!-- config-reference:end -->")].strip()
    assert table == reference().strip(), "README config reference is stale: regenerate with mmpipe config --reference"


def test_reduced_size_jpeg_decode_stays_close_to_full_decode(tmp_path):
    """load_image decodes a large JPEG at 1/2 scale (draft); the result must match a full decode +
    the same resize/crop to within a few grey levels on average."""
    import numpy as np
    from PIL import Image

    from mmpipe.bench.data import make_photos
    from mmpipe.data.loader import load_image
    path = make_photos(str(tmp_path), 1, 640, 480, seed=3)[0]
    fast = load_image(path, 224)
    with Image.open(path) as im:
        im = im.convert("RGB").resize((224, 224), Image.BILINEAR, box=(80, 0, 560, 480))
    full = torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1)
    assert fast.shape == full.shape == (3, 224, 224) and fast.dtype == torch.uint8
    assert (fast.float() - full.float()).abs().mean() < 4.0


def test_a_resolved_config_is_derived_not_mutated_and_sealed():
    """Resolution (tokenizer fields, auto micro-batch) makes a new config; once sealed, any change is
    an error naming the field, and the config the user passed in is never touched."""
    from mmpipe.config.schema import family_of, replace
    cfg = mmpipe.load_config(TINY)
    before = cfg.to_dict()
    from mmpipe.data.tokenizer import StandInTokenizer
    model = family_of(cfg).resolve(cfg.model, StandInTokenizer(77), cfg.data)
    resolved = replace(cfg, model=model, parallel__micro_batch_size=2)
    assert cfg.to_dict() == before  # the input is unchanged
    assert resolved.model.text.vocab_size == 77 and resolved.parallel.micro_batch_size == 2
    resolved.seal()
    with pytest.raises(AttributeError, match="read-only: cannot set TrainConfig.steps"):
        resolved.train.steps = 3
    with pytest.raises(AttributeError, match="cannot set TextConfig.vocab_size"):
        resolved.model.text.vocab_size = 5
    again = replace(resolved, train__steps=3)  # a further derivation is writable again
    assert again.train.steps == 3 and resolved.train.steps == cfg.train.steps


def test_the_trainer_resolves_a_copy_and_leaves_the_callers_config_alone(tiny_data, tmp_path):
    """Validation adopts the DeepSpeed JSON's values and a stand-in for ``micro_batch_size: auto``
    into the run's own copy; the config object the caller passed is unchanged."""
    from mmpipe.train.setup import validate
    cfg = mmpipe.load_config(TINY, [f"data.train={tiny_data['train']}", f"train.output_dir={tmp_path / 'o'}",
                                    "parallel.micro_batch_size=auto", "train.deepspeed_config=ds_configs/auto.json",
                                    "parallel.pipeline_stages=1"])
    before = cfg.to_dict()
    run_cfg = validate(cfg, resume=False, stop_at=None, overwrite=False)[0]
    assert run_cfg is not cfg and run_cfg.parallel.micro_batch_size != "auto"
    assert cfg.to_dict() == before


def test_bench_pools_the_steps_of_every_round_and_keeps_the_middle_run(tmp_path):
    """A variant's measured step is the median over every round's steps after warm-up, so one round
    caught in a slow spell of the machine weighs only its share; idle and memory come from the run
    whose own median is the middle one."""
    from mmpipe.bench.common import pooled
    outs = []
    for i, steps in enumerate([[9.0, 1.0, 1.1, 1.2], [9.0, 2.0, 2.1, 2.2], [9.0, 1.3, 1.4, 1.5]]):
        d = tmp_path / f"r{i}"
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps({"kind": "train", "step": s + 1, "step_time": t}) + "\n"
                                                 for s, t in enumerate(steps)) + '{"kind": "eval", "step_time": 50}\n')
        outs.append(str(d))
    step, mid, medians = pooled(outs, warmup=1)
    assert step == pytest.approx(1.4)  # median of the 9 steps after warm-up; the best round alone would say 1.1
    assert mid == outs[2] and medians == pytest.approx([1.1, 2.1, 1.4])


def test_group_norms_of_fp16_gradients_are_taken_in_fp32():
    """A loss-scaled fp16 gradient whose norm passes 65504 with every element finite is not an overflow."""
    from mmpipe.train.clipping import sum_of_squares
    g = torch.full((10_000,), 1000.0, dtype=torch.float16)
    assert not torch.isfinite(torch._foreach_norm([g], 2.0)[0])  # what an fp16 norm gives
    assert math.isclose(sum_of_squares([g, g.bfloat16()]), 2 * 10_000 * 1000.0 ** 2, rel_tol=1e-4)
    assert not math.isfinite(sum_of_squares([torch.tensor([float("inf")], dtype=torch.float16)]))


def test_an_fp16_overflow_that_lowers_the_loss_scale_is_not_a_bad_step():
    from mmpipe.train.faults import counts_as_bad
    assert not counts_as_bad({"skipped": False}, None)
    assert counts_as_bad({"skipped": True}, None)  # fp32 / bf16: a non-finite gradient
    assert not counts_as_bad({"skipped": True, "loss_scale": 32768.0}, 65536.0)  # the scaler calibrating
    assert counts_as_bad({"skipped": True, "loss_scale": 1.0}, 1.0)  # at its floor: the run is broken


def test_every_number_of_the_config_has_a_range_checked_at_load():
    """Values that mean "never" or are out of range are one line naming the key and what it accepts."""
    import dataclasses
    import typing

    from mmpipe.config.schema import RunConfig
    for f in dataclasses.fields(RunConfig):
        if f.name == "model" or f.metadata.get("internal"):
            continue
        section = typing.get_type_hints(RunConfig)[f.name]
        if not dataclasses.is_dataclass(section):
            continue
        hints = typing.get_type_hints(section)
        for g in dataclasses.fields(section):
            kinds = typing.get_args(hints[g.name]) or (hints[g.name],)
            if (int in kinds or float in kinds) and str not in kinds:
                assert g.metadata.get("range"), f"{f.name}.{g.name} declares no range"
    from mmpipe.config.schema import validate
    for key, value, shown, accepts in (("train.max_bad_steps", -1, "-1", ">= 0"),
                                       ("train.save_every_minutes", -1, "-1.0", "> 0"),
                                       ("train.collective_timeout_minutes", -1, "-1.0", "> 0"),
                                       ("log.every", 0, "0", ">= 1"), ("data.shuffle_buffer", 0, "0", ">= 1"),
                                       ("parallel.memory_budget_gb", 0, "0.0", "> 0"),
                                       ("model.vision.hidden_size", 0, "0", ">= 1")):
        with pytest.raises(ConfigError, match=rf"{key}={shown} is out of range: it accepts {accepts} \("):
            validate(load_config(TINY, [f"{key}={value}"]))


def test_a_launchers_omp_default_does_not_cut_a_cpu_ranks_threads():
    from mmpipe.parallel.topology import cpu_threads
    assert cpu_threads(2, 16, env={}, parent_env=set())[0] == 8
    # torchrun / accelerate launch export OMP_NUM_THREADS=1 for their ranks: not in the launcher's own env
    threads, why = cpu_threads(2, 16, env={"OMP_NUM_THREADS": "1"}, parent_env={"PATH"})
    assert threads == 8 and "came from the launcher" in why
    # the user's own setting (the launcher was started with it) is honoured
    assert cpu_threads(2, 16, env={"OMP_NUM_THREADS": "3"}, parent_env={"OMP_NUM_THREADS"}) == (3, "OMP_NUM_THREADS=3")


def test_bench_groups_baseline_row_says_what_it_measures():
    """Its runs take every group's norm each step (the skip check); the label must not say "no norms"."""
    from mmpipe.bench.groups import GROUP_VARIANTS
    label, sets = GROUP_VARIANTS[0]
    assert "norms still taken" in label and "no norms" not in label
    assert not [s for s in sets if "max_grad_norm" in s or "grad_norm=false" in s]
    assert all(any("max_grad_norm" in s for s in v) for _, v in GROUP_VARIANTS[1:])
