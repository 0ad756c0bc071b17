"""The data sources in real multi-process runs: a cached run reproduces the decoding run exactly,
and WebDataset shards give each data-parallel rank a disjoint part of the samples (P = 2 x DP = 2)."""
from __future__ import annotations

import json
import os
import re

import numpy as np
from helpers import TINY, train_losses
from test_data import write_shards
from test_parity import REF, _weights, assert_weights_close


def test_cached_run_reproduces_the_decoding_run(runs, tiny_data, tmp_path_factory):
    from mmpipe.config.schema import load_config
    from mmpipe.data.cache import prepare
    cfg = load_config(TINY)
    cache = str(tmp_path_factory.mktemp("cache") / "c")
    prepare(tiny_data["train"], cache, 32, cfg.data.max_length, vocab_size=cfg.data.tokenizer_vocab_size, workers=2,
            progress=False)
    ref = runs.get(*REF)[0]
    out, proc = runs.get("p2_cache", 2, ["parallel.pipeline_stages=2", f"data.cache={cache}"], flags=["--stop-at", "4"])
    np.testing.assert_allclose(train_losses(out), train_losses(ref)[:4], rtol=1e-6)
    assert_weights_close(_weights(out, 4), _weights(ref, 4), rtol=1e-6, atol=1e-7)
    assert "corrupt.jpg" in proc.stdout + proc.stderr  # unusable rows are still named and counted


def test_shards_give_each_data_parallel_rank_disjoint_samples(runs, tiny_data, tmp_path_factory):
    from mmpipe.data.manifest import read_manifest
    from mmpipe.train.metrics import read_metrics
    good = [(s.image, s.text) for s in read_manifest(tiny_data["train"]) if os.path.isfile(s.image)][:64]
    shard_dir = tmp_path_factory.mktemp("shards")
    write_shards(str(shard_dir), good, 8, bad_every=20)
    out, proc = runs.get("p2dp2_shards", 4, [
        "parallel.pipeline_stages=2", f"data.train={shard_dir}/{{00000..00007}}.tar", "data.num_workers=2",
        "data.log_samples=true", "data.shuffle_buffer=4", "train.steps=3", "train.eval_every=0"])
    recs = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in recs] == [1, 2, 3]
    # global ranks 0 and 1 are stage 0 of data-parallel replicas 0 and 1: the only data readers
    files = sorted(os.listdir(os.path.join(out, "samples")))
    assert files == ["rank0.jsonl", "rank1.jsonl"]
    seen = {}
    for f, dp in zip(files, (0, 1)):
        lines = [json.loads(line) for line in open(os.path.join(out, "samples", f))]
        assert len(lines) == 3 * 2  # 3 steps x 2 micro-batches of 4 on each rank: the same count
        assert [r["step"] for r in lines] == [1, 1, 2, 2, 3, 3] and {(r["rank"], r["stage"]) for r in lines} == {(dp, 0)}
        keys = [k for r in lines for k in r["keys"]]
        assert len(keys) == len(set(keys)) == 24
        shards = {int(k.split("/")[0][:5]) for k in keys}
        assert all(s % 2 == dp for s in shards)  # rank r reads shards r, r+2, ...
        seen[dp] = set(keys)
    assert not seen[0] & seen[1]
    # every bad sample counted once: as many as the distinct files the warnings name (and some are)
    named = set(re.findall(r"skipped bad sample (\S+): cannot decode", proc.stdout + proc.stderr))
    assert recs[-1]["bad_samples"] == len(named) >= 1


