"""LoRA (``optim.train_type: lora``, peft adapters) on the VLM in every layout, against a plain loop
over ``peft.get_peft_model`` on transformers' ``LlavaForConditionalGeneration`` (same initial
weights and adapters, same data, transformers' own loss with ``num_items_in_batch``, per-group
clipping, AdamW); the optimizer holds the adapters only; exports load back with peft."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers import TINY_VLM, Runs, train_losses

import mmpipe
from mmpipe.parallel.plain import plain_model

LORA_SETS = ["optim.train_type=lora", "optim.lora_dropout=0", "optim.lora_rank=4", "optim.lora_alpha=8",
             "optim.groups.llm.max_grad_norm=0.5", "optim.schedule=constant"]
STEPS = 4  # each layout stops here (--stop-at; train.steps is 6)
REF_STEPS = 6  # the reference runs on: a resume continues to 6
LAYOUTS = {"p1": (1, "python", ["parallel.pipeline_stages=1"]),
           "p2": (2, "deepspeed", ["parallel.pipeline_stages=2"]),
           "p3": (3, "deepspeed", ["parallel.pipeline_stages=3"]),
           "p2dp2": (4, "deepspeed", ["parallel.pipeline_stages=2"])}
# P2 x DP2 has the stage boundary, the data-parallel reduction and the forward-only stage; the plain
# P = 2 and P = 3 runs are by hand (MMPIPE_ALL_LAYOUTS=1; the note has their figures), for CI's time
IN_CI = ("p1", "p2dp2")


@pytest.fixture(scope="module")
def lora_data(tmp_path_factory):
    """Clean chat data (no unusable lines: the reference reads every row as it is)."""
    from mmpipe.data.synth import synth_vlm
    d = tmp_path_factory.mktemp("lora_chat")
    info = synth_vlm(str(d), 60, val_fraction=0.1, size=32, seed=3, text_only=0.3, progress=False)
    return {"dir": str(d), "train": info["train"], "val": info["val"]}


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, lora_data):
    return Runs(tmp_path_factory.mktemp("lora_runs"), lora_data, TINY_VLM)


def _run(lora_runs, key):
    nprocs, launcher, sets = LAYOUTS[key]
    return lora_runs.get(key, nprocs, LORA_SETS + sets, launcher, flags=["--stop-at", str(STEPS)])[0]


def hf_name(family, plain: str) -> str:
    """A plain LoRA parameter name -> peft's name on the family's transformers model."""
    return "base_model.model." + family.hf.adapter_name(plain)


def hf_image_inputs(family, b: dict) -> dict:
    """The transformers model's image inputs of a collated batch: LLaVA's normalised pixels (None
    without images); Qwen2.5-VL's patches, grids and ``mm_token_type_ids`` (its positions)."""
    from mmpipe.families.towers.common import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, normalize_pixels
    if "image_grid_thw" in b:
        return family.generation_kwargs(b["input_ids"], {"pixel_values": b["pixel_values"],
                                                         "image_grid_thw": b["image_grid_thw"]}
                                        if b["pixel_values"].shape[0] else {})
    pix = normalize_pixels(b["pixel_values"], OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, torch.float32)
    return {"pixel_values": pix if pix.shape[0] else None}


