"""The layout cost model on hand-built profiles with known answers, and the chooser."""
from __future__ import annotations

import math

import pytest

from mmpipe.planning.collectives import CommModel
from mmpipe.planning.layouts import choose, predict_layouts
from mmpipe.planning.memory import dp_memory, stage_breakdown
from mmpipe.planning.place import layer_costs


def _layer(name, fwd, bwd, params, act=1000, out=4000, trainable=None, opt=0.0):
    return {"name": name, "fwd_ms": fwd, "bwd_ms": bwd, "act_bytes": act, "out_bytes": out,
            "param_bytes": 4 * params, "params": params, "trainable": params if trainable is None else trainable,
            "opt_ms": opt}


def _prof(layers, lat=1e-4, spb=1e-9):
    return {"key": {"threads": 1}, "layers": layers, "comm": {"latency_s": lat, "s_per_byte": spb}}


NAMES = ["vision.0", "vision.1", "text.0", "text.1"]
SEGS = ["vision", "vision", "text", "text"]


def _by_name(rows):
    return {r.name: r for r in rows}


def test_data_parallel_step_is_compute_plus_the_gradient_all_reduce():
    layers = [_layer(n, 2.0, 4.0, 1000, opt=0.5) for n in NAMES]
    comm = CommModel(ops={"allreduce": {2: (1e-3, 2e-9)}, "allgather": {2: (5e-4, 1e-9)},
                          "reduce_scatter": {2: (5e-4, 1e-9)}})
    rows = _by_name(predict_layouts(_prof(layers), comm, world=2, batch_size=16, micro_batch_size=4,
                                    precision="fp32", names=NAMES, segments=SEGS, fetch_units=10))
    M = 16 // (4 * 2)
    grads = 4 * 1000 * 4  # fp32 gradient bytes of every trainable parameter
    weights = 4 * 1000 * 4
    compute = M * 4 * (2.0 + 4.0) / 1e3
    assert rows["DP2 ZeRO-0"].step_time == pytest.approx(compute + 4 * 0.5e-3 + 1e-3 + 2e-9 * grads, rel=1e-12)
    # ZeRO-1: half the optimizer step per rank, and the updated weights all-gathered
    assert rows["DP2 ZeRO-1"].step_time == pytest.approx(compute + 2 * 0.5e-3 + 1e-3 + 2e-9 * grads
                                                         + 5e-4 + 1e-9 * weights, rel=1e-12)
    # ZeRO-2: every micro-batch's gradients all-reduced (DeepSpeed's bucket reduction), weights gathered
    assert rows["DP2 ZeRO-2"].step_time == pytest.approx(compute + 2 * 0.5e-3 + M * (1e-3 + 2e-9 * grads)
                                                         + 5e-4 + 1e-9 * weights, rel=1e-12)
    # ZeRO-3: every micro-batch gathers the weights twice (each of the 10 parameter-owning modules on
    # its own: 2 x 9 more gather latencies) and reduce-scatters the gradients
    assert rows["DP2 ZeRO-3"].step_time == pytest.approx(
        compute + 2 * 0.5e-3 + M * (2 * (5e-4 + 1e-9 * weights) + 2 * 9 * (5e-4 + 1e-9) + 5e-4 + 1e-9 * grads),
        rel=1e-12)
    assert rows["DP2 ZeRO-0"].samples_per_s == pytest.approx(16 / rows["DP2 ZeRO-0"].step_time)
    assert rows["DP2 ZeRO-0"].bubble == 0


