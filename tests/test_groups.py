"""Per-branch parameter groups: grouped clipping against a plain PyTorch reference, limits,
freezing. Multi-process runs are shared through the session ``runs`` fixture."""
from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from mmpipe.data.pixels import SquarePixels
import torch
from helpers import TINY, train_losses

import mmpipe
from mmpipe.config.groups import (
    assign_groups,
    forward_only_parts,
    param_groups,
    resolve_groups,
)
from mmpipe.config.schema import load_config
from mmpipe.errors import ConfigError
from mmpipe.families.clip import ClipFamily
from mmpipe.train.checkpoint_weights import load_model_weights
from mmpipe.train.clipping import clip_coef
from mmpipe.train.metrics import read_metrics
from mmpipe.parallel.plain import plain_model

GROUP_SETS = ["optim.schedule=constant", "optim.groups.vision.max_grad_norm=0.5", "optim.groups.vision.lr=5e-4",
              "optim.groups.text.max_grad_norm=0.3", "optim.groups.text.lr=2e-3",
              "optim.groups.projector.weight_decay=0.05", "optim.groups.logit_scale.lr=1e-3"]
LIMITS = {"vision": 0.5, "text": 0.3, "projector": None, "logit_scale": None}
LRS = {"vision": 5e-4, "text": 2e-3, "projector": 1e-3, "logit_scale": 1e-3}
WDS = {"vision": 0.1, "text": 0.1, "projector": 0.05, "logit_scale": 0.1}
BRANCH_OF = {"vision": "vision.", "projector": ("visual_projection.", "text_projection."), "text": "text.",
             "logit_scale": "loss.logit_scale"}


class GroupCase:
    """A family's grouped-clipping case: --set lines, the limits/lr/decay they state, the group
    membership stated by name prefix (independently of mmpipe's regexes), the reference's model
    settings, and a stage split through which a clipped group spans both stages."""

    def __init__(self, sets, limits, lrs, wds, prefixes, model_sets, split, moved):
        self.sets, self.limits, self.lrs, self.wds = sets, limits, lrs, wds
        self.prefixes, self.model_sets, self.split, self.moved = prefixes, model_sets, split, moved

    def group_of(self, name):
        for g, prefix in self.prefixes.items():
            if name.startswith(prefix):
                return g
        raise KeyError(name)


GROUP_CASES = {
    "clip": GroupCase(GROUP_SETS, LIMITS, LRS, WDS, BRANCH_OF,
                      lambda tok, eos: [f"model.text.vocab_size={tok}", f"model.text.eos_token_id={eos}",
                                        "model.text.max_position_embeddings=16"],
                      2, "vision.blocks.0.mlp.fc1.weight"),
    # toy: the text group (text tower + head) spans both stages of the split
    "toy": GroupCase(["optim.schedule=constant", "optim.groups.image.max_grad_norm=0.001", "optim.groups.image.lr=5e-3",
                      "optim.groups.text.max_grad_norm=0.002", "optim.groups.text.lr=2e-2",
                      "optim.groups.text.weight_decay=0.05"],
                     {"image": 0.001, "text": 0.002}, {"image": 5e-3, "text": 2e-2}, {"image": 0.1, "text": 0.05},
                     {"image": "image.", "text": ("text.", "head.")}, lambda tok, eos: [f"model.vocab_size={tok}"],
                     2, "image.tower.proj.weight"),
}


# ---- fast unit tests -------------------------------------------------------------------------------
def test_default_groups_and_shortcuts():
    groups = resolve_groups(load_config(None, ["optim.freeze_vision=true", "optim.groups.text.lr=1e-5"]).optim, ClipFamily)
    by = {g.name: g for g in groups}
    assert list(by) == ["vision", "projector", "text", "logit_scale"]
    assert by["vision"].frozen and not by["text"].frozen and by["text"].lr == 1e-5 and by["projector"].lr == 5e-4


def test_every_parameter_in_exactly_one_group():
    groups = resolve_groups(load_config(None, ["optim.groups.extra.patterns=[blocks]"]).optim, ClipFamily)
    with pytest.raises(ConfigError, match="'vision.blocks.0.w' matches both 'vision' and 'extra'"):
        assign_groups(["vision.blocks.0.w"], groups)
    with pytest.raises(ConfigError, match="parameter 'adapter.w' matches no group"):
        assign_groups(["adapter.w"], resolve_groups(load_config(None).optim, ClipFamily))


