"""Stage balance in real pipelined runs: measured placements keep training exact, every stage's
time is accounted in metrics.jsonl, and the trace and timeline are written."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from helpers import train_losses
from test_parity import REF, _weights, assert_weights_close
from test_parity import reference as REFERENCE


def test_measured_auto_placement_trains_exactly_like_the_reference(runs):
    ref = runs.get(*REF)[0]
    out, proc = runs.get("p2_auto", 2, ["parallel.pipeline_stages=2", "parallel.placement=auto",
                                        "parallel.profile=true"], flags=["--stop-at", "4"])
    np.testing.assert_allclose(train_losses(out), train_losses(ref)[:4], rtol=1e-4)
    assert_weights_close(_weights(out, 4), _weights(ref, 4))
    plan = json.load(open(os.path.join(out, "plan.json")))
    assert plan["placement"] == "auto" and set(plan["predicted"]) == {"modality", "balanced"}
    # which placement auto chose, and why: the faster prediction, named in plan.json and the log
    fastest = min(plan["predicted"], key=lambda k: plan["predicted"][k]["step_time"])
    assert plan["chosen"] == fastest and plan["predicted"][fastest]["parts"] == plan["parts"]
    assert plan["why"].startswith("fastest predicted step: " + fastest)
    assert f"parallel.placement=auto -> {fastest} (fastest predicted step" in proc.stdout + proc.stderr


def test_stage_time_is_accounted_and_the_trace_is_written(runs):
    from mmpipe.train.metrics import read_metrics
    out, _ = runs.get(*REF)
    recs = read_metrics(os.path.join(out, "metrics.jsonl"))
    for r in recs:
        # the reporting stage's engine step fits in the trainer's own clock around the step (other
        # stages start their step at their own time: each is checked against its own wall time)
        assert r["stage1.wall_ms"] <= 1e3 * r["step_time"] + 0.5
        for s in (0, 1):
            wall = r[f"stage{s}.wall_ms"]
            parts = [r[f"stage{s}.busy"], r[f"stage{s}.data"], r[f"stage{s}.idle"]]
            assert all(0 <= x <= 1 for x in parts)
            assert r[f"stage{s}.fwd_ms"] > 0 and r[f"stage{s}.bwd_ms"] > 0
            # the timed instructions fit inside the stage's step and account for most of it
            timed = sum(r[f"stage{s}.{k}_ms"] for k in ("fwd", "bwd", "opt", "data", "comm", "reduce"))
            assert 0.5 * wall < timed <= wall + 0.5, (s, timed, wall)
            # busy is (forward + backward + optimizer) over that wall time, and the stage was busy
            busy_ms = sum(r[f"stage{s}.{k}_ms"] for k in ("fwd", "bwd", "opt"))
            assert 0 < busy_ms <= timed
        assert r["stage0.data_ms"] > 0  # the first stage loads the micro-batches
    trace = json.load(open(os.path.join(out, "trace.json")))
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["step"] for e in xs} == {2, 3}
    with open(os.path.join(out, "plan.json")) as fh:
        order = json.load(fh)["schedule"]  # (auto: the fastest predicted order with this cut)
    backward = {"BackwardInputPass", "BackwardWeightPass"} if order == "zb_h1" else {"BackwardPass"}
    for stage in (0, 1):
        kinds = {e["name"] for e in xs if e["pid"] == stage}
        assert {"ForwardPass", "OptimizerStep"} | backward <= kinds, (order, kinds)
    assert {"SendActivation", "RecvGrad"} <= {e["name"] for e in xs if e["pid"] == 0}
    # 4 micro-batches per step, each forwarded twice: the features pass of CLIP's global-batch loss,
    # then the run's order (docs/design.md), over the 2 traced steps
    assert sum(1 for e in xs if e["pid"] == 1 and e["name"] == "ForwardPass") == 2 * 4 * 2
    assert open(os.path.join(out, "timeline.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_mmpipe_plan_reports_every_placement_and_compares_with_a_run(runs, capsys, tmp_path, monkeypatch):
    from helpers import TINY

    from mmpipe.cli.main import main
    monkeypatch.setenv("MMPIPE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "plan"
    assert main(["plan", "--config", TINY, "--set", "model.text.vocab_size=300", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for pl in ("modality", "balanced", "auto", "parameters", "uniform"):
        assert f"| {pl}" in text
    assert "| 0 | vision.embed .." in text and "memory MB" in text
    plan = json.load(open(out / "plan.json"))
    assert len(plan["stages"]) == 2 and plan["placement"] == "modality"
    assert open(out / "plan.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert len(os.listdir(tmp_path / "cache")) == 1  # the profile is cached ...
    assert main(["plan", "--config", TINY, "--set", "model.text.vocab_size=300", "--out", str(out)]) == 0
    assert "reusing the cached layer profile" in capsys.readouterr().out  # ... and reused, said
    ref, _ = runs.get(*REF)
    assert main(["plan", "--run", ref]) == 0
    text = capsys.readouterr().out
    assert "| step ms |" in text and "| stage 1 idle |" in text


@pytest.mark.parametrize("family", ["clip", "vlm"])
@pytest.mark.parametrize("key,nprocs", [("p2_cost", 2), ("p2dp2_cost", 4)])
def test_cost_balanced_micro_batches_train_exactly_like_the_reference(family_runs_of, family, key, nprocs):
    """``data.balance: cost`` regroups each step's samples among its micro-batches (and data-parallel
    ranks): the same samples per step, so the same losses (rtol 1e-5) and weights (1e-4) as the
    reference's sampler order; and it did regroup (a step whose predicted time it lowered). The prices
    are refit from the measured micro-batches every 2 steps (``data.balance_refit``), and with a loader
    worker each next step is regrouped ahead in a process of its own, without changing that."""
    from mmpipe.train.metrics import read_metrics
    runs = family_runs_of(family)
    ref = REFERENCE(runs)
    out, _ = runs.get(key, nprocs, ["parallel.pipeline_stages=2", "data.balance=cost", "data.log_samples=true",
                                    "data.balance_refit=2", "data.num_workers=1"], flags=["--stop-at", "4"])
    np.testing.assert_allclose(train_losses(out), train_losses(ref)[:4], rtol=1e-5)
    assert_weights_close(_weights(out, 4), _weights(ref, 4), rtol=1e-4)
    gains = [r["predicted_gain"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))]
    # never much slower: the objective may give up a little predicted step for evener slots
    assert all(g >= 0.95 for g in gains), gains
    # every step trained on the reference's samples, grouped otherwise (the sampler's own order: rank 0's log)
    logged = _logged_groups(out)
    ref_logged = _plain_groups(ref, 4)
    assert [sorted(k for g in logged[s] for k in g) for s in range(1, 5)] == \
        [sorted(k for g in ref_logged[s] for k in g) for s in range(1, 5)]
    if family == "vlm":  # (CLIP's tiny data: fixed-size images pace every slot, 6-10-token captions never do:
        # the balancer predicts no gain and keeps the sampler's grouping; test_balance.py regroups captions)
        assert any(sorted(logged[s]) != sorted(ref_logged[s]) for s in range(1, 5)), "nothing was regrouped"
    plan = json.load(open(os.path.join(out, "plan.json")))
    assert set(plan["prices"]["drivers"]) == {"vision", "tokens"} and min(plan["prices"]["seconds"]) >= 0
    # the prices refit every 2 steps from the stage clock's micro-batch times (step 1 warms up, not measured)
    refits = read_metrics(os.path.join(out, "metrics.jsonl"), "refit")
    assert [r["step"] for r in refits] == [2, 4], refits
    assert [r["micro_batches"] for r in refits] == [4, 12]  # (steps 2 and 2-4; 4 micro-batches a step)
    for r in refits:
        assert len(r["vision_scale"]) == 2 and all(b >= 0 for b in r["base_ms"])
        assert sum(r["error_after"]) <= sum(r["error_before"]), r


def _logged_groups(out: str) -> dict:
    """{step: the keys of each micro-batch} the first stage's ranks read (``data.log_samples``)."""
    logged: dict = {}
    for name in sorted(os.listdir(os.path.join(out, "samples"))):
        for line in open(os.path.join(out, "samples", name)):
            r = json.loads(line)
            if r["stage"] == 0:
                logged.setdefault(r["step"], []).append(tuple(sorted(r["keys"])))
    return logged