def test_zero3_charges_every_fetched_module_its_measured_cost():
    """With ZeRO-3's per-module cost measured (``CommModel.zero3``), each micro-batch pays the
    partitioned weights' gathers and the gradient reduce-scatter by bandwidth, plus, per pass
    (forward and backward), the measured cost of every partitioned module and of every persistent
    one; each step pays its measured cost per module and the persistent weights' all-gather."""
    layers = [_layer(n, 2.0, 4.0, 1000, opt=0.5) for n in NAMES]
    comm = CommModel(ops={"allreduce": {2: (1e-3, 2e-9)}, "allgather": {2: (5e-4, 1e-9)},
                          "reduce_scatter": {2: (5e-4, 1e-9)}}, zero3={2: (2e-3, 3e-4, 1e-3, 4e-4)})
    rows = _by_name(predict_layouts(_prof(layers), comm, world=2, batch_size=16, micro_batch_size=4,
                                    precision="fp32", names=NAMES, segments=SEGS, fetch_units=(6, 10, 500)))
    M, weights, grads, kept = 2, 16000, 16000, 4 * 500
    compute = M * 4 * (2.0 + 4.0) / 1e3
    assert rows["DP2 ZeRO-3"].step_time == pytest.approx(
        compute + 2 * 0.5e-3 + M * (2 * (5e-4 + 1e-9 * (weights - kept)) + 5e-4 + 1e-9 * grads)
        + 1e-9 * (kept - 1) + M * 2 * (6 * 2e-3 + 10 * 3e-4) + 6 * 1e-3 + 10 * 4e-4, rel=1e-12)
    # a group size not measured: the gather parts grow like a ring's latency, the hooks stay
    assert comm.zero3_module(4) == pytest.approx((6e-3, 3e-4, 3e-3, 1.2e-3))
    assert comm.zero3_module(1) is None
    assert CommModel.from_dict(comm.to_dict()).zero3 == {2: (2e-3, 3e-4, 1e-3, 4e-4)}
    # an entry cached before the step was timed reads as no step cost
    assert CommModel(zero3={2: (2e-3, 3e-4)}).zero3_module(2) == (2e-3, 3e-4, 0.0, 0.0)


def test_zero2_charges_its_measured_hooks_and_bucket_copies():
    """ZeRO-2's step was predicted 9-12% fast in every bench round: beyond its per-micro-batch
    all-reduce, DeepSpeed hooks every parameter tensor and copies every gradient byte into and out of
    its buckets each micro-batch, and its step costs more than its share of ZeRO-0's. Measured
    (``CommModel.zero2``: per tensor, per byte, per byte of the step) and charged."""
    from mmpipe.planning.collectives import zero2_fit
    layers = [_layer(n, 2.0, 4.0, 1000, opt=0.5) for n in NAMES]
    ops = {"allreduce": {2: (1e-3, 2e-9)}, "allgather": {2: (5e-4, 1e-9)}, "reduce_scatter": {2: (5e-4, 1e-9)}}
    kw = dict(world=2, batch_size=16, micro_batch_size=4, precision="fp32", names=NAMES, segments=SEGS,
              fetch_units=(6, 10, 500, 12))
    plain = _by_name(predict_layouts(_prof(layers), CommModel(ops=ops), **kw))
    comm = CommModel(ops=ops, zero2={2: (1e-4, 2e-9, 3e-9)})
    rows = _by_name(predict_layouts(_prof(layers), comm, **kw))
    M, grads = 2, 16000
    assert rows["DP2 ZeRO-2"].step_time == pytest.approx(
        plain["DP2 ZeRO-2"].step_time + M * (12 * 1e-4 + grads * 2e-9) + grads * 3e-9, rel=1e-12)
    for z in (0, 1, 3):  # nothing else moves
        assert rows[f"DP2 ZeRO-{z}"].step_time == plain[f"DP2 ZeRO-{z}"].step_time
    assert CommModel.from_dict(comm.to_dict()).zero2 == {2: (1e-4, 2e-9, 3e-9)}
    assert comm.zero2_costs(4) == (1e-4, 2e-9, 3e-9) and comm.zero2_costs(1) is None
    # the probe's two chains (many bytes per tensor, few) separate the two per-micro-batch costs
    probe = {"chains": {"partitioned": (32, 8_421_376), "persistent": (32, 32_768)}}
    a, b, c = 5e-5, 1e-10, 4e-10
    probe["zero2_partitioned"] = (32 * a + 8_421_376 * b, (c + 1e-9) * 8_421_376)
    probe["zero2_persistent"] = (32 * a + 32_768 * b, 0.0)
    assert zero2_fit(probe, 1e-9) == pytest.approx((a, b, c))