def test_clip_coef_matches_torch():
    for norm_limit in [(3.0, 1.0), (0.5, 1.0), (2.0, float("inf"))]:
        g = torch.full((4,), norm_limit[0] / 2)
        p = torch.nn.Parameter(torch.zeros(4))
        p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_([p], norm_limit[1])
        c = clip_coef(float(g.norm()), norm_limit[1])
        torch.testing.assert_close(p.grad, g * c)


def _tiny_model_cfg(*sets):
    return load_config(TINY, ["model.text.vocab_size=50", "model.text.eos_token_id=3",
                              "model.text.max_position_embeddings=16", *sets])


def test_frozen_branch_runs_forward_only_and_gets_no_optimizer_state():
    from mmpipe.config.groups import apply_freeze
    from mmpipe.config.resolve import build_family
    cfg = _tiny_model_cfg("optim.freeze_vision=true")
    groups = resolve_groups(cfg.optim, ClipFamily)
    family = build_family(cfg.model, 0)
    part_params = {p: list(v) for p, v in family.meta_params().items()}
    fo = forward_only_parts(part_params, family.upstream(), groups)
    assert fo == {"vision.embed", "vision.blocks.0", "vision.blocks.1", "vision.head"}
    model = mmpipe.build_model(cfg)
    model.executor.forward_only = frozenset(fo)
    apply_freeze(model.named_parameters(), groups)
    tg = param_groups(model.named_parameters(), groups)
    assert {g["name"] for g in tg} == {"projector", "text", "logit_scale"}
    g = torch.Generator().manual_seed(0)
    pix = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8, generator=g)
    ids = torch.randint(4, 50, (4, 16), generator=g)
    ids[:, 7] = 3
    model(pix, ids, torch.ones(4, 16, dtype=torch.int64)).backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n.startswith("vision."))
    assert model.visual_projection.weight.grad is not None and model.text.embed.embeddings.token_embedding.weight.grad is not None
    # freezing the text tower keeps text_projection and the loss trainable (they follow it)
    fo_text = forward_only_parts(part_params, family.upstream(),
                                 resolve_groups(_tiny_model_cfg("optim.freeze_text=true").optim, ClipFamily))
    assert "text.blocks.1" in fo_text and "text_projection" not in fo_text and "loss" not in fo_text


# ---- reference test: plain PyTorch loop vs mmpipe in three layouts, for every family ----------------------
def reference_run(tiny_data, tokenizer_dir, steps=3, family="clip", config=TINY):
    """Per-group clip_grad_norm_ then AdamW with per-group lr/decay, single process, plain PyTorch,
    on the family's plain model and its own collate."""
    from mmpipe.data.loader import ImageTextDataset
    from mmpipe.data.manifest import read_manifest
    from mmpipe.data.tokenizer import eos_id, load_tokenizer
    case = GROUP_CASES[family]
    tok = load_tokenizer(tokenizer_dir)
    cfg = load_config(config, case.model_sets(len(tok), eos_id(tok)))
    model = mmpipe.build_model(cfg)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    # the decay rule, stated by module type: the weights of Linear and Conv2d layers decay (the ViT's
    # patch_embedding is a Conv2d); embedding tables, norms, biases and logit_scale do not
    decayed = {id(m.weight) for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}
    buckets = {}
    for n, p in model.named_parameters():
        buckets.setdefault((case.group_of(n), id(p) in decayed), []).append(p)
    opt = torch.optim.AdamW([{"params": ps, "lr": case.lrs[g], "weight_decay": case.wds[g] if decay else 0.0}
                             for (g, decay), ps in buckets.items()], lr=1e-3, betas=(0.9, 0.98), eps=1e-6)
    samples = read_manifest(tiny_data["train"])
    fam = model.family
    ds, collate = ImageTextDataset(samples, SquarePixels(32)), fam.collate(tok, cfg.data)
    # the data order, stated from the documented contract: a permutation seeded by seed * 100003 +
    # epoch, cut into micro-batches of 4; global step k takes micro-batches 4k .. 4k+3
    perm = torch.randperm(len(samples), generator=torch.Generator().manual_seed(0)).tolist()
    micro = [perm[i:i + 4] for i in range(0, len(perm) - 3, 4)]
    norms = []
    for step in range(steps):
        # a loss over the whole step (CLIP's global negatives): one forward of the global batch;
        # else the mean of the micro-batch losses
        batches = ([sum(micro[4 * step:4 * step + 4], [])] if fam.step_loss else micro[4 * step:4 * step + 4])
        for mb in batches:
            b = collate([ds[i] for i in mb])
            (model(*(b[f] for f in fam.inputs + fam.labels)) / len(batches)).backward()
        step_norms = {}
        for g in case.limits:
            params = [p for (gg, _), ps in buckets.items() if gg == g for p in ps]
            step_norms[g] = float(torch.nn.utils.clip_grad_norm_(params, case.limits[g] or float("inf")))
        norms.append(step_norms)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.state_dict(), norms, init