def test_auto_micro_batch_in_a_pipelined_run(runs, tiny_data, tmp_path_factory):
    """micro_batch_size: auto on a budget between the peaks of micro-batches 4 and 8 picks 4
    (accumulation 4) on every rank, and the run trains with it."""
    import torch

    from mmpipe.config.resolve import build_family
    from mmpipe.config.schema import load_config
    from mmpipe.data.manifest import read_manifest
    from mmpipe.data.source import TrainSource
    from mmpipe.data.tokenizer import eos_id, train_tokenizer
    from mmpipe.planning.measure import build_layers
    from mmpipe.planning.memory import stage_memory
    from mmpipe.planning.micro_batch import probe_batch
    from mmpipe.planning.profiler import profile_layers
    samples = read_manifest(tiny_data["train"])
    tok_dir = str(tmp_path_factory.mktemp("tok_auto"))
    tok = train_tokenizer([s.text for s in samples], 300, tok_dir)
    cfg = load_config(TINY, [f"model.text.vocab_size={len(tok)}", f"model.text.eos_token_id={eos_id(tok)}",
                             "model.text.max_position_embeddings=16", f"data.tokenizer={tok_dir}"])
    family = build_family(cfg.model, 0)
    # the split the probe costs: one stage per half of the layers
    n = len(family.layer_names())
    parts = [0, round(n / 2), n]
    layers = build_layers(family)
    source = TrainSource("manifest", samples=samples)
    peaks = {m: max(stage_memory(profile_layers(layers, probe_batch(cfg, family, source, tok, m, torch.device("cpu")),
                                                timed=False), parts, 16 // m, "fp32")) for m in (4, 8)}
    budget_gb = (peaks[4] + peaks[8]) / 2 / 2**30
    out, proc = runs.get("p2_mbs_auto", 2, ["parallel.pipeline_stages=2", "parallel.micro_batch_size=auto",
                                        f"parallel.memory_budget_gb={budget_gb}", f"data.tokenizer={tok_dir}",
                                        "train.steps=2", "train.eval_every=0"])
    log = proc.stdout + proc.stderr
    assert "parallel.micro_batch_size=auto -> 4 (accumulation 4)" in log
    assert len(train_losses(out)) == 2
    import yaml
    assert yaml.safe_load(open(os.path.join(out, "config.yaml")))["parallel"]["micro_batch_size"] == 4


def test_bad_val_samples_are_counted_and_a_val_set_with_none_usable_stops_every_rank_at_once(runs, tiny_data,
                                                                                             tmp_path):
    """Stage 0 decodes the val set; the last stage waits for it. A corrupt or missing val image is
    skipped (replaced by the next usable sample, as in training), named once and counted in the eval
    record; a val set with no usable sample stops every rank within seconds with one line, not at the
    collective timeout (30 minutes here)."""
    import time

    import pytest
    from helpers import launch

    from mmpipe.train.metrics import read_metrics
    good = [json.loads(line) for line in open(tiny_data["val"])][:6]
    bad = [{"image": "images/corrupt.jpg", "text": "a red circle"},
           {"image": "images/does_not_exist.jpg", "text": "a blue square"}]
    some = tmp_path / "val_some_bad.jsonl"
    some.write_text("".join(json.dumps({**r, "image": os.path.join(tiny_data["dir"], r["image"])}) + "\n"
                            for r in good + bad))
    out = str(tmp_path / "val_bad")
    args = runs.base(out, "--set", "parallel.pipeline_stages=2", "--set", "train.steps=2",
                     "--set", "train.collective_timeout_minutes=30")
    proc = launch(2, args + ["--set", f"data.val={some}"])
    log = proc.stdout + proc.stderr
    assert log.count("skipped bad val sample") == 2 and "corrupt.jpg" in log and "does_not_exist.jpg" in log
    assert read_metrics(os.path.join(out, "metrics.jsonl"), kind="eval")[-1]["val_bad_samples"] == 2
    none = tmp_path / "val_none_usable.jsonl"
    none.write_text("".join(json.dumps({**r, "image": os.path.join(tiny_data["dir"], r["image"])}) + "\n" for r in bad))
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as e:
        launch(2, args + ["--set", f"data.val={none}", "--set", f"train.output_dir={out}_none"])
    assert time.monotonic() - t0 < 60
    lines = [line for line in str(e.value).splitlines() if line.startswith("mmpipe: ")]
    assert len(lines) == 1 and "no usable sample" in lines[0], str(e.value)[-2000:]