def _states(costs, precision, zero, n):
    """Weights + gradients + optimizer state of one data-parallel rank (the memory model's)."""
    m = stage_breakdown(costs, [0, len(costs)], 1, precision, zero, n)[0]
    return int(m.weights + m.grads + m.optimizer)


def test_zero3_memory_is_a_shard_of_everything_plus_the_gathered_layer():
    layers = [_layer("a", 1, 1, 1000, act=100, out=40), _layer("b", 1, 1, 3000, act=300, out=40)]
    costs = layer_costs(_prof(layers))
    n = 4
    assert _states(costs, "fp32", 3, n) == int((4000 * (4 + 4 + 8)) / n + (3000 * 4 + 3000 * 4))
    assert _states(costs, "fp32", 0, n) == 4000 * 16
    assert _states(costs, "fp32", 1, n) == int(4000 * (8 + 8 / n))
    assert _states(costs, "fp32", 2, n) == int(4000 * (4 + 12 / n))
    # bf16: 2-byte weights and gradients, fp32 master + Adam moments (the fp32 gradients exist in the step only)
    assert _states(costs, "bf16", 0, n) == 4000 * (2 + 2 + 12)
    # the peak: the larger of the training moment (activations 400, the kept output 40) and the
    # optimizer step (AdamW's fp32 temporary per parameter of the shard)
    assert dp_memory(costs, "fp32", 0, n) == 4000 * 16 + max(440, 4 * 4000)
    assert dp_memory(costs, "fp32", 3, n) == _states(costs, "fp32", 3, n) + max(440, 4 * 4000 // n)
    big = layer_costs(_prof([_layer("a", 1, 1, 1000, act=10**6, out=40)]))
    # one micro-batch per step: its forward runs before any gradient exists (the step begins with none)
    assert dp_memory(big, "fp32", 0, 1) == 1000 * 12 + 10**6 + 40
    assert dp_memory(big, "fp32", 0, 1, micro_batches=2) == 1000 * 16 + 10**6 + 40


def test_model_states_agree_with_deepspeeds_estimators():
    """DeepSpeed's own estimators (mixed precision, no offload) on the same parameter count, with the fp32
    gradient partition its step makes (``step_split``, which mmpipe prices at the step, not beside the
    activations): ZeRO-2 is the same number (2 P + 18 P / N); ZeRO-3 differs by the 16-bit gradient shard
    (2 P / N), which DeepSpeed's formula leaves out and mmpipe counts (4 x the largest layer gathered in both)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from mmpipe.planning.memory import step_split
    layers = [_layer("a", 1, 1, 1_000_000, act=0, out=0), _layer("b", 1, 1, 3_000_000, act=0, out=0)]
    costs = layer_costs(_prof(layers))
    total = 4_000_000
    for n in (1, 2, 8):
        split, whole = step_split("bf16", 2, False)
        made = total * (split / n + whole)
        _, z2 = estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=n, cpu_offload=False)
        assert _states(costs, "bf16", 2, n) + made == z2
        _, z3, _ = estimate_zero3_model_states_mem_needs(total, 3_000_000, num_gpus_per_node=n, cpu_offload=False)
        assert _states(costs, "bf16", 3, n) + made == pytest.approx(z3 + 2 * total / n, abs=1)


def test_the_chooser_prefers_data_parallel_when_it_fits_and_communication_is_cheap():
    layers = [_layer(n, 3.0, 6.0, 1000) for n in NAMES]
    cheap = CommModel(ops={op: {2: (1e-5, 1e-12)} for op in ("allreduce", "allgather", "reduce_scatter")})
    rows = predict_layouts(_prof(layers, lat=1e-5, spb=1e-12), cheap, world=2, batch_size=16, micro_batch_size=2,
                           precision="fp32", names=NAMES, segments=SEGS, memory_budget=1 << 30)
    best, why = choose(rows)
    assert best.pipeline_stages == 1 and best.data_parallel == 2, why
    pp = _by_name(rows)["PP2 modality"]
    assert pp.bubble > 0 and pp.step_time > best.step_time  # the pipeline pays its fill and drain


def test_the_chooser_breaks_a_near_tie_for_fewer_stages_then_lower_zero():
    from mmpipe.planning.layouts import LayoutPrediction

    def row(name, P, D, z, ms, fits=True):
        return LayoutPrediction(name, P, D, z, None, 2, step_time=ms / 1e3, fits=fits)
    rows = [row("PP4 modality", 4, 1, 0, 1000), row("PP2xDP2 modality ZeRO-1", 2, 2, 1, 1030),
            row("PP2xDP2 modality ZeRO-0", 2, 2, 0, 1040), row("DP4 ZeRO-0", 1, 4, 0, 1100),
            row("DP4 ZeRO-1", 1, 4, 1, 900, fits=False)]
    best, why = choose(rows)
    assert best.name == "PP2xDP2 modality ZeRO-0", why
    assert "within 5% of the fastest, PP4 modality 1000.0 ms" in why and "not fitting: DP4 ZeRO-1" in why
    best, why = choose(rows, tie=0.0)  # no margin: the fastest predicted
    assert best.name == "PP4 modality" and why.startswith("fastest predicted step that fits: PP4 modality")
    best, _ = choose(rows, tie=0.15)  # DP4 within 15% of 1000 ms: data parallel, no pipeline at all
    assert best.name == "DP4 ZeRO-0"


def test_the_chooser_takes_a_pipeline_when_memory_forces_it():
    big = 10_000_000  # parameters per layer: the whole model's state does not fit one rank, a half does
    layers = [_layer(n, 3.0, 6.0, big) for n in NAMES]
    cheap = CommModel(ops={op: {2: (1e-5, 1e-12)} for op in ("allreduce", "allgather", "reduce_scatter")})
    half = 2 * big * (16 + 4)  # one stage: weights + gradients + Adam state of two layers, + its step's temporaries
    rows = predict_layouts(_prof(layers), cheap, world=2, batch_size=16, micro_batch_size=2, precision="fp32",
                           names=NAMES, segments=SEGS, memory_budget=int(half * 1.1))
    best, why = choose(rows)
    assert best.pipeline_stages == 2, why
    byname = _by_name(rows)
    for name in ("DP2 ZeRO-0", "DP2 ZeRO-1", "DP2 ZeRO-2", "DP2 ZeRO-3"):
        assert not byname[name].fits and "over the" in byname[name].why
    assert "not fitting: DP2 ZeRO-0" in why


def test_a_slow_network_makes_the_pipeline_win_and_group_sizes_scale():
    layers = [_layer(n, 3.0, 6.0, 2_000_000) for n in NAMES]
    slow = CommModel(ops={op: {2: (1e-3, 1e-8)} for op in ("allreduce", "allgather", "reduce_scatter")})
    rows = predict_layouts(_prof(layers, lat=1e-4, spb=1e-10), slow, world=2, batch_size=64, micro_batch_size=4,
                           precision="fp32", names=NAMES, segments=SEGS)
    best, _ = choose(rows)
    assert best.pipeline_stages == 2
    # a group size not measured is scaled from the nearest by the ring formula
    c = CommModel(ops={"allreduce": {2: (1e-3, 1e-9)}})
    assert c.time("allreduce", 4, 1e6) == pytest.approx(3e-3 + 1e-9 * 1e6 * (3 / 4) / (1 / 2))
    assert c.time("allreduce", 1, 1e6) == 0.0


def test_four_ranks_list_every_divisor_layout_and_oversubscription_stretches_compute():
    layers = [_layer(n, 3.0, 6.0, 1000) for n in NAMES]
    comm = CommModel(ops={op: {2: (1e-4, 1e-10), 4: (2e-4, 1e-10)} for op in ("allreduce", "allgather",
                                                                               "reduce_scatter")})
    rows = _by_name(predict_layouts(_prof(layers), comm, world=4, batch_size=32, micro_batch_size=2,
                                    precision="fp32", names=NAMES, segments=SEGS, cores=2))
    assert {"DP4 ZeRO-0", "DP4 ZeRO-3", "PP2xDP2 modality ZeRO-0", "PP2xDP2 auto ZeRO-1", "PP4 modality"} <= set(rows)
    # 4 single-thread ranks on 2 cores: every rank computes at half speed ...
    M = 32 // (2 * 4)
    assert rows["DP4 ZeRO-0"].compute == pytest.approx(M * 2 * (4 * 9.0) / 1e3)
    # ... but a pipeline's waiting ranks free their cores: PP4 is stretched by less than 2x
    plain = _by_name(predict_layouts(_prof(layers), comm, world=4, batch_size=32, micro_batch_size=2,
                                     precision="fp32", names=NAMES, segments=SEGS, cores=None))
    ratio = rows["PP4 modality"].step_time / plain["PP4 modality"].step_time
    assert 1.0 < ratio < 2.0 - 0.1
    assert all(math.isfinite(r.step_time) for r in rows.values() if r.fits)


def test_a_measured_stretch_replaces_the_fair_share_of_the_cores():
    """4 single-thread ranks on 2 cores measured 2.5x slower each (not 2x): data parallel computes
    2.5x slower, a pipeline's busy-scaled stretch pays the same 2.5 / 2 on top."""
    from mmpipe.planning.layouts import oversubscription
    layers = [_layer(n, 3.0, 6.0, 1000) for n in NAMES]
    ops = {op: {2: (1e-4, 1e-10), 4: (2e-4, 1e-10)} for op in ("allreduce", "allgather", "reduce_scatter")}
    kw = dict(world=4, batch_size=32, micro_batch_size=2, precision="fp32", names=NAMES, segments=SEGS, cores=2)
    fair = _by_name(predict_layouts(_prof(layers), CommModel(ops=ops), **kw))
    measured = _by_name(predict_layouts(_prof(layers), CommModel(ops=ops, stretch={4: 2.5}), **kw))
    M = 32 // (2 * 4)
    assert measured["DP4 ZeRO-0"].compute == pytest.approx(M * 4 * 9.0 * 2.5 / 1e3)
    assert fair["DP4 ZeRO-0"].compute == pytest.approx(M * 4 * 9.0 * 2.0 / 1e3)
    assert 1.0 < measured["PP4 modality"].step_time / fair["PP4 modality"].step_time <= 1.25 + 1e-9
    assert oversubscription(4, 1, 2, {4: 2.5}) == 2.5
    assert oversubscription(4, 2, 2, {4: 2.5}) == 4.0  # measured for one thread per rank only
    assert oversubscription(4, 1, None, {4: 2.5}) == 1.0  # accelerators: no shared cores
    # a core per rank: the measured 2-rank stretch is not charged again (the cold profile has it)
    assert oversubscription(2, 1, 2, {2: 1.3, 4: 2.5}) == 1.0
    two = dict(kw, world=2)
    ones = _by_name(predict_layouts(_prof(layers), CommModel(ops=ops), **two))
    twos = _by_name(predict_layouts(_prof(layers), CommModel(ops=ops, stretch={2: 1.3}), **two))
    assert twos["DP2 ZeRO-0"].step_time == pytest.approx(ones["DP2 ZeRO-0"].step_time)
    assert twos["PP2 modality"].step_time == pytest.approx(ones["PP2 modality"].step_time)


def test_layout_auto_trains_at_world_size_two_and_records_its_choice(runs, tmp_path):
    """``parallel.layout: auto``: rank 0 predicts every layout of the 2 ranks, all take the chosen
    one, log it, save it (layout.json and the run's config.yaml) and train."""
    import json
    import os

    from helpers import launch

    import mmpipe
    from mmpipe.train.metrics import read_metrics
    out = str(tmp_path / "auto")
    proc = launch(2, runs.base(out, "--set", "parallel.pipeline_stages=auto"))
    log = proc.stdout + proc.stderr
    with open(os.path.join(out, "layout.json")) as fh:
        doc = json.load(fh)
    chosen = doc["chosen"]
    assert f"parallel.layout=auto -> {chosen['name']}" in log
    assert {r["name"] for r in doc["layouts"]} >= {"DP2 ZeRO-0", "DP2 ZeRO-3", "PP2 modality"}
    fits = [r for r in doc["layouts"] if r["fits"]]
    assert chosen["step_time"] == min(r["step_time"] for r in fits)
    saved = mmpipe.load_config(os.path.join(out, "config.yaml"))
    assert saved.parallel.layout == "auto"
    assert (saved.parallel.pipeline_stages, saved.parallel.zero_stage) == (chosen["pipeline_stages"],
                                                                           chosen["zero_stage"])
    recs = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in recs] == list(range(1, 7)) and all(math.isfinite(r["loss"]) for r in recs)


