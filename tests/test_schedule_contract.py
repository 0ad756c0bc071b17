"""``parallel.schedule`` on real runs: the tiny VLM with its vision tower and projector frozen (ms-swift's
default for LoRA) trains under ``frozen_first`` bit for bit as under ``1f1b`` at P = 3 and P2 x DP2 (P = 2 on a
plan file's cut: tests/test_vlm_runs.py); ``auto`` chooses it from the profiled costs; the frozen stage's trace
holds no backward and no gradient receive."""
from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import assert_same_training, launch, train_losses

import mmpipe
from mmpipe.train.checkpoint_weights import load_model_weights

FROZEN = ["optim.freeze_vit=true", "optim.freeze_aligner=true"]
LAYOUTS = {"p3": (3, ["parallel.pipeline_stages=3"]), "p2dp2": (4, ["parallel.pipeline_stages=2"])}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_frozen_first_trains_bit_for_bit_as_1f1b(family_runs_of, layout):
    runs = family_runs_of("vlm")
    n, sets = LAYOUTS[layout]
    trace = ["log.trace=[2,3]"] if layout == "p3" else []
    plain, _ = runs.get(f"sched_1f1b_{layout}", n, sets + FROZEN + ["parallel.schedule=1f1b"], flags=["--stop-at", "3"])
    first, proc = runs.get(f"sched_auto_{layout}", n, sets + FROZEN + trace, flags=["--stop-at", "3"])
    with open(os.path.join(first, "plan.json")) as fh:
        plan = json.load(fh)
    with open(os.path.join(plain, "plan.json")) as fh:
        assert json.load(fh)["schedule"] == "1f1b"
    # auto: the frozen leading stages run forward only (predicted no slower; the prediction is in the plan)
    assert plan["schedule"] == "frozen_first" and plan["frozen_stages"] >= 1, plan
    assert set(plan["schedules"]) == {"1f1b", "frozen_first", "zb_h1"}  # every order that applies was weighed
    assert "parallel.schedule=auto -> frozen_first" in proc.stdout + proc.stderr
    losses = train_losses(first)
    assert len(losses) == 3 and losses == train_losses(plain)
    a = load_model_weights(os.path.join(first, "checkpoints"), "global_step3")
    b = load_model_weights(os.path.join(plain, "checkpoints"), "global_step3")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    init = mmpipe.build_model(mmpipe.load_config(os.path.join(first, "config.yaml"))).state_dict()
    assert any(not torch.equal(a[k], init[k]) for k in a if k.startswith("llm."))  # the decoder trained
    assert all(torch.equal(a[k], init[k]) for k in a if k.startswith(("vision.", "projector.")))
    if trace:  # what each stage ran, as the engine executed it
        with open(os.path.join(first, "trace.json")) as fh:
            events = [e for e in json.load(fh)["traceEvents"] if e["ph"] == "X"]
        ran = {s: {e["name"] for e in events if e["pid"] == s} for s in range(3)}
        k = plan["frozen_stages"]
        for s in range(k):
            assert ran[s] & {"ForwardPass", "SendActivation"} and not ran[s] & {"BackwardPass", "RecvGrad", "SendGrad"}
        assert "BackwardPass" in ran[k] and "SendGrad" not in ran[k]
        assert "BackwardPass" in ran[2] and ("SendGrad" in ran[2]) == (k < 2)


def test_gpipe_trains_as_1f1b(family_runs_of):
    """Every forward, then every backward: the last stage backpropagates each micro-batch's own loss (DeepSpeed
    keeps only the latest forward's: ``ds_compat.loss_per_buffer``), so the step equals 1F1B's."""
    runs = family_runs_of("vlm")
    sets = ["parallel.pipeline_stages=2", "parallel.profile=false"]
    ref, _ = runs.get("sched_p2_1f1b", 2, sets + ["parallel.schedule=1f1b"], flags=["--stop-at", "3"])
    gp, _ = runs.get("sched_p2_gpipe", 2, sets + ["parallel.schedule=gpipe"], flags=["--stop-at", "3"])
    with open(os.path.join(gp, "plan.json")) as fh:
        assert json.load(fh)["schedule"] == "gpipe"
    assert_same_training(gp, ref, steps=3, loss_rtol=1e-6, rtol=1e-5)
    # the order holds no state: the 1f1b run continues under gpipe, and its plan.json says which ran when
    launch(2, runs.base(ref) + [a for s in sets + ["parallel.schedule=gpipe"] for a in ("--set", s)]
           + ["--resume", "--stop-at", "4"], env=runs.env)
    with open(os.path.join(ref, "plan.json")) as fh:
        plan = json.load(fh)
    assert plan["schedule"] == "gpipe" and plan["schedule_segments"] == [{"from_step": 1, "schedule": "1f1b"},
                                                                         {"from_step": 4, "schedule": "gpipe"}]
    assert len(train_losses(ref)) == 4 and train_losses(ref)[:3] == pytest.approx(train_losses(gp), rel=1e-6)
