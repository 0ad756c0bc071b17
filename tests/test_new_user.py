"""Wrong results and tracebacks found by trying mmpipe as a new user would (issue 9): each test
names the item it covers. Units first; the few launches are single-process or share runs."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from mmpipe.bench.common import free_port
import torch
from helpers import ROOT, TINY, TRAIN_PY, _env

import mmpipe
from mmpipe.cli.main import main
from mmpipe.data.pixels import SquarePixels
from mmpipe.errors import ConfigError, DataError


def _one_line_error(capsys, argv) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("mmpipe: error: ") and "Traceback" not in err, err
    return lines[0]


def _train_argv(tiny_data, out, *sets, flags=()):
    argv = ["--config", TINY, "--set", f"data.train={tiny_data['train']}", "--set", f"train.output_dir={out}",
            "--set", "parallel.pipeline_stages=1", "--set", "log.progress=false"]
    for s in sets:
        argv += ["--set", s]
    return argv + list(flags)


def _python_run(argv, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TRAIN_PY] + argv, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _error_lines(proc) -> list:
    return [line for line in proc.stderr.splitlines() if line.startswith("mmpipe: error:")]


# ---- item 2: the bad-sample record of a stream survives a resume --------------------------------------------
def test_stream_bad_fraction_counts_samples_drawn_before_the_resume():
    from mmpipe.data.badsamples import BadSampleLedger
    straight = BadSampleLedger(0.05, None)  # a stream: the limit applies to samples drawn (>= 400 of them)
    for step in range(10):  # 100 samples a step, 4 unusable (4%, under the 5% limit)
        straight.add([(f"s{step}/{i}", "cannot decode") for i in range(4)], 100)
        assert straight.error() is None
        if step == 4:
            saved = json.loads(json.dumps(straight.state_dict()))  # as a checkpoint stores it
    resumed = BadSampleLedger(0.05, None)
    resumed.load_state_dict(saved)
    for step in range(5, 10):
        resumed.add([(f"s{step}/{i}", "cannot decode") for i in range(4)], 100)
        assert resumed.error() is None, resumed.error()  # the old code divided 40 bad by 500 drawn: 8%
    assert (resumed.count, resumed.drawn) == (straight.count, straight.drawn) == (40, 1000)
    # the same file met again (another epoch, another rank) is one bad sample; over the limit it stops
    assert resumed.add([("s9/0", "again")], 0) == [] and resumed.count == 40
    resumed.add([(f"x{i}", "missing file") for i in range(30)], 0)
    assert "data.max_bad_fraction=0.05 exceeded: 70 of the 1000 samples drawn so far" in resumed.error()


def test_shard_run_resumed_keeps_counting_the_samples_drawn_before(tiny_data, tmp_path):
    """A real shard stream, stopped at step 2 and resumed to 4: the checkpoint's data position
    (samples drawn, bad files) carries on from the first invocation instead of restarting at 0."""
    from test_data import write_shards

    from mmpipe.data.manifest import read_manifest
    from mmpipe.train.checkpoint_record import read_record
    good = [(s.image, s.text) for s in read_manifest(tiny_data["train"]) if os.path.isfile(s.image)][:48]
    write_shards(str(tmp_path / "shards"), good, 12, bad_every=10)  # 4 shards, every 10th sample corrupt
    argv = _train_argv(tiny_data, tmp_path / "run", f"data.train={tmp_path}/shards/{{00000..00003}}.tar",
                       "train.steps=4", "data.shuffle_buffer=4", "data.max_bad_fraction=0.5")
    for flags in (["--stop-at", "2"], ["--resume"]):
        proc = _python_run(argv + flags)
        assert proc.returncode == 0, proc.stderr[-2000:]
    first = read_record(str(tmp_path / "run" / "checkpoints" / "global_step2"))["data"]
    final = read_record(str(tmp_path / "run" / "checkpoints" / "global_step4"))["data"]
    assert first["drawn"] >= 2 * 16 and final["drawn"] >= first["drawn"] + 2 * 16  # 16 samples a step, plus bad ones
    assert {p for p, _ in first["files"]} <= {p for p, _ in final["files"]}  # bad files found before still count


# ---- item 4: a fresh run into a directory that holds a run -------------------------------------------------
def test_fresh_run_into_a_used_run_dir_is_refused_and_overwrite_replaces_it(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    first = _python_run(_train_argv(tiny_data, out, "train.steps=2", "data.tokenizer_vocab_size=60"))
    assert first.returncode == 0, first.stderr[-2000:]
    old_vocab = json.load(open(out / "tokenizer" / "tokenizer.json"))["model"]["vocab"]
    # without --resume: one line, nothing touched
    line = _one_line_error(capsys, ["train"] + _train_argv(tiny_data, out, "train.steps=2"))
    assert f"train.output_dir={out} already holds a run (checkpoint global_step2)" in line
    assert "--resume" in line and "--overwrite" in line
    assert sorted(os.listdir(out / "checkpoints")) == ["global_step2", "latest"]
    line = _one_line_error(capsys, ["train"] + _train_argv(tiny_data, out, flags=["--resume", "--overwrite"]))
    assert "contradict" in line
    # --overwrite: a new run with its own tokenizer; 'latest' names a checkpoint that exists
    second = _python_run(_train_argv(tiny_data, out, "train.steps=3", "train.save_every=1", "train.keep_checkpoints=2",
                                     flags=["--overwrite"]))
    assert second.returncode == 0, second.stderr[-2000:]
    new_vocab = json.load(open(out / "tokenizer" / "tokenizer.json"))["model"]["vocab"]
    assert len(new_vocab) > len(old_vocab) == 60  # trained again (default 2000-word cap), not reused
    latest = open(out / "checkpoints" / "latest").read().strip()
    assert latest == "global_step3" and sorted(os.listdir(out / "checkpoints")) == ["global_step2", "global_step3",
                                                                                     "latest"]
    from mmpipe.train.metrics import read_metrics
    assert [r["step"] for r in read_metrics(str(out / "metrics.jsonl"))] == [1, 2, 3]


# ---- item 5: pretrained text weights and their tokenizer ------------------------------------------------------
def _tiny_clip_dir(path, vocab, eos):
    from transformers import CLIPConfig, CLIPModel
    cfg = CLIPConfig(text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                      vocab_size=vocab, max_position_embeddings=16, eos_token_id=eos,
                                      bos_token_id=None, pad_token_id=0),
                     vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=64, image_size=32, patch_size=8),
                     projection_dim=32)
    torch.manual_seed(0)
    model = CLIPModel(cfg).eval()
    model.save_pretrained(str(path))
    return model


@pytest.fixture(scope="module")
def legacy_clip(tmp_path_factory, tiny_data):
    """A CLIPModel saved with the legacy eos_token_id 2 and no tokenizer, and a WordPiece tokenizer
    (EOS = [SEP] = 3) that belongs to it."""
    from mmpipe.data.manifest import read_manifest
    from mmpipe.data.tokenizer import train_tokenizer
    d = tmp_path_factory.mktemp("legacy")
    tok = train_tokenizer([s.text for s in read_manifest(tiny_data["train"])], 300, str(d / "tok"))
    model = _tiny_clip_dir(d / "clip", len(tok), 2)
    return {"dir": d / "clip", "tok_dir": d / "tok", "tok": tok, "model": model}


def test_pretrained_text_weights_without_their_tokenizer_is_one_line(legacy_clip, tiny_data, tmp_path):
    proc = _python_run(_train_argv(tiny_data, tmp_path / "run", f"model.pretrained={legacy_clip['dir']}",
                                   "train.steps=1"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = _error_lines(proc)
    assert f"model.pretrained={legacy_clip['dir']} holds pretrained text weights but no tokenizer" in line
    assert "data.tokenizer" in line


def test_pretrained_dir_with_a_tokenizer_uses_it_and_pools_at_its_eos(legacy_clip, tmp_path):
    from transformers import CLIPModel

    from mmpipe.families.clip import ClipFamily
    from mmpipe.train.setup import prepare_tokenizer
    d = tmp_path / "clip_with_tok"
    shutil.copytree(legacy_clip["dir"], d)
    legacy_clip["tok"].save_pretrained(str(d))
    cfg = mmpipe.load_config(TINY, [f"model.pretrained={d}", f"train.output_dir={tmp_path / 'run'}"])
    tok = prepare_tokenizer(cfg, ClipFamily, 0)
    from mmpipe.config.schema import replace
    cfg = replace(cfg, model=ClipFamily.resolve(cfg.model, tok, cfg.data))
    assert len(tok) == len(legacy_clip["tok"]) and cfg.model.text.eos_token_id == 3  # the directory's own
    assert not os.path.exists(tmp_path / "run" / "tokenizer")  # none trained
    m = mmpipe.build_model(cfg).eval()
    # captions padded to 16 with [PAD]=0; the highest id is *not* the EOS, so transformers' legacy
    # argmax rule (config eos 2) would read a word; pooling must read [SEP], as transformers does for
    # a config that names this tokenizer's EOS
    enc = tok(["a red circle", "a large blue square at the top", "x"], padding="max_length", max_length=16,
              return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    eos_pos = (ids == 3).int().argmax(-1)
    assert (ids.argmax(-1) != eos_pos).any()
    ref = CLIPModel.from_pretrained(str(d)).eval()
    ref.config.text_config.eos_token_id = ref.text_model.eos_token_id = 3
    with torch.no_grad():
        torch.testing.assert_close(m.encode_text(ids, mask),
                                   ref.get_text_features(input_ids=ids, attention_mask=mask).pooler_output,
                                   atol=1e-5, rtol=0)
    # a tokenizer larger than the weights' vocabulary is not theirs: one line
    big = mmpipe.load_config(TINY, [f"model.pretrained={legacy_clip['dir']}", "model.text.pretrained=null"])
    from mmpipe.config.schema import family_of
    with pytest.raises(ConfigError, match="it is not their tokenizer"):
        from mmpipe.data.tokenizer import StandInTokenizer
        family_of(big).resolve(big.model, StandInTokenizer(5000), big.data)


def test_a_cache_must_hold_the_pretrained_weights_tokenizer_ids(legacy_clip, tiny_data, tmp_path):
    from mmpipe.data.cache import prepare
    from mmpipe.families.clip import ClipFamily
    from mmpipe.train.setup import prepare_tokenizer
    d = tmp_path / "clip_with_tok"
    shutil.copytree(legacy_clip["dir"], d)
    legacy_clip["tok"].save_pretrained(str(d))
    trained = str(tmp_path / "cache_trained")  # ids of a tokenizer trained on the captions
    prepare(tiny_data["train"], trained, 32, 16, vocab_size=50, workers=1, progress=False)
    cfg = mmpipe.load_config(TINY, [f"model.pretrained={d}", f"data.cache={trained}"])
    with pytest.raises(ConfigError, match="holds ids of a tokenizer trained on the captions"):
        prepare_tokenizer(cfg, ClipFamily, 0)
    theirs = str(tmp_path / "cache_theirs")  # built with the weights' own tokenizer: accepted
    prepare(tiny_data["train"], theirs, 32, 16, tokenizer=str(d), workers=1, progress=False)
    cfg = mmpipe.load_config(TINY, [f"model.pretrained={d}", f"data.cache={theirs}"])
    assert len(prepare_tokenizer(cfg, ClipFamily, 0)) == len(legacy_clip["tok"])
    from mmpipe.data.manifest import read_manifest
    from mmpipe.data.tokenizer import train_tokenizer
    train_tokenizer([s.text for s in read_manifest(tiny_data["train"])], 40, str(tmp_path / "small_tok"))
    other = str(tmp_path / "cache_other")  # built with another local tokenizer
    prepare(tiny_data["train"], other, 32, 16, tokenizer=str(tmp_path / "small_tok"), workers=1, progress=False)
    cfg = mmpipe.load_config(TINY, [f"model.pretrained={d}", f"data.cache={other}"])
    with pytest.raises(ConfigError, match="was built with a tokenizer other than the one in model.pretrained"):
        prepare_tokenizer(cfg, ClipFamily, 0)


# ---- item 6: a contrastive loss needs negatives ------------------------------------------------------------
def test_micro_batch_of_one_refused_for_contrastive_and_auto_never_picks_it(capsys, tiny_data, tmp_path):
    line = _one_line_error(capsys, ["train"] + _train_argv(tiny_data, tmp_path / "o", "parallel.micro_batch_size=1"))
    assert "parallel.micro_batch_size=1" in line and "no negatives" in line
    from mmpipe.planning.memory import pick_micro_batch
    peak = lambda m: 100 * m  # noqa: E731
    assert pick_micro_batch(8, peak, 250, min_size=2)[0] == 2  # not 1, though 1 fits too
    with pytest.raises(ConfigError, match="even a micro-batch of 2 needs"):
        pick_micro_batch(8, peak, 150, min_size=2)
    with pytest.raises(ConfigError, match="no divisor >= 2"):
        pick_micro_batch(1, peak, 10 ** 9, min_size=2)


# ---- item 7: degenerate features are not perfect recall -----------------------------------------------------
def test_recall_counts_ties_and_nan_as_misses():
    from mmpipe.families.clip.retrieval import retrieval_metrics
    for feats in (torch.zeros(10, 4), torch.full((10, 4), float("nan")), torch.ones(10, 4)):
        r = retrieval_metrics(feats, feats)
        assert r["i2t_r1"] == r["t2i_r1"] == r["i2t_r5"] == 0.0, r
    nan = retrieval_metrics(torch.full((10, 4), float("nan")), torch.randn(10, 4))
    assert nan["finite"] is False and nan["nonfinite"] == 10
    x = torch.randn(10, 4)
    good = retrieval_metrics(x, x)
    assert good["i2t_r1"] == good["t2i_r1"] == 1.0 and good["finite"] is True
    one_bad = x.clone()
    one_bad[3] = float("nan")
    r = retrieval_metrics(one_bad, x)
    assert r["i2t_r1"] == pytest.approx(0.9) and r["nonfinite"] == 1
    # a repeated caption (identical text features) is a tie: a miss, unless the captions say both are right
    t = x.clone()
    t[1] = t[0]
    captions = ["a red circle", "a red circle"] + [f"c{i}" for i in range(8)]
    assert retrieval_metrics(t, t)["i2t_r1"] == pytest.approx(0.8)
    assert retrieval_metrics(t, t, captions=captions)["i2t_r1"] == 1.0
    assert retrieval_metrics(torch.zeros(10, 4), torch.zeros(10, 4), captions=captions)["i2t_r1"] == 0.0


# ---- item 8: a profile cached without transfers is not reused as if transfers were free --------------------
def test_profile_cached_without_transfers_gets_them_measured(tmp_path, monkeypatch):
    from mmpipe.config.resolve import build_family
    from mmpipe.planning.measure import get_profile
    monkeypatch.setenv("MMPIPE_CACHE", str(tmp_path))
    cfg = mmpipe.load_config(TINY, ["model.text.vocab_size=60", "model.text.eos_token_id=3",
                                    "model.text.max_position_embeddings=16"])
    spec = build_family(cfg.model, 0)
    first = get_profile(cfg, spec, 4, measure_comm=False, repeats=1)
    assert first["comm"]["measured"] is False and first["comm"]["s_per_byte"] == 0.0
    second = get_profile(cfg, spec, 4, measure_comm=True, repeats=1)  # same key: the cache entry
    assert second["layers"] == first["layers"]  # layer costs reused ...
    assert second["comm"]["measured"] is True and second["comm"]["samples"]  # ... transfers measured
    third = get_profile(cfg, spec, 4, measure_comm=False, repeats=1)
    assert third["comm"]["measured"] is True  # the completed entry serves both from now on


# ---- item 10: lr per group, and one lr that does not depend on the layout ------------------------------------
def test_lr_record_names_every_group_and_scales_the_base_lr():
    from mmpipe.config.groups import resolve_groups
    from mmpipe.families.clip import ClipFamily
    from mmpipe.train.step_stats import lr_record
    groups = [g for g in resolve_groups(mmpipe.load_config(None, ["optim.lr=1e-3", "optim.groups.vision.lr=1e-4",
                                                                   "optim.freeze_text=true"]).optim, ClipFamily) if not g.frozen]
    assert [g.name for g in groups] == ["vision", "projector", "logit_scale"]
    # a stage holding only the vision group (the projector's and logit_scale's lr come from other ranks)
    rec = lr_record([5e-5, 5e-4, 5e-4], groups, 1e-3)
    assert rec == {"lr": pytest.approx(5e-4), "lr.vision": 5e-5, "lr.projector": 5e-4, "lr.logit_scale": 5e-4}
    rec = lr_record([math.nan, 5e-4, math.nan], groups, 1e-3)  # a rank that holds only the projector
    assert rec["lr"] == pytest.approx(5e-4) and "lr.vision" not in rec
    # a DeepSpeed-JSON scheduler (WarmupLR) sets one absolute lr on every group: that is the lr
    assert lr_record([math.nan, 2e-4, 2e-4], groups, 1e-3, ds_scheduler=True)["lr"] == 2e-4


# ---- item 13: more one-line errors ------------------------------------------------------------------------------
@pytest.mark.parametrize("setting,expect", [
    ("optim.lr=-0.001", "optim.lr must be >= 0, got -0.001"),
    ("optim.betas=[0.9]", "optim.betas must be [beta1, beta2]"),
    ("data.num_workers=-1", "data.num_workers must be >= 0"),
    ("optim.warmup_steps=-5", "optim.warmup_steps must be >= 0"),
    ("optim.min_lr_ratio=1.5", "optim.min_lr_ratio must be between 0 and 1"),
    ("optim.groups.text.lr=-1", "optim.groups.text.lr must be >= 0"),
])
def test_bad_numbers_are_one_line(capsys, tiny_data, tmp_path, setting, expect):
    line = _one_line_error(capsys, ["train"] + _train_argv(tiny_data, tmp_path / "o", setting))
    assert expect in line, line


def test_stop_at_zero_is_one_line(capsys, tiny_data, tmp_path):
    line = _one_line_error(capsys, ["train"] + _train_argv(tiny_data, tmp_path / "o", flags=["--stop-at", "0"]))
    assert "--stop-at 0" in line


def test_placement_mistakes_are_config_errors(tmp_path):
    from mmpipe.config.resolve import build_family
    from mmpipe.planning.place import parts_from_plan_file, place
    cfg = mmpipe.load_config(TINY, ["model.text.vocab_size=60", "model.text.eos_token_id=3",
                                    "model.text.max_position_embeddings=16"])
    family = build_family(cfg.model, 0)
    names, segments = family.layer_names(), family.segments()
    n = len(names)

    def plan_parts(_, stages, placement):
        return place(names, segments, stages, placement, 1, schedule="1f1b", param_costs=[1] * n).parts
    with pytest.raises(ConfigError, match=f"parallel.pipeline_stages={n + 1} is more than the model's {n} layers"):
        plan_parts(family, n + 1, "modality")
    with pytest.raises(ConfigError, match="parallel.placement=type:nomatch matches 0 layer"):
        plan_parts(family, 2, "type:nomatch")
    # DeepSpeed's rule (balance the matching layers) over layer names, as mmpipe plan shows it:
    # two transformer blocks per stage
    from mmpipe.planning.place import ds_parts
    assert plan_parts(family, 2, "type:blocks") == ds_parts(None, 2, "type:blocks", names) == [0, 6, n]
    for text in ("[1, 2]", "not json", '"stages"'):
        p = tmp_path / "plan.json"
        p.write_text(text)
        with pytest.raises(ConfigError, match="parallel.plan: "):
            parts_from_plan_file(str(p), names, 2)


def test_resume_on_another_layout_says_what_the_checkpoint_holds(runs, tmp_path):
    """A checkpoint without layout-free optimizer state (written before mmpipe saved it) resumes on
    its own layout only: another layout is one line saying what it holds. (With that state,
    tests/test_elastic.py resumes on other layouts.)"""
    import glob

    from test_parity import REF
    ref, _ = runs.get(*REF)
    out = tmp_path / "copy"
    shutil.copytree(ref, out)
    for pattern in ("optim_stage*.safetensors", "COMPLETE"):  # (nor completion markers, then)
        for f in glob.glob(str(out / "checkpoints" / "global_step*" / pattern)):
            os.remove(f)
    proc = _python_run(["--config", TINY, "--set", f"data.train={runs.data['train']}", "--set", f"train.output_dir={out}",
                        "--set", "parallel.pipeline_stages=1", "--resume"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = _error_lines(proc)
    assert ("was saved with pipeline_stages=2 data_parallel=1 zero_stage=0 precision=fp32 stages "
            "vision.embed..visual_projection") in line
    assert "this run has pipeline_stages=1" in line


# ---- item 14: an error on one rank reaches the user, once ---------------------------------------------------------
def test_an_error_raised_on_one_rank_is_printed_once(tiny_data, tmp_path):
    """One shard for two data-parallel ranks: only rank 1 has no shard. Its one-line error must
    reach the user (not rank 0's lost-connection traceback)."""
    from test_data import write_shards

    from mmpipe.data.manifest import read_manifest
    good = [(s.image, s.text) for s in read_manifest(tiny_data["train"]) if os.path.isfile(s.image)][:16]
    write_shards(str(tmp_path / "shards"), good, 16)  # all 16 in one shard
    shards = f"{tmp_path}/shards/00000.tar"
    port = str(free_port())
    proc = subprocess.run([shutil.which("deepspeed") or "deepspeed", "--num_gpus", "2", "--master_port", port, TRAIN_PY,
                           *_train_argv(tiny_data, tmp_path / "run", f"data.train={shards}")],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    errors = [line for line in log.splitlines() if "mmpipe: error:" in line]
    assert len(errors) == 1, log[-3000:]
    assert "[rank 1] data.train has 1 shards, fewer than the data-parallel degree 2" in errors[0]
    assert "Traceback" not in log and "Connection closed by peer" not in log


# ---- item 15: an error in a loader worker is one line, as without workers -----------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_loader_worker_error_is_one_line(tmp_path, capsys, workers):
    from torch.utils.data import DataLoader

    from mmpipe.cli.main import run_guarded
    from mmpipe.data.loader import ImageTextDataset
    from mmpipe.data.manifest import Sample
    ds = ImageTextDataset([Sample(str(tmp_path / f"missing{i}.jpg"), "a caption") for i in range(4)], SquarePixels(16))
    loader = DataLoader(ds, batch_size=2, num_workers=workers)

    def consume(_args):
        for _ in loader:
            pass
        return 0

    assert run_guarded(consume, None) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("mmpipe: error: no usable sample in the manifest"), err
    with pytest.raises(DataError) as e:
        consume(None)
    assert "\n" not in str(e.value)


# ---- item 16: closest-match hints -----------------------------------------------------------------------------
def test_unknown_key_hint_is_the_closest_match(capsys, tiny_data, tmp_path):
    line = _one_line_error(capsys, ["train"] + _train_argv(tiny_data, tmp_path / "o", "data.pad_mult=8"))
    assert "did you mean 'pad_multiple'" in line
    line = _one_line_error(capsys, ["train"] + _train_argv(tiny_data, tmp_path / "o", "=3"))
    assert "no key before '='" in line and "model" not in line
