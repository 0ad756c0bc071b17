"""Stage balancing: the schedule simulator, cost-based placements, frozen towers costed forward-only."""
from __future__ import annotations

import random

import numpy as np

import pytest

from mmpipe.parallel.schedules import Order
from mmpipe.planning.simulate import bubble_formula, recommend_micro_batches, simulate

ONE = Order("1f1b")  # DeepSpeed's order: what these tests of the simulator and the cut are about


@pytest.mark.parametrize("P,M", [(2, 1), (2, 8), (3, 5), (4, 8), (4, 16)])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_equal_stages_give_the_textbook_bubble(P, M, schedule):
    r = simulate([1.0] * P, [2.0] * P, M, order=Order(schedule))
    assert r.step_time == pytest.approx(3.0 * (M + P - 1))
    assert r.bubble == pytest.approx(bubble_formula(P, M))
    assert all(i == pytest.approx(bubble_formula(P, M)) for i in r.idle_frac)


def test_the_slowest_stage_sets_the_pace():
    # stage 1 three times slower: M x (F1 + B1) plus stage 0's fill and drain
    r = simulate([1.0, 3.0], [2.0, 6.0], 8, order=ONE)
    assert r.step_time == pytest.approx(8 * 9 + 3)
    assert r.idle_frac[1] == pytest.approx(3 / 75) and r.idle_frac[0] == pytest.approx(1 - 24 / 75)


def test_transfers_and_optimizer_add_to_the_step():
    base = simulate([1.0] * 2, [2.0] * 2, 4, order=ONE).step_time
    assert simulate([1.0] * 2, [2.0] * 2, 4, comm=[0.5], order=ONE).step_time > base
    assert simulate([1.0] * 2, [2.0] * 2, 4, opt=[1.5, 0.0], order=ONE).step_time == pytest.approx(base + 1.5)
    # the last stage's optimizer step overlaps stage 0's last backward (2.0): hidden up to that
    assert simulate([1.0] * 2, [2.0] * 2, 4, opt=[0.0, 1.5], order=ONE).step_time == pytest.approx(base)
    assert simulate([1.0] * 2, [2.0] * 2, 4, opt=[0.0, 2.5], order=ONE).step_time == pytest.approx(base + 0.5)


def test_activations_and_gradients_cross_with_their_own_costs():
    """Stage 1 the bottleneck: each micro-batch it receives the activations (a), runs F + B and
    sends the gradients back (g), so the step is 8 x (9 + a + g) plus stage 0's fill and drain. The
    costs count DeepSpeed's messages: one per tensor of the activation tuple, one per gradient."""
    from mmpipe.planning.place import stage_times
    from mmpipe.planning.profiler import LayerCost
    r = simulate([1.0, 3.0], [2.0, 6.0], 8, comm=[0.5], comm_grad=[0.25], order=ONE)
    assert r.step_time == pytest.approx(8 * (9 + 0.5 + 0.25) + 3)
    # a tuple of 3 tensors (hidden states, token ids, mask) of which one wants a gradient
    layers = [LayerCost("a", 1.0, 2.0, 0, 1000, 0, 0, 0, out_tensors=3, grad_tensors=1, grad_bytes=400).to_dict(),
              LayerCost("b", 1.0, 2.0, 0, 8, 0, 0, 0).to_dict()]
    t = stage_times({"layers": layers, "comm": {"latency_s": 1e-3, "s_per_byte": 1e-6}}, [0, 1, 2])
    assert t["comm"] == [pytest.approx(3 * 1e-3 + 1000 * 1e-6)]
    assert t["comm_grad"] == [pytest.approx(1e-3 + 400 * 1e-6)]


