"""``parallel.activation_checkpointing: all``: every trained layer keeps only its input and recomputes
its forward in backward. Exact: the same loss and gradients bit for bit, dropout included (the
recompute restores the random-number state); fewer bytes saved for backward; forward-only frozen
layers are never recomputed; the pipeline trains exactly as without it."""
from __future__ import annotations


import pytest
import torch
from helpers import TINY, TINY_VLM, assert_same_training

import mmpipe
from mmpipe.config.resolve import build_family
from mmpipe.parallel.layers import PipeLayer, run_sequential, set_activation_checkpointing
from mmpipe.parallel.plain import plain_model

CLIP_BERT = ["model.text.arch=bert", "model.text.vocab_size=300", "model.text.max_position_embeddings=16"]


def _family(config, sets):
    cfg = mmpipe.load_config(config, sets)
    return build_family(cfg.model, 0), cfg


def _fields(family, cfg):
    batch = family.example_batch(4, cfg.data.max_length, "cpu")
    return [batch[k] for k in family.inputs + family.labels]


def _saved_bytes(fn) -> int:
    """Bytes autograd saves for backward while ``fn`` runs its forward."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total, out


def _loss_and_grads(model, fields, seed=0):
    torch.manual_seed(seed)
    saved, out = _saved_bytes(lambda: model(*fields))
    loss = out if out.dim() == 0 else out.float().pow(2).mean()
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    return loss.detach(), grads, saved


@pytest.mark.parametrize("config,sets", [(TINY, CLIP_BERT), (TINY_VLM, ["model.llm.vocab_size=200", "model.image_token_id=199"])], ids=["clip_bert_dropout", "vlm"])
def test_plain_model_recomputes_exactly_and_saves_less(config, sets):
    family, cfg = _family(config, sets)
    model = plain_model(family).train()
    fields = _fields(family, cfg)
    loss, grads, saved = _loss_and_grads(model, fields)
    assert set_activation_checkpointing(model) == len(family.layer_names())
    loss_c, grads_c, saved_c = _loss_and_grads(model, fields)
    assert torch.equal(loss, loss_c)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_c))
    assert saved_c < 0.5 * saved, (saved_c, saved)
    if config == TINY:  # dropout is live: another seed gives another loss, so the equality above means something
        assert not torch.equal(_loss_and_grads(model, fields, seed=1)[0], loss_c)


def test_pipeline_layers_recompute_exactly_and_skip_forward_only_ones():
    family, cfg = _family(TINY, CLIP_BERT)
    names = family.layer_names()
    vision = [n for n in names if family.layer(n).segment == "vision"][:-1]  # frozen: forward-only
    layers = torch.nn.ModuleList(PipeLayer(family, n, forward_only=n in vision) for n in names).train()
    for n, p in layers.named_parameters():
        p.requires_grad_(not layers[int(n.split(".")[0])].forward_only)
    fields = tuple(_fields(family, cfg))
    params = [p for p in layers.parameters() if p.requires_grad]

    def run():
        torch.manual_seed(0)
        saved, loss = _saved_bytes(lambda: run_sequential(layers, fields))
        return loss.detach(), torch.autograd.grad(loss, params), saved
    loss, grads, saved = run()
    assert set_activation_checkpointing(layers) == len(names) - len(vision)
    recomputed = []
    for la in layers:
        if la.forward_only:
            la.part.register_forward_hook(lambda *a, n=la.name: recomputed.append(n))
    loss_c, grads_c, saved_c = run()
    assert torch.equal(loss, loss_c) and all(torch.equal(a, b) for a, b in zip(grads, grads_c))
    assert saved_c < saved
    assert len(recomputed) == len(vision)  # each frozen layer ran once: forward-only layers are never recomputed


def test_the_choice_is_checked():
    from mmpipe.errors import ConfigError
    with pytest.raises(ConfigError, match="parallel.activation_checkpointing='some' is not one of none, all"):
        mmpipe.load_config(TINY, ["parallel.activation_checkpointing=some"])


# ---- pipelines train exactly as without it ----------------------------------------------------------------
def _same_run(a: str, b: str, steps: int = 4):
    assert_same_training(a, b, steps, loss_rtol=1e-6, rtol=1e-6, atol=1e-7)


def test_a_pipeline_with_dropout_trains_exactly_as_without_it(runs):
    """CLIP with a BERT tower at its default dropout (0.1), P = 2, global negatives (the feature
    cache's two passes and the recompute all replay the same random numbers)."""
    sets = ["parallel.pipeline_stages=2", "model.text.arch=bert"]
    flags = ["--stop-at", "4"]
    plain = runs.get("ac_off_bert_p2", 2, sets, flags=flags)[0]
    ckpt = runs.get("ac_all_bert_p2", 2, sets + ["parallel.activation_checkpointing=all"], flags=flags)[0]
    _same_run(ckpt, plain)


def test_a_pipeline_times_data_parallel_trains_exactly_as_without_it(runs):
    """P = 2 x DP = 2 (CLIP, global negatives): the data-parallel all-reduce of recomputed gradients."""
    flags = ["--stop-at", "4"]
    plain = runs.get("p2dp2", 4, ["parallel.pipeline_stages=2"], flags=flags)[0]  # test_parity's P2 x DP2 run
    ckpt = runs.get("ac_all_p2dp2", 4, ["parallel.pipeline_stages=2", "parallel.activation_checkpointing=all"],
                    flags=flags)[0]
    _same_run(ckpt, plain)


def test_a_vlm_pipeline_trains_exactly_as_without_it(family_runs_of):
    runs = family_runs_of("vlm")
    flags = ["--stop-at", "4"]
    plain = runs.get("p3", 3, ["parallel.pipeline_stages=3"], flags=flags)[0]  # test_parity's P = 3 run
    ckpt = runs.get("ac_all_p3", 3, ["parallel.pipeline_stages=3", "parallel.activation_checkpointing=all"],
                    flags=flags)[0]
    _same_run(ckpt, plain)


def test_the_cost_model_adds_the_recomputed_forward():
    """A checkpointed layer's backward runs its forward again; a forward-only layer's does not."""
    from test_layout import NAMES, _layer, _prof

    from mmpipe.planning.place import stage_times
    layers = [_layer(n, 2.0, 4.0, 1000) for n in NAMES]
    prof = {**_prof(layers), "key": {"threads": 1, "forward_only": [NAMES[0]]}}
    assert stage_times(prof, [0, 2, 4])["B"] == [8e-3, 8e-3]
    assert stage_times({**prof, "checkpointing": True}, [0, 2, 4])["B"] == [10e-3, 12e-3]