LAYOUTS = {
    "g_p1": (1, "python", ["parallel.pipeline_stages=1"]),
    # + the plan file: a stage boundary inside a clipped group, with data parallelism and ZeRO-1 on top
    "g_p2dp2_z1": (4, "deepspeed", ["parallel.pipeline_stages=2", "parallel.zero_stage=1"]),
    "g_p2_bf16": (2, "deepspeed", ["parallel.pipeline_stages=2", "train.precision=bf16"]),
}


def _split_plan(tmp_path_factory, family, runs):
    """Stage boundary inside a clipped group (CLIP: inside the image tower)."""
    from mmpipe.config.resolve import build_family
    case = GROUP_CASES[family]
    cfg = load_config(runs.config, case.model_sets(50, 3))
    names = build_family(cfg.model, 0).layer_names()
    p = tmp_path_factory.mktemp(f"plan_{family}") / "plan.json"
    p.write_text(json.dumps({"stages": [names[:case.split], names[case.split:]]}))
    return str(p)


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory, runs):
    return _split_plan(tmp_path_factory, "clip", runs)


def _group_run(runs, key, plan_file, family="clip"):
    nprocs, launcher, sets = LAYOUTS[key]
    sets = sets + GROUP_CASES[family].sets + ([f"parallel.plan={plan_file}"] if key != "g_p1" else [])
    return runs.get(key, nprocs, sets, launcher, flags=["--stop-at", "3"])[0]


_REFERENCES: dict = {}


def _reference_of(family, family_runs_of, tiny_data, tmp_path_factory):
    """(runs, plan file, (reference state dict, per-step group norms, initial state dict)) per family."""
    if family not in _REFERENCES:
        runs = family_runs_of(family)
        plan = _split_plan(tmp_path_factory, family, runs)
        out = _group_run(runs, "g_p1", plan, family)
        _REFERENCES[family] = (runs, plan, reference_run(tiny_data, os.path.join(out, "tokenizer"), family=family,
                                                         config=runs.config))
    return _REFERENCES[family]


@pytest.fixture
def reference(family_runs_of, tiny_data, tmp_path_factory):
    return _reference_of("clip", family_runs_of, tiny_data, tmp_path_factory)[2]