def test_shared_cores_stretch_each_instruction_by_the_ranks_computing_with_it():
    """Ranks sharing cores: an instruction runs slower by how many ranks compute while it runs."""
    from mmpipe.parallel.schedules import stream
    from mmpipe.planning.simulate import simulate_shared_cores
    plain = simulate([1.0], [2.0], 4, order=ONE).step_time
    # data parallel: 4 copies of one stage always compute together on 2 cores -> 2x, or 2.3x when
    # the measured slowdown per unit of oversubscription is 1.3 (1 + (2 - 1) x 1.3)
    assert simulate_shared_cores([1.0], [2.0], 4, [], [0.0], None, 4, 1, 2, order=ONE)[0].step_time == pytest.approx(2 * plain)
    assert simulate_shared_cores([1.0], [2.0], 4, [], [0.0], None, 4, 1, 2, slope=1.3, order=ONE)[0].step_time == \
        pytest.approx(2.3 * plain)
    # enough cores: nothing changes
    F, B = [1.0, 1.0], [2.0, 2.0]
    assert simulate_shared_cores(F, B, 8, [0.0], [0.0] * 2, None, 1, 1, 2, order=ONE)[0].step_time == \
        pytest.approx(simulate(F, B, 8, order=ONE).step_time)
    # two stages on one core: the fill (stage 0's first forward alone) runs at full speed, the
    # steady state at half: between 1x and 2x the dedicated-core step
    r, stretch = simulate_shared_cores(F, B, 8, [0.0], [0.0] * 2, None, 1, 1, 1, order=ONE)
    base = simulate(F, B, 8, order=ONE).step_time
    assert 1.3 * base < r.step_time < 2 * base
    first_fwd = [i for i, a in enumerate(stream("1f1b", 2, 8, 0)) if a.kind == "ForwardPass"][0]
    assert stretch[0][first_fwd] == pytest.approx(1.0, abs=0.02)
    assert max(max(s) for s in stretch) == pytest.approx(2.0, abs=0.05)


def test_micro_batch_recommendation_and_its_limit():
    rec = recommend_micro_batches([1.0, 1.0], [2.0, 2.0], [0.0], [0.0, 0.0], per_rank_batch=64, target_bubble=0.1, order=ONE)
    assert rec["best"]["micro_batches"] == 16  # (P-1)/(M+P-1) <= 0.1 first at M = 9 -> next divisor 16
    assert rec["best"]["bubble"] <= 0.1
    rec = recommend_micro_batches([1.0, 1.0], [2.0, 2.0], [0.0], [0.0, 0.0], per_rank_batch=4, target_bubble=0.1, order=ONE)
    assert rec["best"] is None and "at most 4 micro-batches" in rec["why"]
    rec = recommend_micro_batches([1.0, 3.0], [2.0, 6.0], [0.0], [0.0, 0.0], per_rank_batch=64, target_bubble=0.1, order=ONE)
    assert rec["best"] is None and "unbalanced" in rec["why"]


# ---- placements from measured costs ----------------------------------------------------------------
def _profile(vision_fwd, vision_bwd, text_fwd=1.0, text_bwd=2.0, n_vision=6, n_text=4):
    from mmpipe.planning.profiler import LayerCost
    names = ([f"vision.blocks.{i}" for i in range(n_vision)] + [f"text.blocks.{i}" for i in range(n_text)])
    layers = []
    for n in names:
        f, b = (vision_fwd, vision_bwd) if n.startswith("vision") else (text_fwd, text_bwd)
        layers.append(LayerCost(n, f, b, act_bytes=1000, out_bytes=100, param_bytes=400, params=100,
                                trainable=0 if (n.startswith("vision") and b == 0) else 100).to_dict())
    prof = {"layers": layers, "comm": {"latency_s": 0.0, "s_per_byte": 0.0}}
    return prof, names, ["image" if n.startswith("vision") else "text" for n in names]


def place(prof, names, branches, P, placement, micro_batches):
    """The planner's Plan, as (parts, {placement: prediction})."""
    from mmpipe.planning.place import place as plan
    p = plan(names, branches, P, placement, micro_batches, schedule="1f1b", prof=prof)
    assert p.layers == names and p.segments == branches and p.costs == "profile"
    return p.parts, p.predicted


