"""Resume is exact after a change of layout, precision path or frozen group: a run stopped at step 3
and resumed under another layout gives the straight run's losses at steps 4-6 and its weights at
step 6 (fp32: rtol 1e-5; bf16: the layouts' own rounding differences, far below what a lost master
or moment costs), and keeps its records (bad samples, samples seen, skipped steps). Plus: a resume
with another ``train.batch_size`` trains every sample of the epoch once.

Each case's source run (the straight reference, checkpoints at steps 3 and 6) is launched once and
shared by the cases that move from it; the VLM is the family here (its tied embeddings cross the
stages, and its groups are the ones users freeze); CLIP's fp32 moves are ``test_elastic``'s."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from helpers import TINY_VLM, launch

from mmpipe.train.checkpoint_weights import load_model_weights
from mmpipe.train.metrics import read_metrics

LAYOUTS = {  # name -> (processes, launcher, settings)
    "P1": (1, "python", ["parallel.pipeline_stages=1"]),
    "P2": (2, "deepspeed", ["parallel.pipeline_stages=2"]),
    "DP2Z1": (2, "deepspeed", ["parallel.pipeline_stages=1", "parallel.zero_stage=1"]),
    "DP2Z3": (2, "deepspeed", ["parallel.pipeline_stages=1", "parallel.zero_stage=3"]),
}
FREEZE = {"none": [], "freeze_llm": ["optim.freeze_llm=true"], "freeze_vit": ["optim.freeze_vit=true"]}
CASES = [  # (precision, frozen, from, to)
    ("bf16", "none", "P1", "P2"),  # FP16_UnfusedOptimizer -> BF16_Optimizer: "continue on more GPUs"
    ("bf16", "none", "P1", "DP2Z3"),  # ZeRO-3: partitioned weights, optimizer state before its first step
    ("bf16", "none", "P2", "P1"),  # BF16_Optimizer -> FP16_UnfusedOptimizer (its next save must work)
    ("bf16", "freeze_vit", "P1", "P2"),
    ("bf16", "freeze_llm", "DP2Z1", "P1"),
    ("fp32", "freeze_llm", "P2", "P1"),  # the last stage holds no optimizer state: Adam's step from stage 0
]
_sources: dict = {}


def _args(data, out, precision, frozen, layout, *extra):
    args = ["--config", TINY_VLM, "--set", f"data.train={data['train']}", "--set", f"train.output_dir={out}",
            "--set", "train.steps=6", "--set", "train.save_every=3", "--set", "train.keep_checkpoints=0",
            "--set", f"train.precision={precision}", "--set", "optim.lr=3e-3", "--set", "data.log_samples=true"]
    for s in FREEZE[frozen] + LAYOUTS[layout][2] + list(extra):
        args += ["--set", s]
    return args


def _source(data, tmp_path_factory, precision, frozen, layout) -> str:
    key = (precision, frozen, layout)
    if key not in _sources:
        out = str(tmp_path_factory.mktemp("resume_src") / "_".join(key))
        n, launcher, _ = LAYOUTS[layout]
        launch(n, _args(data, out, precision, frozen, layout), launcher)
        _sources[key] = out
    return _sources[key]


def _copy_to_step3(src: str, out: str) -> None:
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("global_step6", "samples"))
    with open(os.path.join(out, "checkpoints", "latest"), "w") as fh:
        fh.write("global_step3")


def _records(out: str) -> dict:
    return {r["step"]: r for r in read_metrics(os.path.join(out, "metrics.jsonl"))}


def _flat(sd: dict, keys) -> torch.Tensor:
    return torch.cat([sd[k].float().flatten() for k in keys])


@pytest.fixture(scope="module")
def image_chat_data(tmp_path_factory):
    """60 chat samples that all hold an image, plus a missing and a corrupt image (bad samples the
    ledger must carry across the resume). Every micro-batch holds images: under ZeRO-3 one without
    takes another forward path on one rank than on the other, which hangs DeepSpeed's parameter
    gathering (a known ZeRO-3 limitation, DeepSpeed #7170), whatever the resume."""
    from mmpipe.data.synth import synth_vlm
    out = tmp_path_factory.mktemp("imagechat")
    info = synth_vlm(str(out), 60, val_fraction=0.1, size=32, seed=2, text_only=0.0, progress=False)
    (out / "images" / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg at all" * 3)
    turn = [{"role": "user", "content": "<image>\nwhat colour is the shape?"}, {"role": "assistant", "content": "red"}]
    with open(info["train"], "a") as fh:
        for image in ("images/does_not_exist.jpg", "images/corrupt.jpg"):
            fh.write(json.dumps({"messages": turn, "images": [image]}) + "\n")
    return {"dir": str(out), "train": info["train"], "val": info["val"]}


@pytest.mark.parametrize("precision,frozen,src,dst", CASES, ids=["-".join(c) for c in CASES])
def test_resume_on_another_layout_is_exact(image_chat_data, tmp_path_factory, tmp_path, precision, frozen, src, dst):
    ref = _source(image_chat_data, tmp_path_factory, precision, frozen, src)
    out = str(tmp_path / "resumed")
    _copy_to_step3(ref, out)
    n, launcher, _ = LAYOUTS[dst]
    proc = launch(n, _args(image_chat_data, out, precision, frozen, dst) + ["--resume"], launcher)
    assert "resume@3" in proc.stdout + proc.stderr
    got, want = _records(out), _records(ref)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    rtol = 1e-5 if precision == "fp32" else 1e-2  # bf16: another layout rounds differently
    np.testing.assert_allclose([got[s]["loss"] for s in (4, 5, 6)], [want[s]["loss"] for s in (4, 5, 6)], rtol=rtol)
    assert want[3]["bad_samples"] > 0  # the ledger has something to carry across the resume
    for field in ("bad_samples", "samples_seen", "skipped_steps"):
        assert got[6][field] == want[6][field], field
    ck, ck_ref = os.path.join(out, "checkpoints"), os.path.join(ref, "checkpoints")
    w, w_ref = load_model_weights(ck, "global_step6"), load_model_weights(ck_ref, "global_step6")
    w3 = load_model_weights(ck_ref, "global_step3")
    assert w.keys() == w_ref.keys()
    if precision == "fp32":
        for k in w:
            torch.testing.assert_close(w[k].float(), w_ref[k].float(), rtol=1e-5, atol=1e-6, msg=k)
    else:  # how far from the straight run, against how far steps 4-6 moved the weights
        keys = sorted(w)
        moved = (_flat(w_ref, keys) - _flat(w3, keys)).norm()
        assert (_flat(w, keys) - _flat(w_ref, keys)).norm() < 0.1 * moved
    assert os.path.isfile(os.path.join(ck, "global_step6", "COMPLETE"))  # the resumed run's own saves work
    if frozen != "none":  # the frozen group did not move
        group = "vision." if frozen == "freeze_vit" else "llm.blocks."
        assert all(torch.equal(w[k], w3[k]) for k in w if k.startswith(group))


def test_a_resume_with_another_batch_size_trains_every_sample_of_the_epoch_once(image_chat_data, tmp_path_factory,
                                                                                tmp_path):
    """Stopped after 3 steps of 8, resumed with train.batch_size=16: the epoch goes on at its next
    unseen sample (two steps of 16), so the samples trained in it are distinct and what is left
    untrained is less than one global batch (the epoch's tail)."""
    ref = _source(image_chat_data, tmp_path_factory, "bf16", "none", "P1")
    out = str(tmp_path / "bigger")
    _copy_to_step3(ref, out)
    proc = launch(1, _args(image_chat_data, out, "bf16", "none", "P1", "train.batch_size=16", "train.steps=5")
                  + ["--resume"], "python")
    assert "train.batch_size 8 at the checkpoint, 16 now" in proc.stdout + proc.stderr
    before = [json.loads(line) for line in open(os.path.join(ref, "samples", "rank0.jsonl"))]
    after = [json.loads(line) for line in open(os.path.join(out, "samples", "rank0.jsonl"))]
    keys = [k for r in before if r["step"] <= 3 for k in r["keys"]] + [k for r in after for k in r["keys"]]
    assert [r["step"] for r in after] == [4] * 8 + [5] * 8  # micro-batches of 2
    # an unusable sample is replaced by the next good one (so that one shows twice): every other key is
    # distinct, and the 56 positions trained leave less than one global batch of the epoch untrained
    bad = _records(out)[5]["bad_samples"]
    assert len(keys) == 3 * 8 + 2 * 16 and len(keys) - len(set(keys)) == bad
    positions = sum(1 for _ in open(image_chat_data["train"]))  # the epoch (unusable lines included)
    assert 0 <= positions - len(keys) < 16, (positions, len(keys))
