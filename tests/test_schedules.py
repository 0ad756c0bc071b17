"""The pipeline order as data (``mmpipe.parallel.schedules``): ``1f1b`` is DeepSpeed's own schedule instruction
for instruction, and every planner reads the same streams (the simulator, the memory model, the cost
balancer's step price, the stage clock's attribution). No processes."""
import numpy as np
import pytest

from mmpipe.parallel import schedules as S


def _deepspeed(P: int, M: int, s: int, step_loss: bool) -> list:
    """DeepSpeed's schedules for stage s flattened to (instruction, buffer id); a step loss's forward-only pass
    (its InferenceSchedule) first, its forwards named FeaturesPass, then the last stage's gather."""
    from deepspeed.runtime.pipe import schedule as D
    out = []
    for kind in ([D.InferenceSchedule] if step_loss else []) + [D.TrainSchedule]:
        first = kind is D.InferenceSchedule
        for step in kind(micro_batches=M, stages=P, stage_id=s).steps():
            for c in step:
                name = type(c).__name__
                out.append(("FeaturesPass" if first and name == "ForwardPass" else name, c.kwargs.get("buffer_id")))
        if first and s == P - 1:
            out.append(("GatherFeatures", None))
    return out


def _ours(P: int, M: int, s: int, step_loss: bool) -> list:
    """The stream with DeepSpeed's buffer ids: micro-batch modulo the buffers of its pass (the forward-only
    pass two, the training pass ``schedules.buffers``)."""
    train = S.stream("1f1b", P, M, s)
    whole = S.stream("1f1b", P, M, s, step_loss=step_loss)
    first = len(whole) - len(train)
    n = S.buffers(train)
    return [(a.kind, None if a.micro_batch is None else a.micro_batch % (2 if i < first else n))
            for i, a in enumerate(whole)]


@pytest.mark.parametrize("step_loss", [False, True])
def test_1f1b_is_deepspeeds_train_schedule_instruction_for_instruction(step_loss):
    for P in range(2, 7):
        for M in range(1, 13):
            for s in range(P):
                assert _ours(P, M, s, step_loss) == _deepspeed(P, M, s, step_loss), (P, M, s)


def test_the_memory_model_holds_the_streams_activations():
    """``planning.memory.held`` is the stream's count: 1F1B's min(P - s, M), GPipe's M, and a forward-only
    stage of ``frozen_first`` keeps none for a backward (one micro-batch at a time)."""
    from mmpipe.planning.memory import held
    for P in range(2, 7):
        for M in range(1, 13):
            for s in range(P):
                assert held(s, P, M, S.Order("1f1b")) == S.live_activations(S.stream("1f1b", P, M, s)) == min(P - s, M)
                assert held(s, P, M, S.Order("gpipe")) == M
                assert held(s, P, M, S.Order("frozen_first", 1)) == (1 if s == 0 else min(P - s, M))
                assert held(s, P, M, S.Order("zb_h1")) == min(P - s, M)  # 1F1B's live activations


def test_memory_breakdown_reads_the_schedule():
    """The stage breakdown of a cut under ``frozen_first``: the forward-only stage keeps one micro-batch's
    outputs in flight, not P of them; the stages after it what 1F1B holds."""
    from mmpipe.planning.memory import RunShape, stage_breakdown
    from mmpipe.planning.profiler import LayerCost
    costs = [LayerCost(f"l{i}", fwd_ms=1.0, bwd_ms=0.0 if i < 2 else 2.0, act_bytes=1000, out_bytes=100,
                       param_bytes=40, params=10, trainable=0 if i < 2 else 10) for i in range(6)]
    shape = RunShape(forward_only=frozenset({"l0", "l1"}), order=S.Order("1f1b"))
    plain = stage_breakdown(costs, [0, 2, 4, 6], 8, "fp32", shape=shape)
    first = stage_breakdown(costs, [0, 2, 4, 6], 8, "fp32", shape=RunShape(forward_only=shape.forward_only,
                                                                           order=S.Order("frozen_first", 1)))
    assert first[0].buffers == 2 * 100 < plain[0].buffers == (3 + 1) * 100
    assert [m.total for m in first[1:]] == [m.total for m in plain[1:]]