def test_modality_splits_stages_in_proportion_to_branch_cost():
    prof, names, branches = _profile(3.0, 6.0, n_vision=6, n_text=6)  # vision tower 3x the text tower
    parts, _ = place(prof, names, branches, 4, "modality", micro_batches=8)
    kinds = [{branches[i] for i in range(a, b)} for a, b in zip(parts, parts[1:])]
    assert kinds == [{"image"}, {"image"}, {"image"}, {"text"}]


def test_frozen_tower_is_costed_forward_only_and_the_plan_shifts():
    trainable, names, branches = _profile(2.0, 4.0)
    frozen, _, _ = _profile(2.0, 0.0)  # frozen vision: forward only (what the profiler measures)
    p_train, _ = place(trainable, names, branches, 2, "balanced", micro_batches=8)
    p_frozen, preds = place(frozen, names, branches, 2, "balanced", micro_batches=8)
    # vision costs 36 units trained (of 48): the boundary sits inside the vision tower; frozen it
    # costs 12 (of 24): the boundary moves to the branch border
    assert p_train == [0, 4, 10] and p_frozen == [0, 6, 10]
    auto, preds = place(frozen, names, branches, 2, "auto", micro_batches=8)
    assert set(preds) == {"modality", "balanced"} and auto == preds[min(preds, key=lambda k: preds[k]["step_time"])]["parts"]


@pytest.mark.parametrize("seed", range(10))
def test_auto_takes_the_placement_the_simulator_predicts_faster(seed):
    rng = random.Random(seed)
    prof, names, branches = _profile(1.0, 2.0, n_vision=rng.randint(2, 8), n_text=rng.randint(2, 8))
    for layer in prof["layers"]:
        layer["fwd_ms"], layer["bwd_ms"] = rng.uniform(0.5, 3), rng.uniform(0.5, 6)
    P = rng.randint(2, 4)
    chosen, preds = place(prof, names, branches, P, "auto", micro_batches=rng.choice([2, 4, 8]))
    assert chosen == min(preds.values(), key=lambda p: p["step_time"])["parts"]
    mod = preds["modality"]["parts"]
    assert all(len({branches[i] for i in range(a, b)}) == 1 for a, b in zip(mod, mod[1:]))