def test_plan_world_prints_the_table_and_writes_json_and_png(tmp_path, capsys):
    import json
    import os

    from helpers import TINY
    from PIL import Image

    from mmpipe.cli.main import main
    out = str(tmp_path / "plan")
    assert main(["plan", "--config", TINY, "--world", "2", "--out", out]) == 0
    text = capsys.readouterr().out
    with open(os.path.join(out, "layouts.json")) as fh:
        doc = json.load(fh)
    assert f"| {doc['chosen']['name']} **chosen** |" in text and f"chosen: {doc['chosen']['name']}" in text
    # DP2 ZeRO-0..3, PP2 modality and auto; each with and without activation checkpointing
    assert len(doc["layouts"]) == 12 and doc["comm"]["measured"]
    assert sum(r["checkpointing"] for r in doc["layouts"]) == 6 and not doc["chosen"]["checkpointing"]
    # ZeRO-3's per-module cost per pass and per step, measured by DeepSpeed runs
    partitioned, persistent, partitioned_step, persistent_step = doc["comm"]["zero3"]["2"]
    assert 0 <= partitioned < 0.1 and 0 < persistent < 0.1
    assert 0 <= partitioned_step < 0.1 and 0 < persistent_step < 0.1
    assert 0.5 < doc["comm"]["stretch"]["2"] < 4  # 2 ranks computing at once vs one alone
    per_tensor, per_byte, step_per_byte = doc["comm"]["zero2"]["2"]  # ZeRO-2 beyond ZeRO-0, measured
    assert 0 <= per_tensor < 0.01 and 0 <= per_byte < 1e-6 and 0 <= step_per_byte < 1e-6
    for png in ("layouts.png", "memory.png"):
        with Image.open(os.path.join(out, png)) as im:
            assert im.format == "PNG"
    capsys.readouterr()
    assert main(["plan", "--config", TINY, "--world", "2", "--memory-gb", "1e-6", "--out", out]) == 2
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()  # nothing fits: the table still, then one short line naming the budget
    assert len(err) == 1 and "no layout of 2 ranks fits" in err[0] and "--memory-gb 1e-06" in err[0], err
    assert "| DP2 ZeRO-0 |" in cap.out and len(err[0]) < 300