def peft_reference(run_dir: str, data: dict, steps: int = REF_STEPS):
    """(losses, final adapter weights by plain name, initial adapters) of the plain peft loop."""
    from peft import LoraConfig, get_peft_model

    from mmpipe.data.tokenizer import load_tokenizer
    from mmpipe.families.lora import adapter_state, merged
    from mmpipe.families.chat import read_chat
    from mmpipe.families.chat.loss import label_tokens
    cfg = mmpipe.load_config(os.path.join(run_dir, "config.yaml"))
    ours = mmpipe.build_model(cfg)  # the run's initial weights: base and adapters, seeded by layer name
    family, spec = ours.family, ours.family.lora
    init = {k: v.clone() for k, v in adapter_state(ours.state_dict()).items()}
    hf = family.hf.hf_model(merged(ours.state_dict(), spec)).train()
    from mmpipe.families.lora import peft_targets
    hf_adapters = [hf_name(family, k)[len("base_model.model."):] for k in init]
    model = get_peft_model(hf, LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, bias="none",
                                          **peft_targets(spec, hf_adapters)))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for k, v in init.items():
            params[hf_name(family, k)].copy_(v)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(params[hf_name(family, k)]) for k in init}
    # every adapter is a matrix: all decay (mmpipe's rule and transformers Trainer's alike)
    opt = torch.optim.AdamW(trainable, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
                            weight_decay=cfg.optim.weight_decay)
    tok = load_tokenizer(os.path.join(run_dir, "tokenizer"))
    samples = read_chat(data["train"])
    ds = family.dataset(samples, tok, cfg.data)
    collate = family.collate(tok, cfg.data)
    mb, acc = cfg.parallel.micro_batch_size, cfg.train.batch_size // cfg.parallel.micro_batch_size
    perm = torch.randperm(len(samples), generator=torch.Generator().manual_seed(cfg.train.seed * 100003)).tolist()
    micro = [perm[i:i + mb] for i in range(0, len(perm) - mb + 1, mb)]
    losses = []
    for step in range(steps):
        batches = [collate([ds[i] for i in m]) for m in micro[acc * step:acc * step + acc]]
        n = sum(label_tokens(b["labels"]) for b in batches)
        total = 0.0
        for b in batches:
            # a MoE family: transformers' router loss, as mmpipe weighs it (a mean over the step's micro-batches,
            # where transformers' per-micro-batch sum with num_items_in_batch counts it once per micro-batch)
            moe = {"output_router_logits": True} if getattr(family, "aux_coef", 0) else {}
            out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"],
                        **hf_image_inputs(family, b), num_items_in_batch=torch.tensor(n), **moe)
            loss = out.loss - family.aux_coef * out.aux_loss * (1 - 1 / acc) if moe else out.loss
            loss.backward()
            total += float(loss.detach())
        losses.append(total)
        torch.nn.utils.clip_grad_norm_(trainable, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step + 1 == STEPS:
            at_stop = {k: params[hf_name(family, k)].detach().clone() for k in init}
    final = {k: params[hf_name(family, k)].detach().clone() for k in init}
    return losses, at_stop, init, final


_REF: dict = {}


def _reference(lora_runs, lora_data):
    if "ref" not in _REF:
        _REF["ref"] = peft_reference(_run(lora_runs, "p1"), lora_data)
    return _REF["ref"]


@pytest.mark.parametrize("key", list(LAYOUTS))
def test_lora_matches_a_plain_peft_loop_in_every_layout(lora_runs, lora_data, key):
    from mmpipe.families.lora import adapter_state
    if key not in IN_CI and not os.environ.get("MMPIPE_ALL_LAYOUTS"):
        pytest.skip("by hand with MMPIPE_ALL_LAYOUTS=1 (P2 x DP2 runs the same stage boundary in CI)")
    ref_losses, ref_final, init, _ = _reference(lora_runs, lora_data)
    out = _run(lora_runs, key)
    np.testing.assert_allclose(train_losses(out), ref_losses[:STEPS], rtol=1e-5, atol=1e-6)
    w = mmpipe.load_weights(out, STEPS)
    got = adapter_state(w)
    assert got.keys() == ref_final.keys() and len(got) == 42  # q k v o gate up down x 3 blocks x (A, B)
    for k in got:
        torch.testing.assert_close(got[k], ref_final[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
    assert any(not torch.equal(got[k], init[k]) for k in got if ".lora_B." in k)  # the adapters trained
    # the checkpoint holds the adapters, not the frozen base (which never moves: load_weights rebuilds it
    # from the run's config); a tied head is the embedding's copy on the last stage
    from mmpipe.families.lora import is_adapter
    from mmpipe.train.checkpoint_weights import load_model_weights
    raw = load_model_weights(os.path.join(out, "checkpoints"), f"global_step{STEPS}")
    assert all(is_adapter(k) for k in raw if k != "llm.head.lm_head.weight") and len(raw) <= len(got) + 1
    base = mmpipe.build_model(mmpipe.load_config(os.path.join(out, "config.yaml"))).state_dict()
    assert w.keys() == base.keys()
    # the optimizer holds the adapters only: per stage, Adam's moments of each adapter weight and nothing else
    from safetensors.torch import load_file
    step_dir = os.path.join(out, "checkpoints", f"global_step{STEPS}")
    held = {}
    for f in sorted(os.listdir(step_dir)):
        if f.startswith("optim_stage"):
            held.update(load_file(os.path.join(step_dir, f)))
    moments = {k.split("::")[0]: v for k, v in held.items() if k.endswith("::exp_avg")}
    assert moments.keys() == got.keys()
    assert sum(v.numel() for v in moments.values()) == sum(v.numel() for v in got.values())


def test_lora_exports_load_with_peft_and_merged(lora_runs, lora_data, tmp_path, capsys):
    """`mmpipe export` of a LoRA run trained at P2 x DP2: a peft adapter directory that
    PeftModel.from_pretrained(LlavaForConditionalGeneration.from_pretrained(OUT/base), OUT) loads,
    and with --merge full weights: both give the mmpipe model's logits; `mmpipe generate` answers
    from the run as the merged export does."""
    from peft import PeftModel
    from transformers import LlavaForConditionalGeneration

    from mmpipe.cli.generate import Generator
    from mmpipe.cli.main import main
    from mmpipe.data.tokenizer import load_tokenizer
    from mmpipe.families.chat import read_chat
    run = _run(lora_runs, "p2dp2")
    adapter, merged_dir = str(tmp_path / "adapter"), str(tmp_path / "merged")
    assert main(["export", "--run", run, "--out", adapter]) == 0
    said = capsys.readouterr().out
    assert "peft adapter directory" in said and "LlavaForConditionalGeneration.from_pretrained(" in said
    assert "names the base by this absolute path: after moving the directory to NEW" in said
    assert main(["export", "--run", run, "--out", merged_dir, "--merge"]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(adapter))
    peft_model = PeftModel.from_pretrained(LlavaForConditionalGeneration.from_pretrained(os.path.join(adapter, "base")),
                                           adapter).eval()
    full = LlavaForConditionalGeneration.from_pretrained(merged_dir).eval()
    ours = mmpipe.build_model(mmpipe.load_config(os.path.join(run, "config.yaml"))).eval()
    ours.load_state_dict(mmpipe.load_weights(run))
    fam = ours.family
    tok = load_tokenizer(os.path.join(run, "tokenizer"))
    samples = [s for s in read_chat(lora_data["val"]) if s.images][:2]
    ds = fam.dataset(samples, tok, ours_cfg_data(run))
    b = fam.collate(tok, ours_cfg_data(run))([ds[0], ds[1]])
    from mmpipe.families.towers.common import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, normalize_pixels
    pix = normalize_pixels(b["pixel_values"], OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, torch.float32)
    with torch.no_grad():
        want = ours.eval_outputs(b["pixel_values"], b["input_ids"], b["attention_mask"])
        keep = b["attention_mask"].bool()  # the real tokens (a padding position's output is no one's)
        for m in (peft_model, full):
            got = m(input_ids=b["input_ids"], pixel_values=pix, attention_mask=b["attention_mask"]).logits
            torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=0)
    # the adapters are not zero: the comparison would notice them missing
    base_logits = LlavaForConditionalGeneration.from_pretrained(os.path.join(adapter, "base")).eval()(
        input_ids=b["input_ids"], pixel_values=pix, attention_mask=b["attention_mask"]).logits
    assert (base_logits - want)[keep].abs().max() > 1e-4
    g = Generator(run)
    question = samples[0].messages[0][1].replace("<image>", "").strip()
    ids, px = g.prompt(question, samples[0].images[0])
    px = px["pixel_values"]
    with torch.no_grad():
        hf_new = full.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=px, max_new_tokens=6,
                               do_sample=False)[0, ids.shape[1]:].tolist()
    assert g.generate_ids(question, samples[0].images[0], max_new_tokens=6) == hf_new


def ours_cfg_data(run):
    return mmpipe.load_config(os.path.join(run, "config.yaml")).data


def test_lora_with_dropout_is_the_same_run_in_every_layout_and_resumes_exactly(lora_runs, lora_data, tmp_path):
    """With ms-swift's LoRA dropout (p > 0) every sample draws its dropout masks from (seed, step, layer,
    its key): P = 1 and P2 x DP2 with ``data.balance: cost`` (the step's samples regrouped) give the same
    losses and adapters, and the P = 1 checkpoint at step 4 resumed at P = 2 (no regrouping) continues as
    the straight regrouped P2 x DP2 run does to step 6."""
    import shutil

    from helpers import launch

    from mmpipe.families.lora import adapter_state
    drop = [s for s in LORA_SETS if not s.startswith("optim.lora_dropout")] + ["optim.lora_dropout=0.1"]
    p1 = lora_runs.get("p1_drop", 1, drop + ["parallel.pipeline_stages=1"], "python", flags=["--stop-at", "4"])[0]
    straight = lora_runs.get("p2dp2_drop", 4, drop + ["parallel.pipeline_stages=2", "data.balance=cost",
                                                      "data.log_samples=true"])[0]  # to step 6
    from test_balance_runs import _regrouped
    assert _regrouped(straight, 6), "nothing was regrouped: the test would not see a mask that follows the slot"
    ref_losses, _, _, _ = _reference(lora_runs, lora_data)
    assert abs(train_losses(p1)[1] - ref_losses[1]) > 1e-6  # dropout is on: the run is not the dropout-free one
    np.testing.assert_allclose(train_losses(p1), train_losses(straight)[:4], rtol=1e-5, atol=1e-6)
    out = str(tmp_path / "resumed")
    shutil.copytree(p1, out)
    args = lora_runs.base(out)
    for s in drop + ["parallel.pipeline_stages=2"]:
        args += ["--set", s]
    launch(2, args + ["--resume"])
    np.testing.assert_allclose(train_losses(out), train_losses(straight), rtol=1e-5, atol=1e-6)
    got, want = adapter_state(mmpipe.load_weights(out, REF_STEPS)), adapter_state(mmpipe.load_weights(straight, REF_STEPS))
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")


def test_lora_targets_follow_ms_swift_flags():
    """all-linear on the decoder by default (ViT and projector frozen, as ms-swift's freeze_vit /
    freeze_aligner default under LoRA); freeze_vit=false / freeze_aligner=false add theirs; named
    target modules select by suffix; a name matching nothing is one line."""
    from mmpipe.config.resolve import build_family
    from mmpipe.errors import ConfigError
    base = ["model.llm.vocab_size=100", "model.image_token_id=99", "optim.train_type=lora"]

    def adapters(*sets):
        fam = build_family(mmpipe.load_config(TINY_VLM, base + list(sets)))
        return sorted({n.split(".lora_")[0] for names in fam.meta_params().values() for n in names if ".lora_A." in n})
    default = adapters()
    assert default and all(n.startswith("llm.blocks.") for n in default)
    assert {n.rsplit(".", 1)[1] for n in default} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                       "down_proj"}  # never the LM head
    with_vit = adapters("optim.freeze_vit=false", "optim.freeze_aligner=false")
    assert any(n.startswith("vision.blocks.") for n in with_vit) and "projector.linear_1" in with_vit
    assert adapters("optim.target_modules=[q_proj,v_proj]") == [n for n in default if n.endswith(("q_proj", "v_proj"))]
    with pytest.raises(ConfigError, match="matches no linear layer"):
        adapters("optim.target_modules=[nothing_here]")
    # full training is untouched: no adapter anywhere
    assert not build_family(mmpipe.load_config(TINY_VLM, base[:2])).lora