def test_the_balancers_step_price_is_the_simulators_step():
    """``schedules.step_seconds`` (the cost balancer's price of a rank's micro-batches, vectorised over
    candidates) equals ``simulate`` with each micro-batch's own forward (a third) and backward (two thirds)
    on every stage, for every schedule, on random costs."""
    from mmpipe.planning.simulate import simulate
    rng = np.random.default_rng(0)
    for name, frozen in (("1f1b", 0), ("gpipe", 0), ("frozen_first", 1), ("zb_h1", 0)):
        order = S.Order(name, frozen)
        for P in range(2, 6):
            for M in range(1, 9):
                C = rng.random((5, M, P))
                got = S.step_seconds(order, C)
                for i in range(5):
                    only = [S.forward_only(x) for x in order.streams(P, M)]
                    F = [[C[i, m, s] * (1.0 if only[s] else 1 / 3) for m in range(M)] for s in range(P)]
                    B = [[C[i, m, s] * 2 / 3 for m in range(M)] for s in range(P)]
                    W = [float(np.mean(C[i, :, s])) / 3 for s in range(P)] if name == "zb_h1" else None
                    if W is not None:  # (the simulator's W is per stage: a micro-batch-independent check)
                        C[i] = np.mean(C[i], axis=0, keepdims=True)
                        got = S.step_seconds(order, C)
                        F = [[C[i, 0, s] / 3] * M for s in range(P)]
                        B = [[C[i, 0, s] * 2 / 3] * M for s in range(P)]
                        W = [C[i, 0, s] / 3 for s in range(P)]
                    want = simulate(F, B, M, W=W, order=order).step_time
                    assert got[i] == pytest.approx(want, abs=1e-9), (name, P, M)


def test_frozen_first_stages_never_wait_for_a_gradient_and_every_order_runs():
    """The forward-only stages' streams hold no backward, no gradient receive or send; the first trained
    stage receives its inputs and sends no gradient back; each micro-batch is forwarded (and, on a stage
    that trains, backpropagated) once; every schedule replays without a deadlock."""
    for P in range(2, 6):
        for M in range(1, 9):
            for k in range(1, P):
                sts = S.streams("frozen_first", P, M, k)
                for s, st in enumerate(sts):
                    kinds = [a.kind for a in st]
                    assert sorted(a.micro_batch for a in st if a.kind == "ForwardPass") == list(range(M))
                    if s < k:
                        assert not {"BackwardPass", "RecvGrad", "SendGrad"} & set(kinds), (P, M, k, s)
                    else:
                        assert sorted(a.micro_batch for a in st if a.kind == "BackwardPass") == list(range(M))
                    if s == k:
                        assert "SendGrad" not in kinds and kinds.count("RecvActivation") == M
                S.order(sts)
            for name in S.SCHEDULES:
                S.order(S.streams(name, P, M, 1))
    assert S.streams("frozen_first", 4, 6, 0) == S.streams("1f1b", 4, 6)  # nothing frozen: 1F1B


def test_a_registered_schedule_is_read_by_the_simulator():
    """The registry is open: a schedule added by ``register`` is simulated by name, and an unknown name is
    one line that lists the known ones."""
    @S.register("test_gpipe_alias")
    def alias(P, M, s, frozen=0):
        return S.gpipe(P, M, s)
    try:
        from mmpipe.planning.simulate import simulate
        a = simulate([1.0, 2.0], [2.0, 3.0], 4, [0.1], order=S.Order("test_gpipe_alias")).step_time
        assert a == simulate([1.0, 2.0], [2.0, 3.0], 4, [0.1], order=S.Order("gpipe")).step_time
    finally:
        del S.SCHEDULES["test_gpipe_alias"]
        S.streams.cache_clear()
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'.*1f1b"):
        S.stream("zb", 2, 2, 0)


