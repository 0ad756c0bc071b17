"""``parallel.schedule: zb_h1``: the backward split into the input gradient (B) and the linear layers' weight gradients
(W, ``parallel.zero_bubble``) trains as 1F1B does - the same losses and weights - on DeepSpeed's engine: CLIP with both
towers trained (a step loss) at P = 2 with 8 micro-batches a step, a VLM with a trained vision tower at P = 3 under
LoRA and activation checkpointing, P2 x DP2, bf16; each stage's trace shows its weight gradients run apart. In
process: the split gives the weight gradients a backward gives, bit for bit, with the parameters' hooks firing once;
a first layer whose base is frozen (LoRA) still gets its adapters' gradients."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from helpers import TINY, TINY_VLM, Runs, assert_same_training, train_losses
from torch import nn

from mmpipe.parallel.zero_bubble import SplitLinear, WeightGradStore, install


def _split_run(model, xs, gs, ckpt=None, order=None):
    """Forward and B per micro-batch, then the W's in ``order``: the inputs' gradients."""
    from torch.utils.checkpoint import checkpoint
    store = WeightGradStore()
    install(model, store)
    out = []
    with store.step():
        for m, (x, g) in enumerate(zip(xs, gs)):
            x = x.clone().requires_grad_()
            y = model(x) if ckpt is None else checkpoint(model, x, use_reentrant=ckpt)
            with store.backward_input(m):
                y.backward(g)
            out.append(x.grad)
        assert all(p.grad is None for n, p in model.named_parameters() if n.endswith("0.weight"))  # deferred
        for m in order or range(len(xs)):
            store.weight_gradients(m)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ckpt", [None, False, True])
def test_the_split_backward_gives_the_backwards_gradients_and_fires_each_hook_once(dtype, ckpt):
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 16, bias=False), nn.LayerNorm(16)).to(dtype)
    split = copy.deepcopy(ref)
    fired = {n: 0 for n, _ in split.named_parameters()}
    for n, p in split.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: fired.__setitem__(n, fired[n] + 1))
    xs = [torch.randn(3, 5, 16, dtype=dtype) for _ in range(3)]
    gs = [torch.randn(3, 5, 16, dtype=dtype) for _ in range(3)]
    want = []
    for x, g in zip(xs, gs):
        x = x.clone().requires_grad_()
        (ref(x) if ckpt is None else checkpoint(ref, x, use_reentrant=ckpt)).backward(g)
        want.append(x.grad)
    got = _split_run(split, xs, gs, ckpt)  # (W in micro-batch order, as zb_h1 runs them: the same sums)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), split.parameters()))
    assert set(fired.values()) == {3}  # once per micro-batch, in B or in W: no hook fires for a deferred weight in B
    assert sum(isinstance(m, SplitLinear) for m in split.modules()) == 2


def test_lora_on_a_frozen_first_layer_gets_its_adapters_gradients_and_a_missing_w_is_an_error():
    from peft import LoraConfig, get_peft_model

    def build():
        torch.manual_seed(0)
        m = get_peft_model(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)),
                           LoraConfig(r=2, lora_alpha=4, target_modules=["0", "2"], lora_dropout=0.0))
        for n, p in m.named_parameters():
            if "lora_B" in n:
                nn.init.normal_(p)
        return m
    xs, gs = [torch.randn(2, 8) for _ in range(2)], [torch.randn(2, 8) for _ in range(2)]
    ref, split = build(), build()
    for x, g in zip(xs, gs):
        ref(x).backward(g)
    store = WeightGradStore()
    assert install(split, store) == 4  # lora_A and lora_B of both layers (the frozen bases keep nn.Linear)
    with store.step():
        for m, (x, g) in enumerate(zip(xs, gs)):  # the input needs no gradient: only the adapters do
            with store.backward_input(m):
                split(x).backward(g)
        for m in range(2):
            store.weight_gradients(m)
    trained = [(a, b) for (n, a), (_, b) in zip(ref.named_parameters(), split.named_parameters()) if a.requires_grad]
    assert len(trained) == 4 and all(torch.equal(a.grad, b.grad) for a, b in trained)
    with pytest.raises(RuntimeError, match=r"weight gradients of micro-batches \[0\] never computed"):
        with store.step():
            with store.backward_input(0):
                split(xs[0]).backward(gs[0])


# ---- runs: zb_h1 against 1f1b ------------------------------------------------------------------------------
STEPS = ["--stop-at", "4"]


@pytest.fixture(scope="module")
def clip_runs(tmp_path_factory, tiny_data):
    return Runs(tmp_path_factory.mktemp("zb_clip"), tiny_data, TINY)


@pytest.fixture(scope="module")
def vlm_runs(tmp_path_factory, tiny_chat_data):
    return Runs(tmp_path_factory.mktemp("zb_vlm"), tiny_chat_data, TINY_VLM)


def _pair(runs, key, n, sets):
    """The same run under 1f1b and zb_h1 (the latter traced at its last step)."""
    ref, _ = runs.get(f"{key}_1f1b", n, sets + ["parallel.schedule=1f1b"], flags=STEPS)
    zb, _ = runs.get(f"{key}_zb", n, sets + ["parallel.schedule=zb_h1", "log.trace=[4,4]"], flags=STEPS)
    with open(os.path.join(zb, "plan.json")) as fh:
        assert json.load(fh)["schedule"] == "zb_h1"
    return ref, zb


def _weight_passes(run: str, stages: int) -> None:
    """Each stage after the first ran its weight gradients as their own instruction, one per micro-batch, and no
    fused backward; the first (which sends no input gradient) its fused backward."""
    with open(os.path.join(run, "trace.json")) as fh:
        events = [e for e in json.load(fh)["traceEvents"] if e["ph"] == "X"]
    for s in range(stages):
        names = [e["name"] for e in events if e["pid"] == s]
        if s == 0:
            assert "BackwardPass" in names and "BackwardWeightPass" not in names
            continue
        assert names.count("BackwardWeightPass") == names.count("BackwardInputPass") > 0, (s, set(names))
        assert "BackwardPass" not in names


def test_clip_with_both_towers_trained_at_p2_with_8_micro_batches(clip_runs):
    """A step loss (global negatives): its features pass, then zb_h1's order, 8 micro-batches of 4."""
    sets = ["parallel.pipeline_stages=2", "parallel.profile=false", "train.batch_size=32"]
    ref, zb = _pair(clip_runs, "p2_m8", 2, sets)
    assert_same_training(zb, ref, steps=4, loss_rtol=1e-6, rtol=1e-5)
    _weight_passes(zb, 2)