def test_clip_lora_adapts_the_projections_as_peft_all_linear_does():
    """CLIP's projection layers *are* Linears: all-linear adapts them (as peft's all-linear on transformers'
    CLIPModel does: the same set of adapted modules), the temperature stays frozen (as there), and a step's
    gradient reaches the adapters of both projections."""
    from peft import LoraConfig, get_peft_model

    from mmpipe.config.resolve import build_family
    from mmpipe.families.lora import merged
    sets = ["model.text.vocab_size=100", "optim.train_type=lora", "optim.lora_rank=4"]
    fam = build_family(mmpipe.load_config(os.path.join(os.path.dirname(TINY_VLM), "tiny.yaml"), sets))
    model = plain_model(fam)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    ours = {n.split(".lora_A.")[0] for n in trained if ".lora_A." in n}
    assert {"visual_projection", "text_projection"} <= ours
    assert "loss.logit_scale" not in trained and not any(".base_layer." in n for n in trained)
    hf = fam.hf.hf_model(merged({k: v.detach() for k, v in model.state_dict().items()}, fam.lora))
    peft_model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=32, target_modules="all-linear"))
    theirs = {n for n, m in peft_model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    assert len(ours) == len(theirs) and {"visual_projection", "text_projection"} <= {n.rsplit(".", 1)[-1]
                                                                                      for n in theirs}
    b = fam.example_batch(4, 16, "cpu")
    batch = [b[k] for k in fam.inputs + fam.labels]
    for n, p in model.named_parameters():  # lora_B starts at zero: give it values so lora_A gets a gradient
        if ".lora_B." in n:
            torch.nn.init.normal_(p.data, std=0.1)
    model(*batch).backward()
    for proj in ("visual_projection", "text_projection"):
        assert model.get_submodule(proj).lora_A["default"].weight.grad.abs().sum() > 0


def test_bf16_lora_trains_alike_at_p1_and_on_two_stages_with_the_default_placement(lora_runs):
    """bf16 at P = 1 (DeepSpeed's unfused optimizer wrapper, whose constructor used to step AdamW once on
    zero gradients) trains as on two stages (BF16_Optimizer); the default placement puts the frozen ViT
    and projector on stage 0 and gives that stage the decoder's first adapted layer, which bf16 needs."""
    sets = [s for s in LORA_SETS if not s.startswith("optim.lora_rank")] + ["optim.lora_rank=8", "train.precision=bf16"]
    p1 = lora_runs.get("bf16_p1", 1, sets + ["parallel.pipeline_stages=1"], "python", flags=["--stop-at", "4"])[0]
    p2, proc = lora_runs.get("bf16_p2", 2, sets + ["parallel.pipeline_stages=2"], flags=["--stop-at", "4"])
    assert "moved onto the stage before" in proc.stdout + proc.stderr
    a, b = train_losses(p1)[:4], train_losses(p2)[:4]
    np.testing.assert_allclose(a, b, rtol=0, atol=2e-3)


def test_the_profile_cache_key_of_a_lora_config_is_the_same_in_every_process():
    """The layers that get adapters are a set, whose order (and ``repr``) changes with the string-hash seed: the
    layer profile's key takes them in order, so two processes (two runs, a run and ``mmpipe plan``) share one
    cached profile."""
    import subprocess
    import sys
    code = ("import mmpipe; from mmpipe.planning.offline import resolve_for_plan; "
            "from mmpipe.planning.measure import profile_digest, profile_key; "
            f"cfg, fam = resolve_for_plan(mmpipe.load_config({TINY_VLM!r}, ['optim.train_type=lora'])); "
            "assert fam.lora is not None and len(fam.lora.layers) > 2; "
            "print(profile_digest(profile_key(cfg, fam, 2, 1, 'cpu', frozenset(), frozenset())))")
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env=dict(os.environ, PYTHONHASHSEED=seed)).stdout.split()[-1] for seed in ("1", "2")}
    assert len(digests) == 1, digests