def test_medians_of_several_profiles_and_collective_measurements():
    """``bench`` samples the profile and the collectives once per round: each layer time and each
    collective figure is its median over the samples (one slow sample moves nothing)."""
    from mmpipe.planning.offline import median_profile
    profs = [_prof([_layer("a", f, 2 * f, 10, opt=f / 10), _layer("b", 3.0, 6.0, 10)]) for f in (1.0, 9.0, 2.0)]
    med = median_profile(profs)
    assert [(c["fwd_ms"], c["bwd_ms"], c["opt_ms"]) for c in med["layers"]] == [(2.0, 4.0, 0.2), (3.0, 6.0, 0.0)]
    assert med["samples"] == 3 and med["comm"] == profs[0]["comm"]
    comms = [CommModel(ops={"allreduce": {2: (lat, spb)}}, p2p=(lat, 0.0), zero3={2: (lat, 0.0, 0.0, 0.0)},
                       stretch={2: s}) for lat, spb, s in ((1e-3, 5e-9, 1.1), (9e-3, 1e-9, 1.0), (2e-3, 2e-9, 1.3))]
    m = CommModel.median(comms)
    assert m.ops["allreduce"][2] == (2e-3, 2e-9)
    assert m.p2p == (2e-3, 0.0) and m.zero3[2][0] == 2e-3 and m.stretch[2] == 1.1