def test_vlm_with_a_trained_vision_tower_at_p3_lora_and_checkpointing(vlm_runs):
    sets = ["parallel.pipeline_stages=3", "parallel.profile=false", "optim.train_type=lora", "optim.freeze_vit=false",
            "optim.freeze_aligner=false", "parallel.activation_checkpointing=all", "optim.lora_dropout=0.1"]
    ref, zb = _pair(vlm_runs, "p3_lora_ckpt", 3, sets)
    assert_same_training(zb, ref, steps=4, loss_rtol=1e-6, rtol=1e-5)
    _weight_passes(zb, 3)


def test_vlm_at_p2_times_dp2(vlm_runs):
    ref, zb = _pair(vlm_runs, "p2dp2", 4, ["parallel.pipeline_stages=2", "parallel.profile=false"])
    assert_same_training(zb, ref, steps=4, loss_rtol=1e-6, rtol=1e-5)


def test_vlm_in_bf16_at_p2(vlm_runs):
    """bf16 (DeepSpeed's BF16_Optimizer: its fp32 gradient buffers take what W adds) within bf16's rounding."""
    ref, zb = _pair(vlm_runs, "bf16", 2, ["parallel.pipeline_stages=2", "parallel.profile=false",
                                          "train.precision=bf16"])
    a, b = train_losses(zb), train_losses(ref)
    assert len(a) == 4 and a == pytest.approx(b, rel=2e-3)
    assert_same_training(zb, ref, steps=4, loss_rtol=2e-3, rtol=2e-2, atol=4e-3)