def _regrouped(out: str, steps: int) -> bool:
    """Whether a ``data.balance: cost`` run grouped some step's samples otherwise than the sampler."""
    logged, plain = _logged_groups(out), _plain_groups(out, steps)
    return any(sorted(logged[s]) != sorted(plain[s]) for s in range(1, steps + 1))


def _plain_groups(ref: str, steps: int) -> dict:
    """{step: the keys of each micro-batch} as ``data.balance: none`` cuts them (the reference's sampler)."""
    import mmpipe
    from mmpipe.config.resolve import build_family
    from mmpipe.data.sampler import MicroBatchSampler
    from mmpipe.data.source import open_source
    from mmpipe.data.tokenizer import load_tokenizer
    cfg = mmpipe.load_config(os.path.join(ref, "config.yaml"))
    fam = build_family(cfg.model, 0)
    src = open_source(cfg, True, family=fam)
    ds = src.dataset(cfg, cfg.train.seed, family=fam, tok=load_tokenizer(os.path.join(ref, "tokenizer")))
    mbs = cfg.parallel.micro_batch_size
    sampler = MicroBatchSampler(len(ds), mbs, cfg.train.batch_size // mbs, 1, 0, cfg.train.seed)
    return {s + 1: [tuple(sorted(ds[i]["key"] if "key" in ds[i] else str(ds[i]["index"]) for i in g))
                    for g in sampler.micro_batches(s)] for s in range(steps)}


def test_replan_moves_a_poor_cut_once_and_trains_exactly_like_the_reference(runs, tmp_path):
    """A P = 2 run started on a poor cut (stage 0 = the first layer alone) with ``parallel.replan: auto``
    moves its boundaries once, at a step boundary, in the same processes (checkpoint, then the layout-free
    resume on the new cut), and its losses and weights equal the reference's, which never moved; with
    ``replan: off`` the same start never moves."""
    import mmpipe
    from mmpipe.config.resolve import build_family
    from mmpipe.train.checkpoint_weights import load_model_weights
    from mmpipe.train.metrics import read_metrics
    ref = REFERENCE(runs)
    names = build_family(mmpipe.load_config(os.path.join(ref, "config.yaml")).model, 0).layer_names()
    poor = tmp_path / "poor.json"
    poor.write_text(json.dumps({"stages": [names[:1], names[1:]]}))
    sets = ["parallel.pipeline_stages=2", f"parallel.plan={poor}", "parallel.replan_window=1",
            "parallel.replan_margin=0.05", "train.save_every=100"]
    out, proc = runs.get("p2_replan", 2, sets + ["parallel.replan=auto"])
    moves = read_metrics(os.path.join(out, "metrics.jsonl"), "replan")
    assert len(moves) == 1 and moves[0]["old_parts"] == [0, 1, len(names)], moves
    assert moves[0]["new_parts"] != moves[0]["old_parts"] and moves[0]["predicted_new"] < moves[0]["predicted_now"]
    log = proc.stdout + proc.stderr
    assert f"replan at step {moves[0]['step']}: stage boundaries [0, 1, {len(names)}] -> {moves[0]['new_parts']}" in log
    assert f"resume@{moves[0]['step']}" in log
    # the continued run measures what the move gained (its first step warms up: the one after it counts)
    gained = read_metrics(os.path.join(out, "metrics.jsonl"), "replan_measured")
    assert [g["step"] for g in gained] == [s for s in [moves[0]["step"] + 2] if s <= 6], (gained, moves)
    for g in gained:
        assert g["measured_before"] == pytest.approx(moves[0]["measured_step"])
        assert g["measured_gain"] == pytest.approx(g["measured_before"] / g["measured_after"])
    np.testing.assert_allclose(train_losses(out), train_losses(ref), rtol=1e-5)
    final = load_model_weights(os.path.join(out, "checkpoints"), "global_step6")
    assert_weights_close(final, _weights(ref, 6), rtol=1e-4)
    # under torch's elastic agent (accelerate launch, as torchrun): the continued ranks meet again (the agent
    # serves only its own port), and train the same
    elastic, proc = runs.get("p2_replan_elastic", 2, sets + ["parallel.replan=auto"], launcher="accelerate")
    assert len(read_metrics(os.path.join(elastic, "metrics.jsonl"), "replan")) == 1, proc.stdout[-2000:]
    np.testing.assert_allclose(train_losses(elastic), train_losses(ref), rtol=1e-5)
    stayed, _ = runs.get("p2_replan_off", 2, sets + ["parallel.replan=off"], flags=["--stop-at", "3"])
    assert read_metrics(os.path.join(stayed, "metrics.jsonl"), "replan") == []
    assert json.load(open(os.path.join(stayed, "plan.json")))["parts"] == [0, 1, len(names)]
