"""ZeRO-2 and ZeRO-3 at P = 1 (2 data-parallel ranks, CPU + gloo): they train, DeepSpeed's global
clip is active and equals mmpipe's own clip, and their checkpoints read back and resume.

The reference is mmpipe's P = 1 ZeRO-0 run at DP = 2 with the same ``optim.max_grad_norm``, clipped
by mmpipe's ``GradClipper`` (factor min(1, limit / (norm + 1e-6))). Under ZeRO-2/3 DeepSpeed clips
instead, dividing by max(1, (norm + 1e-6) / limit): the same factor, computed in float32 rather
than float64 and applied as a division, so runs agree to float rounding (rtol 1e-5). The limit is
small enough to bind at every step (checked), and the clipped run differs from an unclipped one.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from helpers import TINY

from mmpipe.config.schema import load_config
from mmpipe.train.checkpoint_weights import load_model_weights
from mmpipe.train.metrics import read_metrics

LIMIT = 0.05
P1 = ["parallel.pipeline_stages=1", f"optim.max_grad_norm={LIMIT}", "log.grads=[1,3]"]


@pytest.fixture(scope="module")
def zero3_json(tmp_path_factory):
    """ZeRO-3 that really partitions the tiny model: DeepSpeed keeps parameters under
    ``stage3_param_persistence_threshold`` (default 1e5 elements, i.e. all of them here) whole."""
    p = tmp_path_factory.mktemp("zero3") / "zero3.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    return str(p)


def _reference(runs):
    """ZeRO-0, DP = 2, mmpipe clips; 6 steps with checkpoints at 3 and 6."""
    return runs.get("z0_clip", 2, P1 + ["train.save_every=3"])[0]


def _zero3(runs, zero3_json):
    """ZeRO-3, DP = 2, DeepSpeed clips: --stop-at 3, then --resume to step 6."""
    return runs.resume("z3_clip", 2, P1 + ["parallel.zero_stage=3", f"train.deepspeed_config={zero3_json}"])


def _weights(out, step):
    return load_model_weights(os.path.join(out, "checkpoints"), f"global_step{step}")


def _assert_same_weights(a, b, rtol=1e-5, atol=1e-6):
    assert set(a) == set(b)  # every parameter and buffer, in the plain model's names
    for k in b:
        torch.testing.assert_close(a[k].float(), b[k].float(), rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


def _assert_clipped_like_reference(out, ref, steps):
    recs = read_metrics(os.path.join(out, "metrics.jsonl"))
    ref_recs = read_metrics(os.path.join(ref, "metrics.jsonl"))[:steps]
    assert len(recs) == steps
    losses = [r["loss"] for r in recs]
    assert np.isfinite(losses).all()
    np.testing.assert_allclose(losses, [r["loss"] for r in ref_recs], rtol=1e-5)
    for r, rr in zip(recs, ref_recs):
        # the limit binds at every step (pre-clip norms, mmpipe's and DeepSpeed's)
        assert rr["grad_norm"] > 2 * LIMIT and rr["clip_coef"] < 0.5
        assert r["grad_norm"] == pytest.approx(rr["grad_norm"], rel=1e-5)
        assert r["clip_coef"] == pytest.approx(rr["clip_coef"], rel=1e-5)


# ---- fast: the resolved config passes DeepSpeed's own validation ----------------------------------------
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_config_validates_and_clips_where_it_should(stage):
    from deepspeed.runtime.zero.config import get_zero_config

    from mmpipe.config.deepspeed import resolve
    cfg = load_config(TINY, P1 + [f"parallel.zero_stage={stage}"])
    ds, _ = resolve(cfg, world_size=2)
    zero = get_zero_config(ds)  # raised for ZeRO-3: "compute_grad_norm=false is supported only with ZeRO 1 or 2"
    if stage == 1:  # mmpipe clips; DeepSpeed computes no norm (its per-group collectives would not pair up)
        assert ds["gradient_clipping"] == 0.0 and zero.compute_grad_norm is False
    else:  # DeepSpeed clips globally and needs its norm for that (ZeRO-2 raised at initialize)
        assert ds["gradient_clipping"] == LIMIT and zero.compute_grad_norm is True


# ---- multi-process ----------------------------------------------------------------------------------------
def test_zero2_trains_clips_and_reads_back(runs):
    ref = _reference(runs)
    out, _ = runs.get("z2_clip", 2, P1 + ["parallel.zero_stage=2"], flags=["--stop-at", "3"])
    with open(os.path.join(out, "ds_config.json")) as fh:
        ds = json.load(fh)
    assert ds["zero_optimization"]["stage"] == 2 and ds["gradient_clipping"] == LIMIT
    _assert_clipped_like_reference(out, ref, 3)
    _assert_same_weights(_weights(out, 3), _weights(ref, 3))
    _assert_same_grads(out, ref, (1, 3))


def _assert_same_grads(out, ref, steps):
    """``log.grads`` under ZeRO-2/3 (DeepSpeed's reduced partitions, before its clip) = ZeRO-0's (mmpipe's)."""
    from mmpipe.train.grad_dump import compare_grads, load_grads
    for step in steps:
        got, want = load_grads(out, step), load_grads(ref, step)
        diff = compare_grads(got, want, floor=1e-6)
        assert want and not diff["missing"] and not diff["extra"] and diff["global"] < 1e-5, (step, diff["worst"])


def test_zero3_trains_clips_reads_back_and_resumes(runs, zero3_json):
    ref = _reference(runs)
    out, proc = _zero3(runs, zero3_json)
    assert "resume@3" in proc.stdout + proc.stderr
    ckpt = os.path.join(out, "checkpoints", "global_step3")
    assert not any(f.startswith("mp_rank_") for f in os.listdir(ckpt))  # partitioned: zero_pp_rank_* only
    _assert_clipped_like_reference(out, ref, 6)
    _assert_same_weights(_weights(out, 3), _weights(ref, 3))
    _assert_same_weights(_weights(out, 6), _weights(ref, 6))
    _assert_same_grads(out, ref, (1, 3))  # (step 3 by the first launch; log.grads kept across the resume)


def test_zero3_clip_is_active(runs, zero3_json):
    """The clipped ZeRO-3 weights are not what an unclipped run gives (P = 1 reference of test_groups)."""
    clipped = _weights(_zero3(runs, zero3_json)[0], 3)
    unclipped = _weights(runs.get("lim_none", 1, ["parallel.pipeline_stages=1"], "python",
                                  flags=["--stop-at", "3"])[0], 3)
    diff = max(float((clipped[k].detach().float() - unclipped[k].detach().float()).abs().max()) for k in unclipped)
    assert diff > 1e-3


def test_zero3_vlm_with_text_only_micro_batches_trains_as_zero0(family_runs_of, zero3_json):
    """DP = 2, micro-batch 1, a third of the samples text-only: one rank's micro-batch holds an image while the
    other's holds none. Each vision block then runs on one zero row (output unused), so both ranks gather the
    same ZeRO-3 parameters: no hang (DeepSpeed #7170), and the losses are ZeRO-0's."""
    runs = family_runs_of("vlm")
    sets = ["parallel.pipeline_stages=1", "parallel.micro_batch_size=1", "train.collective_timeout_minutes=2"]
    z0 = runs.get("z0_vlm_mb1", 2, sets, flags=["--stop-at", "3"])[0]
    z3 = runs.get("z3_vlm_mb1", 2, sets + ["parallel.zero_stage=3", f"train.deepspeed_config={zero3_json}",
                                          "data.log_samples=true"], flags=["--stop-at", "3"])[0]
    # the case happened: some micro-batch slot where one rank's sample has an image and the other's none
    has_image = {f"{runs.data['train']} line {n}": bool(json.loads(line).get("images"))
                 for n, line in enumerate(open(runs.data["train"]), 1) if line.strip()}
    drawn = [[has_image[k] for r in map(json.loads, open(os.path.join(z3, "samples", f"rank{rank}.jsonl")))
              for k in r["keys"]] for rank in (0, 1)]
    assert any(a != b for a, b in zip(*drawn)), drawn
    a, b = [r["loss"] for r in read_metrics(os.path.join(z3, "metrics.jsonl"))], \
        [r["loss"] for r in read_metrics(os.path.join(z0, "metrics.jsonl"))]
    assert len(a) == len(b) == 3
    np.testing.assert_allclose(a, b, rtol=1e-5)