@pytest.mark.parametrize("key", ["g_p1", "g_p2dp2_z1"])
def test_grouped_clipping_matches_plain_pytorch(family, family_runs_of, tiny_data, tmp_path_factory, key):
    runs, plan_file, (ref_sd, ref_norms, init) = _reference_of(family, family_runs_of, tiny_data, tmp_path_factory)
    case = GROUP_CASES[family]
    clipped = [g for g, lim in case.limits.items() if lim is not None]
    # the test is meaningful: clipping is active for at least two groups at every step
    assert len(clipped) >= 2 and all(all(n[g] > case.limits[g] for g in clipped) for n in ref_norms)
    out = _group_run(runs, key, plan_file, family)
    if key != "g_p1":  # a clipped group spans both stages: its norm is reduced across them (and the replicas)
        with open(os.path.join(out, "plan.json")) as fh:
            stages = json.load(fh)["stages"]
        spanning = {case.group_of(n + ".") for n in stages[0] if n != "loss"} & \
                   {case.group_of(n + ".") for n in stages[1] if n != "loss"}
        assert spanning & set(clipped), stages
    recs = read_metrics(os.path.join(out, "metrics.jsonl"))
    for rec, ref in zip(recs, ref_norms):
        for g in case.limits:
            assert rec[f"grad_norm.{g}"] == pytest.approx(ref[g], rel=1e-4), (g, rec["step"])
            expect = 1.0 if case.limits[g] is None else min(1.0, case.limits[g] / (ref[g] + 1e-6))
            assert rec[f"clip_coef.{g}"] == pytest.approx(expect, rel=1e-4)
    sd = load_model_weights(os.path.join(out, "checkpoints"), "global_step3")
    assert sd.keys() == ref_sd.keys()
    for k in ref_sd:
        torch.testing.assert_close(sd[k].float(), ref_sd[k], rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")
    assert not torch.equal(ref_sd[case.moved], init[case.moved])


def test_grouped_clipping_bf16_within_bf16_tolerance(runs, plan_file, reference):
    ref_sd, ref_norms, init = reference
    out = _group_run(runs, "g_p2_bf16", plan_file)
    rec = read_metrics(os.path.join(out, "metrics.jsonl"))[0]
    for g in LIMITS:  # first-step group norms: same weights, bf16 arithmetic
        assert rec[f"grad_norm.{g}"] == pytest.approx(ref_norms[0][g], rel=3e-2)
    sd = load_model_weights(os.path.join(out, "checkpoints"), "global_step3")
    ds_, ds_ref = [], []
    for k in ref_sd:  # the updates point the same way as in fp32 ...
        d_ref = (ref_sd[k] - init[k]).flatten()
        d = (sd[k].float() - init[k].to(torch.bfloat16).float()).flatten()
        # ... where bf16 can represent them: the saved module weights are bf16, so an update smaller
        # than the weight's bf16 spacing (|w| * 2^-7, e.g. LayerNorm gains at 1.0) does not show
        visible = d_ref.abs() > init[k].flatten().abs() * 2 ** -7 * 2
        ds_.append(d[visible])
        ds_ref.append(d_ref[visible])
    d, d_ref = torch.cat(ds_), torch.cat(ds_ref)
    assert d.numel() > 10_000
    # Adam moves every weight by ~lr: elements whose gradient is ~0 (e.g. key biases) move by sign
    # noise in both runs, so compare the whole update vector, not tensor by tensor
    assert float(torch.nn.functional.cosine_similarity(d, d_ref, dim=0)) > 0.9
    assert float((d - d_ref).norm() / d_ref.norm()) < 0.5


# ---- limits: inf = off; one group's limit moves only that group --------------------------------------------
def _p1(runs, key, *sets, stop=1):
    return runs.get(key, 1, ["parallel.pipeline_stages=1", *sets], "python", flags=["--stop-at", str(stop)])[0]


def test_inf_limit_equals_no_clipping(runs):
    a = load_model_weights(os.path.join(_p1(runs, "lim_none", stop=3), "checkpoints"), "global_step3")
    b = load_model_weights(os.path.join(_p1(runs, "lim_inf", *[f"optim.groups.{g}.max_grad_norm=inf" for g in LIMITS],
                                            stop=3), "checkpoints"), "global_step3")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_one_group_limit_changes_only_that_group(runs):
    a = load_model_weights(os.path.join(_p1(runs, "lim_v05", "optim.groups.vision.max_grad_norm=0.5"), "checkpoints"),
                           "global_step1")
    b = load_model_weights(os.path.join(_p1(runs, "lim_v001", "optim.groups.vision.max_grad_norm=0.01"), "checkpoints"),
                           "global_step1")
    changed = {k for k in a if not torch.equal(a[k], b[k])}
    assert changed and all(k.startswith("vision.") for k in changed)


# ---- frozen vision tower (and projector: stage 0 is then all frozen) ---------------------------------------
def test_frozen_vision_tower_bit_identical_and_no_optimizer_state(runs, tiny_data):
    from mmpipe.data.tokenizer import eos_id, load_tokenizer
    out = runs.get("frozen", 2, ["parallel.pipeline_stages=2", "optim.freeze_vision=true", "optim.freeze_projector=true"],
                   flags=["--stop-at", "3"])[0]
    tok = load_tokenizer(os.path.join(out, "tokenizer"))
    init = mmpipe.build_model(load_config(TINY, [f"model.text.vocab_size={len(tok)}",
                                                 f"model.text.eos_token_id={eos_id(tok)}",
                                                 "model.text.max_position_embeddings=16"])).state_dict()
    sd = load_model_weights(os.path.join(out, "checkpoints"), "global_step3")
    frozen = [k for k in sd if k.startswith(("vision.", "visual_projection.", "text_projection."))]
    assert frozen and all(torch.equal(sd[k], init[k]) for k in frozen)
    assert not torch.equal(sd["text.blocks.0.mlp.fc1.weight"], init["text.blocks.0.mlp.fc1.weight"])
    ckpt = os.path.join(out, "checkpoints", "global_step3")
    stage0 = torch.load(os.path.join(ckpt, "mp_rank_00_model_states.pt"), weights_only=False)["optimizer"]
    stage1 = torch.load(os.path.join(ckpt, "mp_rank_01_model_states.pt"), weights_only=False)["optimizer"]
    assert stage0["state"] == {}  # the all-frozen stage holds no optimizer state at all
    names1 = {g["name"] for g in stage1["param_groups"]}
    assert names1 == {"text", "logit_scale"}
    n_state = sum(v.numel() for s in stage1["state"].values() for v in s.values() if torch.is_tensor(v) and v.ndim)
    n_trainable = sum(v.numel() for k, v in sd.items() if k.startswith(("text.", "loss.")))
    assert n_state == 2 * n_trainable  # exp_avg + exp_avg_sq for the trainable text side only
    assert math.isfinite(read_metrics(os.path.join(out, "metrics.jsonl"))[-1]["loss"])


def test_stage_boundary_inside_a_frozen_tower_trains_like_one_process(runs):
    """DeepSpeed's `parameters` split puts the boundary inside the frozen vision tower: stage 1 starts
    with forward-only layers and must still hand a (zero) gradient back to stage 0."""
    p2, _ = runs.get("frozen_split", 2, ["parallel.pipeline_stages=2", "optim.freeze_vision=true",
                                         "parallel.placement=parameters"], flags=["--stop-at", "3"])
    p1, _ = runs.get("frozen_p1", 1, ["parallel.pipeline_stages=1", "optim.freeze_vision=true"], "python",
                     flags=["--stop-at", "3"])
    stages = json.load(open(os.path.join(p2, "plan.json")))["stages"]
    assert stages[1][0].startswith("vision.")  # the case under test
    np.testing.assert_allclose(train_losses(p2), train_losses(p1), rtol=1e-5)
    a = load_model_weights(os.path.join(p2, "checkpoints"), "global_step3")
    b = load_model_weights(os.path.join(p1, "checkpoints"), "global_step3")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)