def test_auto_picks_frozen_first_when_the_simulator_predicts_it_faster():
    """``pick_schedule``: a frozen first stage and measured costs: ``auto`` takes the faster prediction and
    keeps both; nothing frozen: 1F1B; ``frozen_first`` asked for where stage 0 trains is one line."""
    from mmpipe.errors import ConfigError
    from mmpipe.parallel.plan import Plan
    from mmpipe.planning.place import pick_schedule
    layers = [{"name": f"l{i}", "fwd_ms": 2.0, "bwd_ms": 0.0 if i < 2 else 4.0, "act_bytes": 1000, "out_bytes": 100,
               "param_bytes": 40, "params": 10, "trainable": 0 if i < 2 else 10}  for i in range(4)]
    prof = {"layers": layers, "comm": {"latency_s": 1e-3, "s_per_byte": 1e-6},
            "key": {"forward_only": ["l0", "l1"]}}
    plan = pick_schedule("auto", Plan([f"l{i}" for i in range(4)], ["v", "v", "t", "t"], [0, 2, 4], "modality", 8),
                         prof, {"l0", "l1"})
    assert plan.frozen_stages == 1 and set(plan.schedules) == {"1f1b", "frozen_first", "zb_h1"}
    assert plan.schedules["frozen_first"] < plan.schedules["1f1b"] and plan.schedule == "frozen_first"
    kept = pick_schedule("1f1b", Plan([f"l{i}" for i in range(4)], ["v"] * 4, [0, 2, 4], "modality", 8), prof,
                         {"l0", "l1"})
    assert kept.order == S.Order("1f1b")  # (the leading frozen stages are an order's only where it reads them)
    none = pick_schedule("auto", Plan([f"l{i}" for i in range(4)], ["v"] * 4, [0, 1, 4], "modality", 8), prof, set())
    assert none.schedule == "1f1b" and none.frozen_stages == 0
    with pytest.raises(ConfigError, match=r"parallel.schedule=frozen_first: stage 0 \(l0 .. l0\) trains l0 \(HOW\); "):
        pick_schedule("frozen_first", Plan(["l0", "l1"], ["v", "t"], [0, 1, 2], "modality", 4), None, set(),
                      lambda layer: "HOW")


@pytest.mark.parametrize("config,sets,layer,key", [
    ("tiny_vlm.yaml", ["optim.freeze_vit=true"], "projector", "its group projector: optim.freeze_aligner=true"),
    ("tiny.yaml", ["optim.freeze_vision=true"], "visual_projection", "its group projector: optim.freeze_projector=true"),
    ("tiny.yaml", ["optim.freeze_vision=true", "optim.freeze_projector=true"], "text.embed",
     "its group text: optim.freeze_text=true")])
def test_frozen_firsts_refusal_names_the_layer_that_trains_and_the_familys_key(config, sets, layer, key):
    """Where stage 0 trains a layer, ``frozen_first``'s refusal names that layer and the key of this family that
    freezes it (not ``optim.freeze_vit`` when it is set, nor for CLIP, which has no such key)."""
    import os

    from helpers import ROOT

    import mmpipe
    from mmpipe.config.groups import freeze_key, frozen_layout, resolve_groups
    from mmpipe.planning.offline import resolve_for_plan
    cfg, fam = resolve_for_plan(mmpipe.load_config(os.path.join(ROOT, "configs", config), sets))
    fo = frozen_layout(fam, resolve_groups(cfg.optim, type(fam))).forward_only
    assert next(n for n in fam.layer_names() if n not in fo) == layer
    assert freeze_key(cfg.optim, fam, layer) == key


