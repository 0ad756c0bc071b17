"""Resume on another layout: the P = 2 reference's step-4 checkpoint (weights, fp32 masters, both
Adam moments, schedule, data position) continued at P = 1, P = 3 and P = 2 x DP = 2 with ZeRO-1
reproduces the straight P = 2 run's steps 5-6 (losses and weights, rtol 1e-5)."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from helpers import TINY_CONFIGS, launch
from test_parity import assert_weights_close, reference

from mmpipe.train.checkpoint_weights import load_model_weights
from mmpipe.train.metrics import read_metrics


def _from_step4(ref: str, out: str) -> None:
    """A run directory holding the reference's checkpoints up to step 4 (latest = step 4)."""
    os.makedirs(out)
    shutil.copytree(os.path.join(ref, "checkpoints"), os.path.join(out, "checkpoints"),
                    ignore=shutil.ignore_patterns("global_step6"))
    with open(os.path.join(out, "checkpoints", "latest"), "w") as fh:
        fh.write("global_step4")
    for f in ("tokenizer", "config.yaml", "metrics.jsonl"):
        src = os.path.join(ref, f)
        (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, os.path.join(out, f))


@pytest.mark.parametrize("family", list(TINY_CONFIGS))  # every built-in (the toy family's layouts: covered by them)
@pytest.mark.parametrize("key,nprocs,launcher,sets", [
    ("el_p1", 1, "python", ["parallel.pipeline_stages=1"]),
    ("el_p3", 3, "deepspeed", ["parallel.pipeline_stages=3"]),
    ("el_p2dp2_z1", 4, "deepspeed", ["parallel.pipeline_stages=2", "parallel.zero_stage=1"]),
])
def test_resume_on_another_layout(family, family_runs_of, tmp_path, key, nprocs, launcher, sets):
    if family == "qwen2_5_vl" and not os.environ.get("MMPIPE_ALL_LAYOUTS"):
        pytest.skip("by hand with MMPIPE_ALL_LAYOUTS=1 (CI's time; the layout-free resume path is the same code as "
                    "CLIP's and the VLM's, and Qwen2.5-VL's own resume runs in test_parity.py)")
    if family == "qwen2_5_vl" and key != "el_p2dp2_z1":
        pytest.skip("Qwen2.5-VL's move onto data parallel with ZeRO-1 (by hand)")
    if family == "siglip":
        pytest.skip("SigLIP's layout-free resume is the clip family's code (its moves run here); its resume at P = 2 "
                    "runs in test_parity.py (CI's time: the suite is over its 45-minute target)")
    if family == "qwen3_5":
        pytest.skip("Qwen3.5's move onto P = 1: tests/test_qwen3_5.py, beside its reference run (made once per CI "
                    "worker); the layout-free resume path is every family's")
    if family == "qwen3_vl":
        pytest.skip("Qwen3-VL's layouts and its P = 2 reference: tests/test_qwen3_vl.py (CI's time); the layout-free "
                    "resume path is every family's, its checkpoint names Qwen3.5's and Qwen2.5-VL's")
    if family in ("qwen3_5_moe", "qwen3_vl_moe"):
        pytest.skip("the MoE families' layouts beside their reference run: tests/test_qwen_moe.py (CI's time); the "
                    "layout-free resume path is every family's, their checkpoint names Qwen3.5's and Qwen3-VL's")
    if family == "vlm" and key != "el_p2dp2_z1":
        pytest.skip("the VLM's moves to P = 1 and P = 3: tests/test_resume_matrix.py (P2 -> P1) and "
                    "tests/test_lora.py (P1 -> P2); here its move onto data parallel with ZeRO-1 (CI's time)")
    check_resume_on_another_layout(family_runs_of(family), tmp_path, key, nprocs, launcher, sets)


def check_resume_on_another_layout(runs, tmp_path, key, nprocs, launcher, sets, ref=None):
    """The reference's (``ref``: a run directory; by default the P = 2 reference) step-4 checkpoint continued on the
    layout ``sets``: its steps 5-6 (losses, weights)."""
    ref = ref or reference(runs)
    out = str(tmp_path / key)
    _from_step4(ref, out)
    args = runs.base(out)
    for s in sets:
        args += ["--set", s]
    proc = launch(nprocs, args + ["--resume"], launcher, env=runs.env)
    assert "resume@4" in proc.stdout + proc.stderr
    got = {r["step"]: r["loss"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))}
    want = {r["step"]: r["loss"] for r in read_metrics(os.path.join(ref, "metrics.jsonl"))}
    np.testing.assert_allclose([got[5], got[6]], [want[5], want[6]], rtol=1e-5)
    assert_weights_close(load_model_weights(os.path.join(out, "checkpoints"), "global_step6"),
                         load_model_weights(os.path.join(ref, "checkpoints"), "global_step6"), rtol=1e-5, atol=1e-6)