def test_optim_freeze_names_groups_as_the_shortcuts_do():
    """``optim.freeze: [group]`` is the generic spelling; ``freeze_vision`` (open_clip's --lock-image)
    and ms-swift's ``freeze_vit`` freeze the same group; an unknown group is one line."""
    from mmpipe.config.groups import resolve_groups
    from mmpipe.families.clip import ClipFamily
    generic = resolve_groups(load_config(None, ["optim.freeze=[vision]"]).optim, ClipFamily)
    shortcut = resolve_groups(load_config(None, ["optim.freeze_vision=true"]).optim, ClipFamily)
    assert generic == shortcut and [g.name for g in generic if g.frozen] == ["vision"]
    with pytest.raises(ConfigError, match="optim.freeze: 'visoin' is not a group"):
        resolve_groups(load_config(None, ["optim.freeze=[visoin]"]).optim, ClipFamily)


def test_embedding_tables_take_no_weight_decay_by_type():
    """A decoder's token table is ``embed_tokens``, not "embedding" (issue 29, item 8): exempt by
    type, and its tied LM head with it; the projections and MLPs still decay."""
    from helpers import TINY_VLM

    import mmpipe
    from mmpipe.config.groups import param_groups, resolve_groups
    from mmpipe.config.resolve import build_family
    from mmpipe.parallel.strategies import strategy_for
    from mmpipe.parallel.topology import Topology
    from mmpipe.train.engine import mark_embeddings
    cfg = mmpipe.load_config(TINY_VLM, ["model.llm.vocab_size=200", "model.image_token_id=199"])
    family = build_family(cfg.model, 0)
    model = plain_model(family)
    mark_embeddings(model, strategy_for(Topology(1, 1, 2, 2)), family)  # its named_parameters: plain names
    groups = resolve_groups(cfg.optim, type(family))
    decayed = {id(p) for g in param_groups(model.named_parameters(), groups) if g["weight_decay"] > 0
               for p in g["params"]}
    named = dict(model.named_parameters())
    assert id(named["llm.embed.embed_tokens.weight"]) not in decayed
    assert all(id(p) in decayed for n, p in named.items() if n.endswith("mlp.down_proj.weight"))