def test_zb_h1_runs_each_pass_once_in_order_with_1f1bs_activations_and_a_third_of_its_bubble():
    """For P 2..6 and M 1..12: every micro-batch has one F, one B and one W per stage, each W after its B and each B
    after its F (on the first stage, which sends no input gradient, B and W run as one fused backward); the shared replay meets every send and receive (no deadlock); DeepSpeed's buffers hold (one
    received gradient at a time, a buffer taken again only after its micro-batch sent its gradient); peak live
    activations equal 1F1B's, the weight-gradient queue is counted apart; with F = B = W the bubble at P = 4,
    M = 8 is (P - 1) / (3M + P - 1) = 11.1% (1F1B's 27.3%)."""
    from mmpipe.planning.memory import queued
    from mmpipe.planning.simulate import simulate
    zb, one = S.Order("zb_h1"), S.Order("1f1b")
    for P in range(2, 7):
        for M in range(1, 13):
            sts = zb.streams(P, M)
            S.order(sts)  # every send meets its receive
            for s, st in enumerate(sts):
                at = {}
                for i, a in enumerate(st):
                    assert (a.kind, a.micro_batch) not in at or a.micro_batch is None, (P, M, s, a)
                    at[(a.kind, a.micro_batch)] = i
                n = S.buffers(st)
                for m in range(M):
                    if s == 0:  # nothing between its B and W (it sends no input gradient): one fused backward
                        assert at[("ForwardPass", m)] < at[("BackwardPass", m)] and ("BackwardInputPass", m) not in at
                        continue
                    assert at[("ForwardPass", m)] < at[("BackwardInputPass", m)] < at[("BackwardWeightPass", m)]
                    assert "BackwardPass" not in {a.kind for a in st}
                    if s < P - 1:  # DeepSpeed receives a gradient into one buffer: its B comes before the next
                        r, b = at[("RecvGrad", m)], at[("BackwardInputPass", m)]
                        assert r < b and not any(a.kind == "RecvGrad" for a in st[r + 1:b]), (P, M, s, m)
                    if m >= n:  # a pipe buffer is taken again only once its last micro-batch is done with it
                        assert at[("SendGrad", m - n)] < at[("RecvActivation", m)], (P, M, s, m)
                last = ("BackwardWeightPass" if s else "BackwardPass", M - 1)
                assert at[last] < at[("ReduceTiedGrads", None)]  # every W before the step
                assert S.live_activations(st) == S.live_activations(one.streams(P, M)[s])
                assert (1 if s else 0) <= queued(s, P, M, zb) <= min(s + 1, M) and queued(s, P, M, one) == 0
                in_flight = peak = 0  # forward run, weight gradient not yet: at most P micro-batches (the paper's bound)
                for a in st:
                    in_flight += (a.kind == "ForwardPass") - (a.kind in ("BackwardWeightPass", "BackwardPass"))
                    peak = max(peak, in_flight)
                assert peak <= min(P, M), (P, M, s)
    unit = simulate([1.0] * 4, [2.0] * 4, 8, W=[1.0] * 4, order=zb)
    assert unit.bubble == pytest.approx(3 / 27) and unit.bubble <= 0.12
    assert simulate([1.0] * 4, [2.0] * 4, 8, order=one).bubble == pytest.approx(9 / 33)


def test_the_memory_model_counts_the_weight_gradient_queue_and_the_early_buffers():
    """Under zb_h1 a stage holds 1F1B's activations, plus its queued weight-gradient inputs (``LayerCost.w_bytes``
    per micro-batch queued) and the inputs it receives before an earlier micro-batch's backward (one more pipe
    buffer); a layer without trainable linear layers queues nothing."""
    from mmpipe.planning.memory import RunShape, stage_breakdown
    from mmpipe.planning.profiler import LayerCost
    costs = [LayerCost(f"l{i}", fwd_ms=1.0, bwd_ms=2.0, act_bytes=1000, out_bytes=100, param_bytes=40, params=10,
                       trainable=10, in_bytes=100, w_bytes=300) for i in range(8)]
    parts, M = [0, 2, 4, 6, 8], 8
    one = stage_breakdown(costs, parts, M, "fp32", shape=RunShape(order=S.Order("1f1b")))
    zb = stage_breakdown(costs, parts, M, "fp32", shape=RunShape(order=S.Order("zb_h1")))
    for s in range(4):
        early = S.buffers(S.Order("zb_h1").streams(4, M)[s]) - max(2, S.live_activations(S.Order("1f1b").streams(4, M)[s]))
        assert zb[s].activations - one[s].activations == S.queued_weight_grads(S.Order("zb_h1").streams(4, M)[s]) * 2 * 300
        assert zb[s].buffers - one[s].buffers == (early * 100 if s else 0)