# ---- trace outputs ---------------------------------------------------------------------------------
def test_trace_json_and_png_are_written(tmp_path):
    import json

    from mmpipe.parallel.stage_clock import write_timeline_png, write_trace
    events0 = [("ForwardPass", 0, 1.0, 1.5, 1), ("SendActivation", 0, 1.5, 1.6, 1), ("BackwardPass", 0, 2.0, 3.0, 1)]
    events1 = [("RecvActivation", 0, 1.5, 1.6, 1), ("ForwardPass", 0, 1.6, 1.8, 1), ("BackwardPass", 0, 1.8, 2.0, 1)]
    trace = write_trace(str(tmp_path / "t.json"), [(events0, 100.0), (events1, 100.0)], [(0, 0), (1, 0)])
    loaded = json.load(open(tmp_path / "t.json"))
    assert loaded == trace
    xs = [e for e in loaded["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 6 and min(e["ts"] for e in xs) == 0.0
    assert all({"name", "ts", "dur", "pid", "tid"} <= set(e) and e["dur"] >= 0 for e in xs)
    write_timeline_png(str(tmp_path / "t.png"), [(events0, 100.0), (events1, 100.0)], [(0, 0), (1, 0)])
    assert open(tmp_path / "t.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_profile_passes_keep_each_layers_median():
    from mmpipe.planning.profiler import LayerCost, median_costs

    def cost(f, b, o):
        return LayerCost("vision.0", f, b, 10, 20, 30, 40, 40, o)
    runs = [[cost(5.0, 9.0, 1.0), cost(2.0, 3.0, 0.5)],
            [cost(7.0, 8.0, 2.0), cost(30.0, 4.0, 0.4)],   # one pass hit a slowdown on the second layer
            [cost(6.0, 20.0, 1.5), cost(2.2, 3.5, 0.6)]]
    out = median_costs(runs)
    assert [(c.fwd_ms, c.bwd_ms, c.opt_ms) for c in out] == [(6.0, 9.0, 1.5), (2.2, 3.5, 0.5)]
    assert (out[0].act_bytes, out[0].param_bytes, out[0].params) == (10, 30, 40)


def _step_units(seed: int = 0):
    from mmpipe.data.balance import SampleUnits
    rng = np.random.default_rng(seed)
    kind = rng.integers(0, 3, 64)  # text-only conversations, one image, four images
    vision = np.where(kind == 0, 0, np.where(kind == 1, 64, 256)).astype(float)
    tokens = np.where(kind == 0, rng.integers(100, 400, 64), rng.integers(10, 40, 64)) + vision.astype(int)
    return SampleUnits(vision, tokens)


@pytest.mark.parametrize("ranks", [1, 2])
def test_cost_balance_keeps_the_steps_samples_and_evens_the_slots(ranks):
    """A step of 16 micro-batches of 4 (vision on stage 0, the decoder on stage 1): the regrouped step
    holds the same samples in groups of the same sizes, is predicted faster than the sampler's grouping,
    within 5% of the balanced ideal, and comes out the same when computed again (every reading rank
    computes it for itself)."""
    from mmpipe.data.balance import StagePrices, StepBalancer
    units = _step_units()
    prices = StagePrices([1e-4, 0.0], [0.0, 2e-5], max_length=1024, pad_multiple=4, order=ONE)
    plain = [list(range(i, i + 4)) for i in range(0, 64, 4)]
    b = StepBalancer(units, prices, ranks)
    got = b.regroup(plain)
    assert sorted(i for g in got for i in g) == list(range(64)) and [len(g) for g in got] == [4] * 16
    assert b.step_time(got) < b.step_time(plain) / 1.05, (b.step_time(got), b.step_time(plain))
    assert b.last["step_after"] <= 1.05 * b.last["ideal"], b.last
    assert StepBalancer(units, prices, ranks).regroup(plain) == got


def test_cost_balance_groups_caption_lengths_across_data_parallel_ranks():
    """A dual encoder (one fixed-size image per sample) at DP = 2 with captions of 6 or 30 tokens: the
    plain grouping pads most micro-batches to 32; regrouping puts like lengths together and evens the ranks."""
    from mmpipe.data.balance import SampleUnits, StagePrices, StepBalancer
    tokens = np.array([6, 30] * 16)
    units = SampleUnits(np.ones(32), tokens)
    prices = StagePrices([1e-3], [1e-4], max_length=32, pad_multiple=4)
    plain = [list(range(i, i + 4)) for i in range(0, 32, 4)]
    b = StepBalancer(units, prices, 2)
    got = b.regroup(plain)
    assert all(len(set(tokens[g])) == 1 for g in got), [tokens[g].tolist() for g in got]
    assert b.last["step_after"] < b.last["step_before"] and b.last["step_after"] <= 1.001 * b.last["ideal"]


def test_refit_recovers_the_measured_prices_from_micro_batch_times():
    """Micro-batch times generated from known prices (vision twice, tokens half the profile's, 3 ms per
    micro-batch, 3% noise): the refit finds them and its prediction error falls; when every micro-batch
    holds the same vision units, that price cannot be told from the base and stays the profile's."""
    from mmpipe.planning.prices import refit_stage
    rng = np.random.default_rng(0)
    F = np.column_stack([rng.integers(0, 400, 200), 4 * rng.integers(50, 600, 200)]).astype(float)
    y = (3e-3 + 2e-5 * F[:, 0] + 1e-6 * F[:, 1]) * (1 + 0.03 * rng.standard_normal(200))
    fit = refit_stage(1e-5, 2e-6, F, y)
    assert fit["vision"] == pytest.approx(2.0, rel=0.05) and fit["tokens"] == pytest.approx(0.5, rel=0.1)
    assert fit["base"] == pytest.approx(3e-3, rel=0.2) and fit["error_after"] < fit["error_before"] / 5
    same = np.column_stack([np.full(50, 4.0), rng.integers(20, 100, 50)])
    fit = refit_stage(1e-3, 1e-4, same, 0.01 + 2e-4 * same[:, 1])
    assert fit["vision"] == pytest.approx(1.0, abs=0.05) and fit["tokens"] == pytest.approx(2.0, rel=0.1)


def test_a_refit_worse_than_the_profiles_prices_is_not_taken():
    """Micro-batches that cost what the profile says, but one in forty slowed 6x (a pause): least squares
    alone doubled the mean absolute error on them (0.12 -> 0.25 here); the prior's prices are kept."""
    from mmpipe.planning.prices import refit_stage
    rng = np.random.default_rng(0)
    F = np.column_stack([rng.integers(1, 5, 40), rng.integers(50, 400, 40)]).astype(float)
    y = 1e-3 * F[:, 0] + 2e-5 * F[:, 1]
    y[0] *= 6
    fit = refit_stage(1e-3, 2e-5, F, y)
    assert (fit["vision"], fit["tokens"], fit["base"]) == (1.0, 1.0, 0.0)
    assert fit["error_after"] == fit["error_before"] > 0.1


def test_refit_prices_regroup_from_their_step_and_a_resume_keeps_them():
    """A sampler told new prices from step 3 regroups steps 0-2 as before and 3 on with them (here: the
    vision stage much dearer, so the grouping changes); a sampler resumed at step 2 from the saved
    position regroups every later step identically; a step already regrouped cannot be repriced."""
    from mmpipe.data.balance import StagePrices, StepBalancer
    from mmpipe.data.sampler import MicroBatchSampler
    units = _step_units()
    prices = StagePrices([1e-4, 0.0], [0.0, 2e-5], max_length=1024, pad_multiple=4, order=ONE)
    make = lambda start=0, at=None: MicroBatchSampler(  # noqa: E731
        64, 4, 8, 2, 0, seed=1, start_step=start, start_at=at, balancer=StepBalancer(units, prices, 2))
    plain, refit = make(), make()
    for s in range(3):
        assert refit.micro_batches(s, True) == plain.micro_batches(s, True)
    with pytest.raises(RuntimeError, match="regrouped before"):
        refit.reprice(prices.scaled([20.0, 1.0], [1.0, 1.0], [0.0, 0.0]), 3)  # (optimizer steps count from 1)
    refit.reprice(prices.scaled([20.0, 1.0], [1.0, 1.0], [1e-3, 0.0]), 4)
    changed = [refit.micro_batches(s, True) != plain.micro_batches(s, True) for s in range(3, 6)]
    assert any(changed) and refit.balancer.prices.vision[0] == pytest.approx(2e-3)
    again = make()
    again.micro_batches(1)
    again.reprice(prices.scaled([20.0, 1.0], [1.0, 1.0], [1e-3, 0.0]), 4)
    resumed = make(2, again.position(2))
    assert [resumed.micro_batches(s, True) for s in range(2, 6)] == [refit.micro_batches(s, True) for s in range(2, 6)]


def test_cost_balance_with_variable_micro_batches_evens_padded_slots():
    """Padded chat rows at P = 2 (vision on stage 0, the decoder on stage 1), a few long conversations
    among short questions: with fixed sizes every micro-batch holding a long row pads all its rows to
    it; with ``variable`` sizes (families whose shapes change per micro-batch) long rows share
    micro-batches with fewer rows (down to one alone), so the slots come out evener and the step faster - the same samples,
    no micro-batch emptied or heavier (vision units, token slots) than the heaviest plain one."""
    from mmpipe.data.balance import SampleUnits, StagePrices, StepBalancer
    rng = np.random.default_rng(3)
    vision = rng.choice([0, 16, 64], 64, p=[0.4, 0.4, 0.2]).astype(float)
    tokens = np.where(rng.random(64) < 0.15, rng.integers(300, 500, 64), rng.integers(10, 60, 64)) + vision.astype(int)
    units = SampleUnits(vision, tokens)
    prices = StagePrices([1e-4, 0.0], [0.0, 2e-5], max_length=1024, pad_multiple=4, order=ONE)
    plain = [list(range(i, i + 4)) for i in range(0, 64, 4)]
    fixed, var = StepBalancer(units, prices, 1), StepBalancer(units, prices, 1, variable=True)
    a, b = fixed.regroup(plain), var.regroup(plain)
    assert sorted(i for g in b for i in g) == list(range(64)) and len(b) == 16 and min(len(g) for g in b) >= 1
    assert len({len(g) for g in b}) > 1
    cap = fixed.features(plain).max(axis=0)
    assert (var.features(b) <= cap + 1e-9).all()
    # (here the seven long rows take a micro-batch each, the short ones share the other nine: spread 3.2 -> 1.26;
    # a long row with anything beside it would pad that to its length)
    assert var.last["after"] < fixed.last["after"] / 2 and var.last["after"] < 1.3, (fixed.last, var.last)
    assert var.last["step_after"] < fixed.last["step_after"], (fixed.last, var.last)


def test_regrouping_ahead_in_a_worker_process_gives_the_same_groups():
    """With ``start_ahead`` each next step is regrouped in a worker process while the current one
    trains: the same groups and predictions as regrouping inline, also across a refit (the step
    regrouped ahead with the old prices is done again with the new)."""
    from mmpipe.data.balance import StagePrices, StepBalancer
    from mmpipe.data.sampler import MicroBatchSampler
    units = _step_units()
    prices = StagePrices([1e-4, 0.0], [0.0, 2e-5], max_length=1024, pad_multiple=4, order=ONE)
    make = lambda: MicroBatchSampler(64, 4, 8, 2, 0, seed=1, balancer=StepBalancer(units, prices, 2, variable=True))  # noqa: E731
    inline, ahead = make(), make()
    ahead.balancer.start_ahead()
    here, regroup = [], ahead.balancer.regroup
    ahead.balancer.regroup = lambda groups: here.append(1) or regroup(groups)  # regroupings in this process
    try:
        for s in range(5):
            if s == 2:  # told at step 1's end, as the trainer does; step 2 was already asked of the worker
                for smp in (inline, ahead):
                    smp.reprice(prices.scaled([5.0, 1.0], [1.0, 1.0], [1e-3, 0.0]), 3)
            assert ahead.micro_batches(s, True) == inline.micro_batches(s, True)
            a, b = ahead.step_plan(s + 1), inline.step_plan(s + 1)  # (the trainer's steps count from 1)
            assert a.predicted["step_after"] == b.predicted["step_after"] and (a.features == b.features).all()
        assert set(ahead.balancer.ahead.pending) == {5} and len(here) == 2  # steps 0 and 2: the rest came ahead
        # a lost worker: a warning, and the steps are regrouped here, the same
        import time
        pool = ahead.balancer.ahead.pool
        for proc in list(pool._processes.values()):
            proc.kill()
            proc.join()
        deadline = time.time() + 30
        while not pool._broken and time.time() < deadline:  # (the executor notices the lost process)
            time.sleep(0.05)
        with pytest.warns(UserWarning, match="regrouping worker failed"):
            assert ahead.micro_batches(5, True) == inline.micro_batches(5, True)
        assert ahead.balancer.ahead is None and ahead.micro_batches(6, True) == inline.micro_batches(6, True)
    finally:
        ahead.balancer.close()


def test_cost_balance_refuses_a_loss_that_depends_on_the_grouping(capsys, tmp_path, tiny_data):
    """A dual encoder whose negatives are its micro-batch's: regrouping would change every micro-batch's
    loss, so ``data.balance: cost`` is a one-line error before anything is written."""
    from helpers import TINY

    from mmpipe.cli.main import main
    rc = main(["train", "--config", TINY, "--set", "model.negatives=micro_batch", "--set", "data.balance=cost",
               "--set", f"data.train={tiny_data['train']}", "--set", f"train.output_dir={tmp_path / 'run'}",
               "--set", "parallel.pipeline_stages=1"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "data.balance=cost regroups" in lines[0], lines
    assert "model.negatives=global" in lines[0]


# ---- a memory budget bounds every cut -----------------------------------------------------------------
def _stage_mem(prof, parts, P, M):
    """The planner's bytes per stage (what ``parallel.memory_budget_gb`` caps): parameters and state, and
    activations in flight."""
    from mmpipe.planning.memory import bytes_per_param, held
    from mmpipe.planning.place import layer_costs
    per_t, per_f = bytes_per_param("fp32", 0, 1)
    mem = [c.static_bytes(per_t, per_f) + held(0, P, M, ONE) * c.act_bytes for c in layer_costs(prof)]
    return [sum(mem[a:b]) for a, b in zip(parts, parts[1:])]


def test_auto_returns_only_a_cut_under_the_memory_cap_and_says_which_was_over():
    """The modality cut is as fast as any, but its vision stage holds six layers: under a cap below that,
    ``auto`` returns a balanced cut that fits and says the modality one was over; ``modality`` alone is
    one line."""
    from mmpipe.errors import ConfigError
    from mmpipe.planning.place import place as plan
    prof, names, branches = _profile(2.0 / 3, 4.0 / 3)  # both branches 12 units: modality is balanced
    modality = plan(names, branches, 2, "modality", 4, schedule="1f1b", prof=prof).parts
    cap = max(_stage_mem(prof, modality, 2, 4)) - 1
    p = plan(names, branches, 2, "auto", 4, schedule="1f1b", prof=prof, memory_cap=cap)
    assert p.chosen == "balanced" and max(_stage_mem(prof, p.parts, 2, 4)) <= cap
    assert set(p.predicted) == {"balanced"} and "over parallel.memory_budget_gb: modality" in p.why
    assert plan(names, branches, 2, "auto", 4, schedule="1f1b", prof=prof).parts == modality  # (no cap: modality)
    with pytest.raises(ConfigError, match="no cut fits the memory cap"):
        plan(names, branches, 2, "modality", 4, schedule="1f1b", prof=prof, memory_cap=cap)


def test_a_replan_moves_only_to_a_cut_under_the_memory_budget():
    """``parallel.replan: auto`` chooses its new cut under ``parallel.memory_budget_gb``: the first layers
    hold large activations, so the fastest cut (half the layers each) is over the budget and the move
    goes to one that fits."""
    from types import SimpleNamespace

    import mmpipe
    from helpers import TINY

    from mmpipe.config.resolve import build_family
    from mmpipe.parallel.plan import Plan
    from mmpipe.parallel.topology import Topology
    from mmpipe.planning.profiler import LayerCost
    from mmpipe.train.replan import Replanner
    fam = build_family(mmpipe.load_config(TINY, ["model.text.vocab_size=300"]).model, 0)
    names, segments = fam.layer_names(), fam.segments()
    n = len(names)
    prof = {"layers": [LayerCost(name, 1.0, 2.0, act_bytes=10**6 if i < n // 2 else 10**3, out_bytes=100,
                                 param_bytes=400, params=100, trainable=100).to_dict() for i, name in enumerate(names)],
            "comm": {"latency_s": 0.0, "s_per_byte": 0.0}}
    big = _stage_mem(prof, [0, 1, 2], 2, 4)[0]  # one large layer
    small = _stage_mem(prof, [n - 2, n - 1, n], 2, 4)[0]
    cap_gb = (n // 2 - 2) * big / 2**30 + (n - n // 2) * small / 2**30 + 1e-12

    def decide(budget):
        cfg = mmpipe.load_config(TINY, ["model.text.vocab_size=300", "parallel.replan=auto",
                                        "parallel.replan_window=1", "parallel.replan_margin=0.05"]
                                 + ([f"parallel.memory_budget_gb={budget}"] if budget else []))
        run = SimpleNamespace(cfg=cfg, family=fam, frozen=(None, frozenset(), frozenset()), is_reporter=False,
                              topo=Topology(world_size=2, pipeline_stages=2, micro_batch_size=4, batch_size=16),
                              plan=Plan(names, segments, [0, 1, n], "modality", 4, 4))
        r = Replanner(run, 0)
        r.prof, r.seen = prof, [(0.2, [0.01, 0.19])]  # the poor cut's measured step: stage 1 does all
        return r._decide(run)
    free = decide(None)
    assert max(_stage_mem(prof, free["new_parts"], 2, 4)) > cap_gb * 2**30  # the fastest cut: over the budget
    capped = decide(cap_gb)
    assert capped is not None and capped["new_parts"] != [0, 1, n]
    assert max(_stage_mem(prof, capped["new_parts"], 2, 4)) <= cap_gb * 2**30


def test_text_layers_price_their_attention_by_length_squared():
    """Qwen3.5's prices from a layer profile (each layer 1 ms forward, 2 ms backward at the example shape):
    the GatedDeltaNet blocks and the vision side are linear in their units (no squares); the full-attention
    block splits its time between slots and squares as its FLOPs split (QK^T and AV: the part that quadruples
    when the rows double), and the two parts give back the measured time at the profiled shape."""
    from helpers import TINY_CONFIGS

    from mmpipe.config.resolve import build_family
    from mmpipe.config.schema import load_config
    from mmpipe.planning.prices import layer_prices, square_share
    cfg = load_config(TINY_CONFIGS["qwen3_5"], ["model.llm.vocab_size=120", "model.image_token_id=5"])
    family = build_family(cfg)
    names = family.layer_names()
    prof = {"layers": [{"name": n, "fwd_ms": 1.0, "bwd_ms": 2.0, "act_bytes": 0, "out_bytes": 0, "param_bytes": 0,
                        "params": 0, "trainable": 0} for n in names]}
    p = layer_prices(prof, family, cfg, 2)
    kinds = family.text_cfg.layer_types
    for i, name in enumerate(names):
        if name.startswith("llm.blocks."):
            full = kinds[int(name.rsplit(".", 1)[1])] == "full_attention"
            assert (p["squares"][i] > 0) == full, (name, p["squares"][i])
        else:
            assert p["squares"][i] == 0.0, name
    mbs = [(1.0, family.micro_batch(b)) for _, b in family.example_batches(2, cfg.data.max_length, "cpu")]
    (_, mb), = mbs
    full = names.index(f"llm.blocks.{kinds.index('full_attention')}")
    share = square_share(family, names[full], mbs)
    assert 0.05 < share < 0.95, share
    rebuilt = p["seconds"][full] * mb.rows * mb.seq_len + p["squares"][full] * mb.rows * mb.seq_len ** 2
    assert rebuilt == pytest.approx(3e-3, rel=1e-9)
    assert p["squares"][full] * mb.rows * mb.seq_len ** 2 == pytest.approx(3e-3 * share, rel=1e-9)


def test_squares_make_long_rows_cost_more_than_their_slots_and_a_refit_scales_both():
    """A micro-batch's predicted cost adds rows x padded length² at the squares price: one row of 64 costs
    more than four of 16 (the same slots) once attention is priced, and exactly as much without; the
    balancer's step prediction and a refit's text column (slots plus squares in slots) follow it."""
    from mmpipe.data.balance import SampleUnits, StagePrices, StepBalancer
    units = SampleUnits(np.zeros(5), np.array([64, 16, 16, 16, 16]))
    flat = StagePrices([0.0], [1e-4], max_length=64)
    squared = StagePrices([0.0], [1e-4], max_length=64, squares=[1e-5])
    for prices, more in ((flat, False), (squared, True)):
        b = StepBalancer(units, prices, 1)
        long_row, short_rows = b.group_cost([0])[0], b.group_cost([1, 2, 3, 4])[0]
        assert (long_row > short_rows * 1.5) if more else long_row == pytest.approx(short_rows)
    b = StepBalancer(units, squared, 1)
    F = b.features([[0], [1, 2, 3, 4]])
    assert F.tolist() == [[0.0, 64.0, 4096.0], [0.0, 64.0, 1024.0]]
    assert b.group_cost([0])[0] == pytest.approx(1e-4 * 64 + 1e-5 * 4096)
    text = squared.text_slots(F)
    assert text.tolist() == [[64 + 0.1 * 4096, 64 + 0.1 * 1024]]
    half = squared.scaled([1.0], [0.5], [0.0])
    assert half.tokens == [5e-5] and half.squares == [5e-6]
