"""CLIP's contrastive loss over the whole global batch (``model.negatives: global``): the loss on
given features is open_clip's; the feature cache reproduces its first pass bit for bit under
dropout and gives autograd's gradient; every layout trains like one process on one micro-batch of
the whole global batch; ``micro_batch`` negatives train differently."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers import TINY, assert_same_training, train_losses

import mmpipe
from mmpipe.config.resolve import build_family
from mmpipe.families.base import Family
from mmpipe.parallel.plain import plain_model
from mmpipe.parallel.schedules import Order
from mmpipe.parallel.step_loss import FirstPassMemo, Replay, StepLossCache, frozen_prefix, is_stochastic

TINY_SETS = ["model.text.vocab_size=300", "model.text.max_position_embeddings=16", "model.text.eos_token_id=2"]
ONE = Order("1f1b")  # DeepSpeed's order


def test_the_batch_loss_is_open_clips_on_the_same_features():
    from open_clip.loss import ClipLoss as OpenClipLoss

    from mmpipe.families.clip.model import ClipLoss, l2_normalize
    family = build_family(mmpipe.load_config(TINY, TINY_SETS).model)
    g = torch.Generator().manual_seed(0)
    img, txt = torch.randn(24, 32, generator=g, requires_grad=True), torch.randn(24, 32, generator=g, requires_grad=True)
    ours_module = ClipLoss(2.6592)
    ours = family.batch_loss(ours_module, torch.cat([img, txt], dim=-1))
    scale = torch.tensor(2.6592, requires_grad=True)
    theirs = OpenClipLoss()(l2_normalize(img), l2_normalize(txt), scale.exp())
    assert abs(ours.item() - theirs.item()) < 1e-6
    ga = torch.autograd.grad(ours, [img, txt, ours_module.logit_scale])
    gb = torch.autograd.grad(theirs, [img, txt, scale])
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a.reshape(b.shape), b, rtol=1e-5, atol=1e-7)


def test_the_sigmoid_loss_is_open_clips_siglip_loss_on_the_same_features():
    """``model.loss: sigmoid``: SigLIP's loss with a trained temperature and bias, open_clip's
    ``SigLipLoss`` on the same (normalized) features: value and every gradient."""
    from open_clip.loss import SigLipLoss

    from mmpipe.families.clip.model import SigmoidLoss, l2_normalize
    family = build_family(mmpipe.load_config(TINY, TINY_SETS + ["model.loss=sigmoid"]).model)
    module = family.build_layer("loss")
    assert isinstance(module, SigmoidLoss)  # SigLIP's init: log 10 and -10
    assert module.logit_scale.item() == pytest.approx(np.log(10.0)) and module.logit_bias.item() == -10.0
    with torch.no_grad():
        module.logit_scale.fill_(1.3)
        module.logit_bias.fill_(-2.5)
    g = torch.Generator().manual_seed(0)
    img, txt = torch.randn(24, 32, generator=g, requires_grad=True), torch.randn(24, 32, generator=g, requires_grad=True)
    ours = family.batch_loss(module, torch.cat([img, txt], dim=-1))
    scale, bias = torch.tensor(1.3, requires_grad=True), torch.tensor(-2.5, requires_grad=True)
    theirs = SigLipLoss()(l2_normalize(img), l2_normalize(txt), scale.exp(), bias)
    assert abs(ours.item() - theirs.item()) < 1e-6
    ga = torch.autograd.grad(ours, [img, txt, module.logit_scale, module.logit_bias])
    gb = torch.autograd.grad(theirs, [img, txt, scale, bias])
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a.reshape(b.shape), b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
def test_the_blocked_loss_equals_the_whole_matrix(loss):
    """``batch_loss_grads`` holds ``model.loss_block`` rows of the logits at a time: its value and its
    gradients (features, temperature, bias) equal autograd through the whole B x B loss within 1e-6,
    for blocks that divide B, that do not, of one row, and larger than B."""
    family = build_family(mmpipe.load_config(TINY, TINY_SETS + [f"model.loss={loss}"]).model)
    module = family.build_layer("loss")
    with torch.no_grad():
        for p, v in zip(module.parameters(), (2.0, -4.0)):
            p.fill_(v)  # a temperature and bias where every term matters
    params = list(module.parameters())
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(37, 64, generator=g)
    want_loss, want_feat, want_params = Family.batch_loss_grads(family, module, feats, params)  # autograd, whole
    for block in (1, 5, 8, 37, 100):
        family.cfg.loss_block = block
        got_loss, got_feat, got_params = family.batch_loss_grads(module, feats, params)
        assert abs(got_loss.item() - want_loss.item()) < 1e-6, block
        for a, b in zip([got_feat] + got_params, [want_feat] + want_params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
@pytest.mark.parametrize("D", [2, 3, 4])
def test_each_ranks_rows_sum_to_the_whole_loss_and_its_gradients(loss, D):
    """``model.local_loss``: rank r's share (its rows against every sample, the softmax columns'
    log-sum-exp completed from every rank's partial one as the all-gather does) has rows x B pairs;
    the D shares' values and gradients (features, temperature, bias) sum to the whole loss's within
    1e-6, for blocks larger than a rank's rows, equal, not dividing them, and of one row. A share
    alone is not the loss (the comparison can fail)."""
    family = build_family(mmpipe.load_config(TINY, TINY_SETS + [f"model.loss={loss}"]).model)
    assert family.local_step_loss  # the default
    module = family.build_layer("loss")
    with torch.no_grad():
        for p, v in zip(module.parameters(), (2.0, -4.0)):
            p.fill_(v)
    params = list(module.parameters())
    n, b = 12 * D, 12
    feats = torch.randn(n, 64, generator=torch.Generator().manual_seed(3))
    want_loss, want_feat, want_params = Family.batch_loss_grads(family, module, feats, params)
    img, txt = feats.split(32, dim=-1)
    from mmpipe.families.clip.losses import l2_normalize
    a, t = l2_normalize(img), l2_normalize(txt)
    partials = [module.columns(a, t[r * b:(r + 1) * b], 1000) for r in range(D)]  # each rank's, as it sends them
    combine = (lambda mine: torch.logsumexp(torch.stack(partials), dim=0)) if partials[0] is not None else None
    for block in (1000, 12, 5, 1):
        family.cfg.loss_block = block
        shares = [family.batch_loss_grads(module, feats, params, rows=(r * b, (r + 1) * b), combine=combine)
                  for r in range(D)]
        assert abs(sum(s[0].item() for s in shares) - want_loss.item()) < 1e-5, block
        assert abs(shares[-1][0].item() - want_loss.item()) > 1e-3
        torch.testing.assert_close(sum(s[1] for s in shares), want_feat, rtol=1e-5, atol=1e-6)
        for i, w in enumerate(want_params):
            torch.testing.assert_close(sum(s[2][i] for s in shares), w.float(), rtol=1e-5, atol=1e-6)
        for r, s in enumerate(shares):  # a rank's texts get gradient only from its own rows
            txt_grad = s[1][:, 32:]
            assert not txt_grad[:r * b].any() and not txt_grad[(r + 1) * b:].any() and txt_grad[r * b:(r + 1) * b].any()
        # ZeRO-3's way to the parameters: through the module's forward, the same share's gradient
        cols = combine(None) if combine is not None else None
        got = torch.autograd.grad(family.batch_loss(module, feats, rows=(b, 2 * b), cols=cols), params,
                                  allow_unused=True)
        for g, w in zip(got, shares[1][2]):
            torch.testing.assert_close(g.float(), w, rtol=1e-5, atol=1e-6)


def test_sigmoid_negatives_over_micro_batches_only_would_give_another_loss():
    """The layouts below can fail: the mean of each micro-batch's sigmoid loss is not the loss of the
    global batch (its negatives are the other micro-batches' pairs too)."""
    family = build_family(mmpipe.load_config(TINY, TINY_SETS + ["model.loss=sigmoid"]).model)
    module = family.build_layer("loss")
    with torch.no_grad():  # (at SigLIP's init, bias -10, the negatives weigh little: a bias as trained moves it)
        module.logit_bias.fill_(-1.0)
    feats = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    whole = family.batch_loss(module, feats)
    per_micro = torch.stack([family.batch_loss(module, f) for f in feats.split(4)]).mean()
    assert abs(whole.item() - per_micro.item()) > 1e-2


def _batches(cfg, n_micro: int, m: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    size = cfg.model.vision.image_size
    out = []
    for _ in range(n_micro):
        pixels = torch.randint(0, 256, (m, 3, size, size), dtype=torch.uint8, generator=g)
        ids = torch.randint(3, 300, (m, 12), generator=g)
        ids[:, -1] = 2
        out.append((pixels, ids, torch.ones_like(ids)))
    return out


def test_the_cache_replays_dropout_and_gives_autograds_gradient():
    """BERT text tower with transformers' default dropout: the second pass draws the first pass's
    random numbers (features bit for bit), and the surrogates' gradients (DeepSpeed's 1/A applied)
    equal autograd through one forward of every micro-batch under the same random state."""
    cfg = mmpipe.load_config(TINY, TINY_SETS + ["model.text.arch=bert"])
    model = mmpipe.build_model(cfg).train()
    assert is_stochastic(model)
    family, loss_module = model.family, model.get_submodule("loss")
    batches, A = _batches(cfg, 3, 4), 3
    model.executor.features, model.executor.replay = True, Replay(0)

    def features(grad: bool) -> list:
        if model.executor.replay is not None:
            model.executor.replay.start(7)
        with torch.set_grad_enabled(grad):
            return [model(*b) for b in batches]
    first, again = features(False), features(True)
    assert all(torch.equal(a, b.detach()) for a, b in zip(first, again))
    model.executor.replay = None  # without the replay the passes differ: the tower does draw random numbers
    assert not torch.equal(features(False)[0], features(False)[0])
    model.executor.replay = Replay(0)

    params = [p for p in model.parameters() if p.requires_grad]
    reference = family.batch_loss(loss_module, torch.cat(features(True)))
    want = torch.autograd.grad(reference, params, allow_unused=True)
    cache = StepLossCache(family, loss_module, A, 1, 0)
    cache.fill(features(False))
    assert torch.allclose(cache.loss, reference.detach())
    model.zero_grad()
    model.executor.replay.start(7)
    for b in batches:
        (cache.surrogate(model(*b)) / A).backward()  # DeepSpeed divides by the accumulation steps
    for p, w in zip(params, want):
        if w is not None:
            torch.testing.assert_close(p.grad, w, rtol=1e-5, atol=1e-6)  # (the blocked loss: another float order)


def test_a_frozen_prefix_runs_once_per_step():
    """Lock-image tuning: the frozen vision tower runs in the forward-only pass only; the training
    pass takes its recorded output (no vision layer is called) and gets the same features and the
    same gradients as running the tower again."""
    cfg = mmpipe.load_config(TINY, TINY_SETS)
    family = build_family(cfg.model)
    vision = [n for n in family.layer_names() if family.layer(n).segment == "vision"]
    model = plain_model(family, forward_only=frozenset(vision)).train()
    for n, p in model.named_parameters():
        p.requires_grad_(not any(n.startswith(v + ".") for v in vision))
    assert frozen_prefix(family.layer_names(), model.forward_only) == vision
    batches, calls = _batches(cfg, 3, 4), []
    for n in vision:
        model.get_submodule(n).register_forward_hook(lambda *a, n=n: calls.append(n))
    model.executor.features = True
    with torch.no_grad():
        plain = [model(*b) for b in batches]
    model.executor.memo = FirstPassMemo(vision)
    model.executor.memo.start(recording=True)
    with torch.no_grad():
        first = [model(*b) for b in batches]
    assert len(calls) == 2 * 3 * len(vision)
    model.executor.memo.start(recording=False)
    live = [model(*b) for b in batches]
    assert len(calls) == 2 * 3 * len(vision)  # not one vision layer ran in the training pass
    assert all(torch.equal(a, b) and torch.equal(a, c.detach()) for a, b, c in zip(plain, first, live))
    params = [p for p in model.parameters() if p.requires_grad]
    with_memo = torch.autograd.grad(family.batch_loss(model.loss, torch.cat(live)), params)
    model.executor.memo = None
    again = torch.autograd.grad(family.batch_loss(model.loss, torch.cat([model(*b) for b in batches])), params)
    for a, b in zip(with_memo, again):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="not recorded"):
        FirstPassMemo(vision).take()


# ---- every layout against one process on one micro-batch of the whole global batch ----------------------
ONE_MICRO_BATCH = ["parallel.pipeline_stages=1", "parallel.micro_batch_size=16"]  # tiny: batch 16


def _steps4(runs, key, nprocs, sets, launcher="deepspeed"):
    return runs.get(key, nprocs, sets, launcher, flags=["--stop-at", "4"])[0]


def _assert_same_training(a: str, b: str, steps: int = 4):
    assert_same_training(a, b, steps)  # (a key projection's bias at atol 1e-5: helpers.NO_GRADIENT)


@pytest.mark.parametrize("key,nprocs,launcher,sets", [
    ("gn_p1x4", 1, "python", ["parallel.pipeline_stages=1"]),
    ("gn_p2", 2, "deepspeed", ["parallel.pipeline_stages=2"]),
    ("gn_p3", 3, "deepspeed", ["parallel.pipeline_stages=3"]),
    # every rank the whole B x B (model.local_loss=false; the other DP layouts here split it into rows)
    ("gn_p2dp2_z1_whole", 4, "deepspeed", ["parallel.pipeline_stages=2", "parallel.zero_stage=1",
                                           "model.local_loss=false"]),
    ("gn_dp2", 2, "deepspeed", ["parallel.pipeline_stages=1", "parallel.micro_batch_size=8"]),  # one pass
])
def test_every_layout_trains_like_one_micro_batch_of_the_global_batch(runs, key, nprocs, launcher, sets):
    one = _steps4(runs, "gn_one", 1, ONE_MICRO_BATCH, "python")
    _assert_same_training(_steps4(runs, key, nprocs, sets, launcher), one)


SIGMOID = ["model.loss=sigmoid", "model.loss_block=5"]  # SigLIP's loss in blocks of 5 of the 16 rows


@pytest.mark.parametrize("key,nprocs,launcher,sets", [
    ("sg_p1x4", 1, "python", ["parallel.pipeline_stages=1"]),
    ("sg_p2", 2, "deepspeed", ["parallel.pipeline_stages=2"]),
    ("sg_p2dp2_z1", 4, "deepspeed", ["parallel.pipeline_stages=2", "parallel.zero_stage=1"]),
    ("sg_p2_frozen_vision", 2, "deepspeed", ["parallel.pipeline_stages=2", "optim.freeze_vision=true"]),
    # four ranks, each its 4 rows of the 16 x 16 in blocks of 3 (one pass: one micro-batch per rank)
    ("sg_dp4_frozen_vision", 4, "deepspeed", ["parallel.pipeline_stages=1", "parallel.micro_batch_size=4",
                                              "optim.freeze_vision=true", "model.loss_block=3"]),
])
def test_the_sigmoid_loss_trains_like_one_micro_batch_of_the_global_batch(runs, key, nprocs, launcher, sets):
    """``model.loss: sigmoid`` on CLIP towers (open_clip's --siglip), computed in blocks: P = 1 with
    accumulation, P = 2, P2 x DP2 and lock-image tuning train as one process on one micro-batch of the
    whole batch (where the loss layer runs the whole 16 x 16 matrix in the graph), temperature and bias
    included. (P = 3 and DP2 with the sigmoid loss: the siglip family's runs, test_parity / test_siglip.)"""
    frozen = ["optim.freeze_vision=true"] if "frozen" in key else []
    one = _steps4(runs, "sg_one" + ("_frozen_vision" if frozen else ""), 1, ONE_MICRO_BATCH + SIGMOID + frozen, "python")
    run = _steps4(runs, key, nprocs, sets + SIGMOID, launcher)
    _assert_same_training(run, one)
    if key == "sg_p2":  # the bias trains (the weights compared above include it)
        from mmpipe.train.checkpoint_weights import load_model_weights
        w = load_model_weights(os.path.join(run, "checkpoints"), "global_step4")
        assert w["loss.logit_bias"].item() != -10.0 and w["loss.logit_scale"].item() != pytest.approx(np.log(10.0))


@pytest.mark.parametrize("name,extra", [  # an evaluation at step 2: the next step's first pass trains again
    ("bert", ["model.text.arch=bert", "model.text.dropout=0", "train.eval_every=2"]),
    ("frozen_vision", ["optim.freeze_vision=true", "train.eval_every=2"]),
])
def test_bert_and_frozen_towers_train_like_one_micro_batch(runs, name, extra):
    one = _steps4(runs, f"gn_one_{name}", 1, ONE_MICRO_BATCH + extra, "python")
    _assert_same_training(_steps4(runs, f"gn_p2_{name}", 2, ["parallel.pipeline_stages=2"] + extra), one)
    if name == "frozen_vision":  # the frozen prefix's record at P = 1 too (4 micro-batches, PlainRunner)
        _assert_same_training(_steps4(runs, "gn_p1x4_frozen_vision", 1, ["parallel.pipeline_stages=1"] + extra,
                                      "python"), one)


def test_dropout_is_drawn_per_sample_in_every_grouping_and_layout(runs):
    """BERT dropout 0.1 (hidden and attention): each sample draws its masks from its own key
    (``sample_rng``), so one micro-batch of 16 trains as four of 4 (other rows, other padding), and DP2 x
    2 micro-batches, at P = 1 and on two stages, as one process over the same 4."""
    extra = ["model.text.arch=bert", "model.text.dropout=0.1"]
    p1 = _steps4(runs, "gn_p1x4_dropout", 1, ["parallel.pipeline_stages=1"] + extra, "python")
    _assert_same_training(_steps4(runs, "gn_one_dropout", 1, ONE_MICRO_BATCH + extra, "python"), p1)
    assert abs(train_losses(p1)[1] - train_losses(_steps4(runs, "gn_p1x4", 1, ["parallel.pipeline_stages=1"],
                                                              "python"))[1]) > 1e-4  # (dropout is on)
    dp2 = _steps4(runs, "gn_dp2x2_dropout", 2, ["parallel.pipeline_stages=1", "parallel.micro_batch_size=4"] + extra)
    _assert_same_training(dp2, p1)
    p2dp2 = _steps4(runs, "gn_p2dp2_dropout", 4, ["parallel.pipeline_stages=2", "parallel.zero_stage=1"] + extra)
    _assert_same_training(p2dp2, p1)
    # four ranks x 2 micro-batches, each rank its 4 rows of the loss in blocks of 3 (model.local_loss)
    dp4 = _steps4(runs, "gn_dp4x2_dropout", 4, ["parallel.pipeline_stages=1", "parallel.micro_batch_size=2",
                                                "model.loss_block=3"] + extra)
    _assert_same_training(dp4, p1)


def test_bf16_data_parallel_own_rows_train_as_the_whole_matrix(runs):
    """bf16 at DP2 x 2 micro-batches: each rank its own rows of the loss (computed in fp32 on the gathered
    features) trains as every rank computing the whole B x B: the first two steps' losses to fp32's precision
    (the same bf16 towers on the same weights), then within bf16's (an fp32 master weight ~1e-7 apart can
    round to the next bf16 value: measured 1.3e-4 at step 4); and within bf16's precision of fp32."""
    sets = ["parallel.pipeline_stages=1", "parallel.micro_batch_size=4", "train.precision=bf16"]
    own = _steps4(runs, "gn_dp2x2_bf16", 2, sets)
    whole = _steps4(runs, "gn_dp2x2_bf16_whole", 2, sets + ["model.local_loss=false"])
    np.testing.assert_allclose(train_losses(own)[:2], train_losses(whole)[:2], rtol=1e-6)
    np.testing.assert_allclose(train_losses(own)[:4], train_losses(whole)[:4], rtol=2e-3)
    assert_same_training(own, whole, 4, loss_rtol=2e-3, rtol=2e-2, atol=2e-3)  # (bf16's rounding of an update)
    fp32 = _steps4(runs, "gn_one", 1, ONE_MICRO_BATCH, "python")
    np.testing.assert_allclose(train_losses(own)[:4], train_losses(fp32)[:4], rtol=2e-2)


def test_micro_batch_negatives_train_differently(runs):
    """The comparison above can fail: with each micro-batch its own negatives the losses differ."""
    one = _steps4(runs, "gn_one", 1, ONE_MICRO_BATCH, "python")
    mb = _steps4(runs, "gn_p2_micro_batch", 2, ["parallel.pipeline_stages=2", "model.negatives=micro_batch"])
    assert not np.allclose(train_losses(mb)[:4], train_losses(one)[:4], rtol=1e-3)
    assert train_losses(mb)[0] < train_losses(one)[0]  # fewer negatives: an easier first loss


# ---- the cost model runs the schedule that runs -------------------------------------------------------
def test_the_simulator_adds_the_forward_only_pass_and_the_gather():
    """Balanced stages: the forward-only pass overlaps the 1F1B fill, so it costs M forwards of a
    stage; the features' gather on the last stage comes on top."""
    from mmpipe.planning.simulate import simulate
    for P, M in ((2, 4), (3, 8)):
        F, B, comm = [1.0] * P, [2.0] * P, [0.0] * (P - 1)
        plain = simulate(F, B, M, comm, order=ONE).step_time
        assert plain == (M + P - 1) * 3.0
        assert simulate(F, B, M, comm, step_loss=True, order=ONE).step_time == plain + M * 1.0
        assert simulate(F, B, M, comm, step_loss=True, gather=0.5, order=ONE).step_time == plain + M * 1.0 + 0.5


def test_a_frozen_prefix_is_costed_once():
    """The training pass takes a frozen prefix's output from the forward-only pass: stage 0's forward
    in the training pass is its unfrozen layers only; the first pass runs them all. A first stage that
    is all frozen prefix (lock-image tuning at P = 2) then adds about M forwards of the last stage."""
    from test_layout import NAMES, _layer, _prof

    from mmpipe.planning.place import predict, stage_times
    from mmpipe.planning.simulate import simulate
    layers = [_layer(n, 2.0, 4.0, 1000) for n in NAMES]
    prof = {**_prof(layers), "step_loss": {"features_bytes": 4000, "frozen_prefix": 1}}
    t = stage_times(prof, [0, 2, 4])
    assert t["F1"] == [4e-3, 4e-3] and t["F"] == [2e-3, 4e-3]
    assert "F1" not in stage_times(_prof(layers), [0, 2, 4])
    full = predict({**prof, "step_loss": {"features_bytes": 4000, "frozen_prefix": 0}}, [0, 2, 4], 4, ONE).step_time
    assert predict(prof, [0, 2, 4], 4, ONE).step_time < full
    F, B, M = [1.0, 1.0], [0.0, 2.0], 4
    plain = simulate(F, B, M, [0.0], order=ONE).step_time
    reused = simulate([0.0, 1.0], B, M, [0.0], step_loss=True, first_pass=F, order=ONE).step_time
    # the last stage's M forwards of the first pass on top; the training pass has no fill left
    # (stage 0 hands its recorded outputs on at once), the first pass has the one fill
    assert reused == plain + M * 1.0


def test_one_micro_batch_per_rank_costs_no_extra_forward():
    """Data parallel with the per-rank batch in one micro-batch runs one pass (PlainRunner): the
    layout model adds the features' all-gather only."""
    from test_layout import NAMES, SEGS, _layer, _prof

    from mmpipe.planning.collectives import CommModel
    from mmpipe.planning.layouts import predict_layouts
    layers = [_layer(n, 2.0, 4.0, 1000, out=4000) for n in NAMES]
    comm = CommModel(ops={"allreduce": {2: (1e-3, 2e-9)}, "allgather": {2: (5e-4, 1e-9)},
                          "reduce_scatter": {2: (5e-4, 1e-9)}})
    kw = dict(world=2, batch_size=16, micro_batch_size=8, precision="fp32", names=NAMES, segments=SEGS,
              fetch_units=10, zero_stages=(0,))
    plain = {r.name: r for r in predict_layouts(_prof(layers), comm, **kw)}["DP2 ZeRO-0"]
    step = {r.name: r for r in predict_layouts({**_prof(layers), "step_loss": {"features_bytes": 4000}}, comm,
                                               **kw)}["DP2 ZeRO-0"]
    assert step.micro_batches == 1
    assert step.step_time == pytest.approx(plain.step_time + 5e-4 + 1e-9 * 4000, rel=1e-9)


def test_layout_predictions_cost_the_extra_forward_and_the_all_gather():
    from test_layout import NAMES, SEGS, _layer, _prof

    from mmpipe.planning.collectives import CommModel
    from mmpipe.planning.layouts import predict_layouts
    layers = [_layer(n, 2.0, 4.0, 1000, out=4000) for n in NAMES]
    comm = CommModel(ops={"allreduce": {2: (1e-3, 2e-9)}, "allgather": {2: (5e-4, 1e-9)},
                          "reduce_scatter": {2: (5e-4, 1e-9)}})
    kw = dict(world=2, batch_size=16, micro_batch_size=4, precision="fp32", names=NAMES, segments=SEGS,
              fetch_units=10, zero_stages=(0,))
    plain = {r.name: r for r in predict_layouts(_prof(layers), comm, **kw)}
    step = {r.name: r for r in predict_layouts({**_prof(layers), "step_loss": {"features_bytes": 4000}}, comm, **kw)}
    M = 16 // (4 * 2)
    extra = M * 4 * 2.0 / 1e3 + 5e-4 + 1e-9 * M * 4000  # a forward of every layer per micro-batch; the gather
    assert step["DP2 ZeRO-0"].step_time == pytest.approx(plain["DP2 ZeRO-0"].step_time + extra, rel=1e-9)
    pp = [n for n in plain if n.startswith("PP2")]
    assert pp and all(step[n].step_time > plain[n].step_time for n in pp)


def test_layout_predictions_price_each_ranks_share_of_the_loss():
    """The loss over the step costs its profiled seconds per pair times the pairs a rank computes: its own
    B / D rows x B with ``model.local_loss`` (the step at DP2 falls by half the whole matrix's time), all
    B x B without; ``mmpipe plan --world``'s line on the chosen layout says the share."""
    from test_layout import NAMES, SEGS, _layer, _prof

    from mmpipe.planning.collectives import CommModel
    from mmpipe.planning.layouts import loss_seconds, predict_layouts, step_loss_summary
    layers = [_layer(n, 2.0, 4.0, 1000, out=4000) for n in NAMES]
    comm = CommModel(ops={"allreduce": {2: (1e-3, 2e-9)}, "allgather": {2: (5e-4, 1e-9)},
                          "reduce_scatter": {2: (5e-4, 1e-9)}})
    kw = dict(world=2, batch_size=16, micro_batch_size=4, precision="fp32", names=NAMES, segments=SEGS,
              fetch_units=10, zero_stages=(0,))
    sl = {"features_bytes": 4000, "pair_s": 1e-4, "rows": 4, "pair_bytes": 20, "block_rows": 1024,
          "block_pair_bytes": 24}
    whole = {r.name: r for r in predict_layouts({**_prof(layers), "step_loss": {**sl, "local": False}}, comm, **kw)}
    own = {r.name: r for r in predict_layouts({**_prof(layers), "step_loss": {**sl, "local": True}}, comm, **kw)}
    assert loss_seconds({**sl, "local": True}, 16, 2, 2) == pytest.approx(1e-4 * 8 * 16)
    assert loss_seconds({**sl, "local": False}, 16, 2, 2) == pytest.approx(1e-4 * 16 * 16)
    assert loss_seconds({**sl, "local": True}, 16, 1, 1) == 0.0  # one micro-batch on one rank: in the graph
    for name in whole:
        if whole[name].fits and whole[name].data_parallel == 2:
            assert whole[name].step_time - own[name].step_time == pytest.approx(1e-4 * 8 * 16, rel=1e-6), name
    line = step_loss_summary({**_prof(layers), "step_loss": {**sl, "local": True}}, 16, own["DP2 ZeRO-0"])
    assert "its own 8 of 16 rows" in line and "8 x 16 pairs" in line
    line = step_loss_summary({**_prof(layers), "step_loss": {**sl, "local": False}}, 16, whole["DP2 ZeRO-0"])
    assert "16 x 16 pairs" in line and "model.local_loss=false" in line