SPY = '''
import collections, json, sys
from mmpipe.train import setup, trainer as train
calls = collections.Counter()
def spy(owner, name):
    real = getattr(owner, name)
    def counted(*a, **k):
        calls[name] += 1
        return real(*a, **k)
    setattr(owner, name, counted)
spy(setup, "open_source"); spy(setup, "validate"); spy(setup, "locate")  # the names setup calls
if __name__ == "__main__":
    from mmpipe.config.schema import load_config
    cfg = load_config(sys.argv[1], sys.argv[3:])
    result = train.run(cfg, overwrite=True)
    json.dump({"calls": dict(calls), "step": result["step"]}, open(sys.argv[2], "w"))
'''


def test_layout_auto_validates_and_opens_the_data_once_and_keeps_a_type_placement(runs, tmp_path):
    """``parallel.layout: auto`` (one rank: a data-parallel layout is chosen) with
    ``parallel.placement: type:REGEX``: the requested placement survives the choice whole, the config
    is validated once (then only the chosen layout's part again) and the data is opened once."""
    import json
    import os
    import subprocess
    import sys

    from helpers import ROOT, TINY, _env
    script, result = tmp_path / "spy.py", tmp_path / "calls.json"
    script.write_text(SPY)
    out = str(tmp_path / "auto_type")
    sets = [a for a in runs.base(out) if a != "--set"][2:] + ["parallel.layout=auto", "parallel.placement=type:Embed",
                                                              "train.steps=2", "log.progress=false"]
    proc = subprocess.run([sys.executable, str(script), TINY, str(result)] + sets, cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    got = json.loads(result.read_text())
    assert got["step"] == 2
    assert got["calls"] == {"open_source": 1, "validate": 1, "locate": 2}
    assert "parallel.layout=auto -> single process: pipeline_stages=1" in proc.stdout + proc.stderr
    import mmpipe
    assert mmpipe.load_config(os.path.join(out, "config.yaml")).parallel.placement == "type:Embed"


def test_a_family_that_cannot_run_zero3_with_checkpointing_has_those_rows_refused_with_its_reason():
    """The chooser never picks what the config check refuses (native-resolution Qwen families: ZeRO-3 +
    checkpointing hangs): those rows do not fit and say why; the same layouts without it still fit."""
    layers = [_layer(n, 2.0, 4.0, 1000, opt=0.5) for n in NAMES]
    comm = CommModel(ops={"allreduce": {2: (1e-3, 2e-9)}, "allgather": {2: (5e-4, 1e-9)},
                          "reduce_scatter": {2: (5e-4, 1e-9)}})
    kw = dict(world=2, batch_size=16, micro_batch_size=4, precision="fp32", names=NAMES, segments=SEGS,
              fetch_units=10, checkpointing=(False, True))
    free = _by_name(predict_layouts(_prof(layers), comm, **kw))
    rows = _by_name(predict_layouts(_prof(layers), comm, zero3_checkpointing_why="it hangs", **kw))
    assert free["DP2 ZeRO-3 +ckpt"].fits
    assert not rows["DP2 ZeRO-3 +ckpt"].fits and rows["DP2 ZeRO-3 +ckpt"].why == "it hangs"
    assert {n for n, r in rows.items() if r.fits} == {n for n, r in free.items() if r.fits} - {"DP2 ZeRO-3 +ckpt"}