def test_the_lora_export_message_names_the_base_class_and_how_the_base_is_named(tmp_path):
    """What ``mmpipe export`` says of a LoRA export comes from what it wrote: the base's class (a Qwen run's is
    not LLaVA's) and whether adapter_config.json names the base by an absolute path (a move needs the base given
    by hand) or by its hub id (the directory moves freely)."""
    import json

    from mmpipe.cli.export import peft_load_hint
    out = tmp_path / "adapter"
    (out / "base").mkdir(parents=True)
    (out / "base" / "mmpipe_hf_export.json").write_text(json.dumps({"class": "Qwen2_5_VLForConditionalGeneration"}))
    for named, moved in ((str(out / "base"), "after moving the directory to NEW, PeftModel.from_pretrained("
                          "Qwen2_5_VLForConditionalGeneration.from_pretrained('NEW/base'), 'NEW')"),
                         ("Qwen/Qwen2.5-VL-3B-Instruct", "the hub id Qwen/Qwen2.5-VL-3B-Instruct at revision abc, so "
                          "the directory can be moved")):
        (out / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": named, "revision": "abc"}))
        hint = peft_load_hint(str(out))
        assert "Qwen2_5_VLForConditionalGeneration.from_pretrained(" in hint and "Llava" not in hint
        assert hint.endswith(moved), hint
