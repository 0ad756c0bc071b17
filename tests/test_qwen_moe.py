"""The Qwen MoE families (``model.type: qwen3_5_moe``, ``qwen3_vl_moe``): transformers' arithmetic with its router's
load-balancing loss (a directory written offline, fed by its own processor), packed = unpacked, the expert products
priced by active parameters; the layouts (P = 1, P = 2 cut between MoE blocks) train alike, export answers as
``mmpipe generate``."""
from __future__ import annotations

import pytest
import torch
from PIL import Image
from qwen_fixtures import check_generates_as_mmpipe, loaded_model, resolved_family, write_chat, write_images

FAMILIES = {"qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", "write_tiny_qwen3_5_moe"),
            "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", "write_tiny_qwen3_vl_moe")}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def moe_dir(request, tmp_path_factory):
    from mmpipe.families.qwen_vl import tiny
    name = request.param
    return name, getattr(tiny, FAMILIES[name][1])(str(tmp_path_factory.mktemp(name) / "dir"), seed=1)


ROWS = lambda paths: [(["<image>", "<image>"], "what colour are the shapes?", "red", paths[:2]),  # noqa: E731
                      ([], "what is two plus two?", "four", []),
                      (["<image>"], "how many shapes are there?", "three", paths[2:3]),
                      (["<image>", "<image>"], "where is the shape?", "at the top left", paths[3:])]


def test_loss_logits_and_aux_loss_are_transformers(moe_dir, tmp_path):
    """Five image sizes, two-image, one-image and text-only rows (right padding): logits, the loss (LM + coef x
    aux) and the aux loss itself within 1e-5 of transformers' with ``output_router_logits=True``; the router's
    statistics cross the layers as one tensor, and a routed block's gradient reaches its router and experts."""
    import transformers
    from transformers import AutoProcessor

    from mmpipe.families.chat import read_chat
    from mmpipe.families.qwen_vl.experts import aux_loss
    name, d = moe_dir
    paths = write_images(tmp_path)
    rows = ROWS(paths)
    cfg, fam, tok = resolved_family(name, d)
    ds, collate = fam.dataset(read_chat(write_chat(tmp_path / "chat.jsonl", rows)), tok, cfg.data), fam.collate(tok, cfg.data)
    b = collate([ds[i] for i in range(len(rows))])
    assert len({tuple(g.tolist()) for g in b["image_grid_thw"]}) == 5
    proc = AutoProcessor.from_pretrained(d)
    proc.image_processor.size = {"shortest_edge": 4096, "longest_edge": 65536}
    texts = [proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}] * len(marks) +
                                        [{"type": "text", "text": "\n" + q}]},
                                       {"role": "assistant", "content": [{"type": "text", "text": a}]}])
             for marks, q, a, _ in rows]
    enc = proc(text=texts, images=[Image.open(p).convert("RGB") for p in paths], return_tensors="pt", padding=True)
    mask = b["attention_mask"].bool()
    for i in range(len(rows)):
        assert b["input_ids"][i][mask[i]].tolist() == enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist()
    assert (~mask).any()  # padded rows: the aux loss must leave their padding out
    hf = getattr(transformers, FAMILIES[name][0]).from_pretrained(d).eval()
    ours = loaded_model(fam).eval()
    with torch.no_grad():
        inputs = [b[k] for k in fam.inputs]
        logits, stats = ours.eval_outputs(*inputs)
        loss = ours(*inputs, b["labels"])
        out = hf(input_ids=b["input_ids"], attention_mask=b["attention_mask"], pixel_values=b["pixel_values"],
                 image_grid_thw=b["image_grid_thw"], mm_token_type_ids=(b["input_ids"] == fam.image_token_id).int(),
                 labels=b["labels"], output_router_logits=True)
    assert len(out.router_logits) == len(fam.moe_layers()) > 0
    torch.testing.assert_close(aux_loss(stats), out.aux_loss, rtol=0, atol=1e-5)
    assert stats[2, 0] == mask.sum() * len(fam.moe_layers())  # every real token, once per MoE layer
    torch.testing.assert_close(loss, out.loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[mask], out.logits[mask], rtol=0, atol=1e-5)
    assert fam.aux_coef == 0.01 and abs(out.aux_loss - 2.0) < 0.5  # near top_k for near-uniform routing
    ours.train()
    ours(*inputs, b["labels"]).backward()
    block = ours.get_submodule(fam.moe_layers()[-1])
    assert block.mlp.gate.weight.grad.abs().sum() > 0 and block.mlp.experts.gate_up_proj.grad.abs().sum() > 0


def test_packed_rows_give_the_unpacked_loss_aux_and_every_gradient(moe_dir, tmp_path):
    """Six samples as six rows and as two packed rows of three: the loss (LM + aux), the router statistics and
    every gradient (the routers' and experts' included) within 1e-5: a sample's tokens count once wherever they sit,
    padding not at all."""
    from mmpipe.families.chat import read_chat
    name, d = moe_dir
    paths = write_images(tmp_path)
    rows = [(["<image>"], "what colour are the shapes?", "red", paths[:1]),
            ([], "what is two plus two?", "four", []),
            (["<image>", "<image>"], "how many shapes are there?", "three and two", paths[1:3]),
            (["<image>"], "where is the shape?", "at the top left", paths[3:4]),
            (["<image>"], "what kind of shape is shown?", "a circle", paths[4:5]),
            ([], "what number comes after one?", "two", [])]
    cfg, fam, tok = resolved_family(name, d)
    recs = read_chat(write_chat(tmp_path / "chat.jsonl", rows))
    ds, collate = fam.dataset(recs, tok, cfg.data), fam.collate(tok, cfg.data)
    single = collate([ds[i] for i in range(6)])
    pcfg, _, _ = resolved_family(name, d, packing=True, max_length=10**4)
    packs = fam.dataset(recs, tok, pcfg.data)
    packs.packs = [[0, 1, 2], [3, 4, 5]]
    packed = collate([packs[0], packs[1]])
    assert packed["attention_mask"].max() == 3 and (single["attention_mask"] == 0).any()
    model = loaded_model(fam).train()
    got = []
    for b in (single, packed):
        model.zero_grad()
        inputs = [b[k] for k in fam.inputs]
        loss = model(*inputs, b["labels"], torch.tensor(float((b["labels"] != -100).sum())))
        loss.backward()
        with torch.no_grad():
            stats = model.eval_outputs(*inputs)[1]
        got.append((loss.detach(), stats, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}))
    (a, sa, ga), (b, sb, gb) = got
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sb, sa, rtol=1e-5, atol=1e-5)
    assert ga.keys() == gb.keys() and any(k.endswith("mlp.gate.weight") for k in ga)
    for k in ga:
        torch.testing.assert_close(gb[k], ga[k], rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")


def test_expert_products_count_active_parameters():
    """Analytic FLOPs of a routed block: the router, top-k experts per token (not all E) and the shared expert; the
    dense block of ``mlp_only_layers`` its MLP."""
    from helpers import TINY_CONFIGS

    import mmpipe
    from mmpipe.config.schema import family_of
    from mmpipe.families.products import MicroBatch
    for name in FAMILIES:
        cfg = mmpipe.load_config(TINY_CONFIGS[name], ["model.llm.vocab_size=120", "model.image_token_id=5"])
        fam = family_of(cfg)(cfg.model)
        t, mb = fam.text_cfg, MicroBatch(2, 10, 1)
        products = {p.weight: p for p in fam.matmuls("llm.blocks.3", mb)}
        assert products["mlp.experts.gate_up_proj"].m == 20 * t.num_experts_per_tok
        assert products["mlp.gate"].n == t.num_experts
        assert ("mlp.shared_expert.down_proj" in products) == (name == "qwen3_5_moe")
        if name == "qwen3_vl_moe":
            dense = {p.weight for p in fam.matmuls("llm.blocks.2", mb)}
            assert "mlp.down_proj" in dense and not any("experts" in (w or "") for w in dense)


# ---- runs --------------------------------------------------------------------------------------------------
# P = 2 cut between two MoE blocks: hidden states, the router statistics and the integers cross it
CUTS = {"qwen3_5_moe": [["vision.embed", "vision.blocks.0", "vision.blocks.1", "merger", "llm.embed", "llm.blocks.0",
                         "llm.blocks.1"], ["llm.blocks.2", "llm.blocks.3", "llm.head"]],
        "qwen3_vl_moe": [["vision.embed", "vision.blocks.0", "deepstack.0", "vision.blocks.1", "deepstack.1",
                          "vision.blocks.2", "merger", "llm.embed", "llm.blocks.0"],
                         ["llm.blocks.1", "llm.blocks.2", "llm.blocks.3", "llm.head"]]}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_layouts_train_alike_with_the_router_loss(family_runs_of, tmp_path, name):
    """P = 1 and P = 2 cut between MoE blocks (DeepStack's features and the router statistics cross the cut):
    the same losses (rtol 1e-5), ``lm_loss``, ``aux_loss`` and expert load, and weights; the logged loss is
    ``lm_loss + coef x aux_loss`` and the aux loss moves the routers."""
    import json
    import os

    import numpy as np
    from helpers import train_losses
    from test_parity import _records, _weights, assert_weights_close
    runs = family_runs_of(name)
    plan = tmp_path / "cut.json"
    plan.write_text(json.dumps({"stages": CUTS[name]}))
    two, _ = runs.get("p2_cut", 2, ["parallel.pipeline_stages=2", f"parallel.plan={plan}"], flags=["--stop-at", "3"])
    one, _ = runs.get("p1", 1, ["parallel.pipeline_stages=1"], "python", flags=["--stop-at", "3"])
    with open(os.path.join(two, "plan.json")) as fh:
        assert json.load(fh)["stages"] == CUTS[name]
    np.testing.assert_allclose(train_losses(two), train_losses(one), rtol=1e-5)
    a, b = _records(one), _records(two)
    for key in ("lm_loss", "aux_loss", "expert_load_min", "expert_load_max", "expert_imbalance"):
        np.testing.assert_allclose([r[key] for r in b], [r[key] for r in a], rtol=1e-5, err_msg=key)
    for r in a:
        assert abs(r["loss"] - (r["lm_loss"] + 0.01 * r["aux_loss"])) < 1e-5 * r["loss"]
        assert 1.5 < r["aux_loss"] < 3.0 and r["expert_load_min"] <= r["expert_load_max"]
    # (atol 2e-6: as Qwen3.5's packed run, one linear-attention element of ~0.02 lands 1.3e-6 apart)
    assert_weights_close(_weights(two, 3), _weights(one, 3), rtol=1e-5, atol=2e-6)


def test_exported_run_answers_through_transformers_as_mmpipe_generate(family_runs_of, moe_dir, tmp_path):
    """A run from the offline directory (its experts loaded one tensor per expert, or fused) exported ->
    ``AutoModelForImageTextToText`` (the family's transformers class, experts saved as transformers saves them) +
    ``AutoProcessor``: greedy ``generate`` gives ``mmpipe generate``'s tokens on held-out images."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmpipe.train.export import export
    name, d = moe_dir
    runs = family_runs_of(name)
    ref, _ = runs.get("p1_pretrained", 1, ["parallel.pipeline_stages=1", f"model.pretrained={d}",
                                           "model.llm.max_position_embeddings=null", "train.steps=2"], "python")
    out, _, _ = export(ref, str(tmp_path / "hf"))
    hf, proc = AutoModelForImageTextToText.from_pretrained(out).eval(), AutoProcessor.from_pretrained(out)
    assert type(hf).__name__ == FAMILIES[name][0]
    check_generates_as_mmpipe(hf, proc, ref, tmp_path, [(150, 50), (64, 170)])


def test_released_qwen3_vl_moe_layout_loads_as_transformers_loads_it(tmp_path):
    """Qwen3-VL-MoE's released checkpoints hold the fused experts transposed ([E, H, 2I], [E, I, H]): mmpipe's layers
    get transformers' in-memory tensors from them, as ``from_pretrained`` does."""
    import glob

    from safetensors.torch import load_file, save_file
    from transformers import Qwen3VLMoeForConditionalGeneration

    from mmpipe.families.qwen_vl.tiny import write_tiny_qwen3_vl_moe
    d = write_tiny_qwen3_vl_moe(str(tmp_path / "dir"), text={"moe_intermediate_size": 8})
    path = glob.glob(d + "/*.safetensors")[0]
    state = load_file(path)
    released = {k: v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v
                for k, v in state.items()}
    assert released["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 32, 16)
    save_file(released, path, metadata={"format": "pt"})
    hf = Qwen3VLMoeForConditionalGeneration.from_pretrained(d)
    _, fam, _ = resolved_family("qwen3_vl_moe", d)
    ours = loaded_model(fam)
    for k in ("gate_up_proj", "down_proj"):
        torch.testing.assert_close(ours.get_submodule("llm.blocks.1.mlp.experts").get_parameter(k),
                                   hf.model.language_model.layers[1].mlp.experts.get_parameter(k), rtol=0, atol=0)


def test_lora_equals_a_peft_loop_on_transformers(family_runs_of):
    """``optim.train_type: lora`` (all-linear, as peft's: attention, the shared expert and its gate; not the routers'
    bare weights nor the fused experts) on Qwen3.5-MoE against ``peft.get_peft_model`` on
    ``Qwen3_5MoeForConditionalGeneration`` with its router loss: the same losses and adapters."""
    import numpy as np
    from helpers import train_losses
    from test_lora import LORA_SETS, STEPS, peft_reference

    import mmpipe
    from mmpipe.families.lora import adapter_state
    runs = family_runs_of("qwen3_5_moe")
    out, _ = runs.get("lora_p1", 1, LORA_SETS + ["parallel.pipeline_stages=1"], "python", flags=["--stop-at", str(STEPS)])
    ref_losses, at_stop, init, _ = peft_reference(out, runs.data, steps=STEPS)
    np.testing.assert_allclose(train_losses(out), ref_losses, rtol=1e-5, atol=1e-6)
    got = adapter_state(mmpipe.load_weights(out, STEPS))
    adapted = {k.split(".lora_")[0].rsplit(".", 1)[1] for k in got}
    assert adapted == {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "k_proj",
                       "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "shared_expert_gate"}, adapted
    assert all(".shared_expert." in k for k in got if ".mlp." in k and "shared_expert_gate" not in k)
    for k in got:
        torch.testing.assert_close(got[k], at_stop[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
    assert any(not torch.equal(got[k], init[k]) for k in got if ".lora_B." in k)


def test_bf16_and_a_resume_onto_one_process(family_runs_of, tmp_path):
    """Qwen3.5-MoE in bf16: P = 2 (cut between MoE blocks) trains as P = 1 within bf16's rounding; the P = 2
    reference's step-4 checkpoint continued at P = 1 (``test_elastic``'s check): steps 5-6 equal."""
    import json

    import numpy as np
    from helpers import train_losses
    from test_elastic import check_resume_on_another_layout
    from test_parity import _weights, assert_weights_close
    runs = family_runs_of("qwen3_5_moe")
    plan = tmp_path / "cut.json"
    plan.write_text(json.dumps({"stages": CUTS["qwen3_5_moe"]}))
    bf16 = ["train.precision=bf16"]
    one, _ = runs.get("bf16_p1", 1, ["parallel.pipeline_stages=1"] + bf16, "python", flags=["--stop-at", "3"])
    two, _ = runs.get("bf16_p2", 2, ["parallel.pipeline_stages=2", f"parallel.plan={plan}"] + bf16,
                      flags=["--stop-at", "3"])
    np.testing.assert_allclose(train_losses(two), train_losses(one), rtol=1e-3)
    assert_weights_close(_weights(two, 3), _weights(one, 3), rtol=1e-2, atol=4e-3)
    check_resume_on_another_layout(runs, tmp_path, "el_p1", 1, "python", ["parallel.pipeline_stages=1"])


@pytest.mark.parametrize("name,key,nprocs,sets", [
    # pipeline x data parallel against the P = 2 reference (test_parity's check: losses, lr, weights)
    ("qwen3_5_moe", "p2dp2", 4, ["parallel.pipeline_stages=2"]),
    # ZeRO-3 over two ranks whose micro-batches route differently (every expert's weights gathered on both)
    ("qwen3_vl_moe", "dp2_z3", 2, ["parallel.pipeline_stages=1", "parallel.zero_stage=3"]),
])
def test_data_parallel_layouts_train_as_the_reference(family_runs_of, name, key, nprocs, sets):
    """P2 x DP2 (Qwen3.5-MoE) and DP2 with ZeRO-3 (Qwen3-VL-MoE) train the losses and weights of the single-layout
    reference, the router loss included."""
    import numpy as np
    from helpers import train_losses
    from test_parity import _weights, assert_weights_close, check_layout_parity
    runs = family_runs_of(name)
    if key == "p2dp2":
        check_layout_parity(name, runs, key, nprocs, "deepspeed", sets, loss_rtol=1e-5)
        return
    one, _ = runs.get("p1", 1, ["parallel.pipeline_stages=1"], "python", flags=["--stop-at", "3"])
    out, _ = runs.get(key, nprocs, sets, flags=["--stop-at", "3"])
    np.testing.assert_allclose(train_losses(out), train_losses(one), rtol=1e-5)
    assert_weights_close(_weights(out, 3), _weights(one, 3), rtol=1e-5, atol=2e-6)


def test_the_router_loss_weight_is_a_setting_and_the_experts_are_the_checkpoints(moe_dir, tmp_path):
    """``model.llm.router_aux_loss_coef`` over a directory's value (0: no router loss: the loss is the LM loss), where
    an architecture field that disagrees with the directory is one line naming both."""
    import yaml

    import mmpipe
    from mmpipe.config.resolve import resolve_family
    from mmpipe.data.tokenizer import load_tokenizer
    from mmpipe.errors import ConfigError
    name, d = moe_dir
    cfg, fam, tok = resolved_family(name, d)
    assert fam.aux_coef == 0.01

    def resolved(llm: dict):
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump({"model": {"type": name, "pretrained": d, "llm": llm},
                                        "data": {"min_pixels": 4096, "max_pixels": 65536, "num_workers": 0}}))
        return resolve_family(mmpipe.load_config(str(path)), fam.prepare_tokenizer(load_tokenizer(d)))[1]
    off = resolved({"router_aux_loss_coef": 0.0})
    assert off.aux_coef == 0.0 and off.text_cfg.num_experts == 8
    with pytest.raises(ConfigError, match="num_experts") as e:
        resolved({"num_experts": 4})
    assert "\n" not in str(e.value)
    if name == "qwen3_vl_moe":  # every block dense: no router, no aux loss (transformers' would be NaN)
        from helpers import TINY_CONFIGS

        from mmpipe.config.resolve import build_family
        sets = ["model.llm.vocab_size=120", "model.image_token_id=5", "model.llm.mlp_only_layers=[0,1,2,3]"]
        with pytest.raises(ConfigError, match="leave no block with experts"):
            build_family(mmpipe.load_config(TINY_CONFIGS[name], sets).model, 0)


EP = ["parallel.expert_parallel=2"]


def test_expert_parallel_trains_as_the_reference_and_resumes_onto_one_process(family_runs_of, tmp_path):
    """DP2 x EP2 (each rank holds four of the eight experts of every MoE block: DeepSpeed's file has rank 0's four,
    mmpipe's experts file all eight) trains the P = 2 reference's six steps (losses rtol 1e-5, ``aux_loss`` and expert
    load, weights at steps 2, 4 and 6); its step-4 checkpoint continued on one process (EP1) gives its steps 5-6."""
    import glob
    import os

    import numpy as np
    from helpers import train_losses
    from safetensors.torch import load_file
    from test_elastic import check_resume_on_another_layout
    from test_parity import _records, _weights, assert_weights_close, reference
    runs = family_runs_of("qwen3_5_moe")
    ref = reference(runs)
    ep, _ = runs.get("dp2_ep2", 2, ["parallel.pipeline_stages=1", "train.save_every=2"] + EP)
    np.testing.assert_allclose(train_losses(ep), train_losses(ref), rtol=1e-5)
    for key in ("aux_loss", "expert_load_min", "expert_load_max", "grad_norm"):  # (the norm: over both ranks' experts)
        np.testing.assert_allclose([r[key] for r in _records(ep)], [r[key] for r in _records(ref)], rtol=1e-5,
                                   err_msg=key)
    for step in (2, 4, 6):
        assert_weights_close(_weights(ep, step), _weights(ref, step), rtol=1e-4, atol=1e-6)
    d = os.path.join(ep, "checkpoints", "global_step6")
    name = "llm.blocks.0.mlp.experts.gate_up_proj"
    held = torch.load(glob.glob(os.path.join(d, "mp_rank_00_model_states.pt"))[0], weights_only=False)["module"]
    assert held[name].shape[0] == 4 and load_file(os.path.join(d, "experts_stage0.safetensors"))[name].shape[0] == 8
    check_resume_on_another_layout(runs, tmp_path, "ep2_to_p1", 1, "python", ["parallel.pipeline_stages=1"], ref=ep)


def test_pipeline_by_data_by_expert_parallel_trains_as_the_reference(family_runs_of, tmp_path):
    """P2 x DP2 x EP2 (cut between MoE blocks: the experts of both stages split over their stage's two data-parallel
    ranks) trains the P = 2 reference (test_parity's check: losses rtol 1e-5, lr, weights)."""
    import json

    from test_parity import check_layout_parity
    plan = tmp_path / "cut.json"
    plan.write_text(json.dumps({"stages": CUTS["qwen3_5_moe"]}))
    check_layout_parity("qwen3_5_moe", family_runs_of("qwen3_5_moe"), "p2dp2_ep2", 4, "deepspeed",
                        ["parallel.pipeline_stages=2", f"parallel.plan={plan}"] + EP, loss_rtol=1e-5)


def test_expert_parallel_in_bf16(family_runs_of):
    """DP2 x EP2 in bf16 trains as P = 1 in bf16, within bf16's rounding."""
    import numpy as np
    from helpers import train_losses
    from test_parity import _weights, assert_weights_close
    runs = family_runs_of("qwen3_5_moe")
    bf16 = ["train.precision=bf16"]
    one, _ = runs.get("bf16_p1", 1, ["parallel.pipeline_stages=1"] + bf16, "python", flags=["--stop-at", "3"])
    ep, _ = runs.get("bf16_dp2_ep2", 2, ["parallel.pipeline_stages=1"] + EP + bf16, flags=["--stop-at", "3"])
    np.testing.assert_allclose(train_losses(ep), train_losses(one), rtol=1e-3)
    assert_weights_close(_weights(ep, 3), _weights(one, 3), rtol=1e-2, atol=4e-3)


@pytest.mark.parametrize("zero", [1, 2])
def test_expert_data_parallel_with_zero(family_runs_of, zero):
    """DP4 x EP2 with ZeRO-1 and ZeRO-2: each expert slice lives on two ranks (its gradient reduced over those two,
    its optimizer state partitioned over them, the other parameters over all four) and trains the P = 2 reference
    (test_parity's check: losses rtol 1e-5, lr, weights)."""
    import numpy as np
    from test_parity import _records, check_layout_parity, reference
    runs = family_runs_of("qwen3_5_moe")
    check_layout_parity("qwen3_5_moe", runs, f"dp4_ep2_z{zero}", 4, "deepspeed",
                        ["parallel.pipeline_stages=1", f"parallel.zero_stage={zero}"] + EP, loss_rtol=1e-5)
    # the norm over every partition (ZeRO-1: mmpipe's, over the world; ZeRO-2: DeepSpeed's): the reference's
    got, want = _records(runs.get(f"dp4_ep2_z{zero}", 4, [])[0]), _records(reference(runs))[:4]
    np.testing.assert_allclose([r["grad_norm"] for r in got], [r["grad_norm"] for r in want], rtol=1e-5)


def test_pipelined_expert_parallel_bf16_and_a_resume_onto_expert_parallel(family_runs_of, tmp_path):
    """P2 x DP2 x EP2 in bf16 (DeepSpeed's bf16 optimizer: expert slices partitioned over their expert-data-parallel
    group) trains as P = 2 in bf16, within bf16's rounding; the P = 2 reference's step-4 checkpoint (every expert on
    each rank) continued on DP2 x EP2 with ZeRO-1 gives its steps 5-6."""
    import json

    import numpy as np
    from helpers import train_losses
    from test_elastic import check_resume_on_another_layout
    from test_parity import _records, _weights, assert_weights_close
    runs = family_runs_of("qwen3_5_moe")
    plan = tmp_path / "cut.json"
    plan.write_text(json.dumps({"stages": CUTS["qwen3_5_moe"]}))
    cut = ["parallel.pipeline_stages=2", f"parallel.plan={plan}", "train.precision=bf16"]
    two, _ = runs.get("bf16_p2", 2, cut, flags=["--stop-at", "3"])
    ep, _ = runs.get("bf16_p2dp2_ep2", 4, cut + EP, flags=["--stop-at", "3"])
    np.testing.assert_allclose(train_losses(ep), train_losses(two), rtol=1e-3)
    np.testing.assert_allclose([r["grad_norm"] for r in _records(ep)], [r["grad_norm"] for r in _records(two)],
                               rtol=1e-2)  # (the bf16 optimizer's partitions over the world: each expert once)
    assert_weights_close(_weights(ep, 3), _weights(two, 3), rtol=1e-2, atol=4e-3)
    check_resume_on_another_layout(runs, tmp_path, "p2_to_ep2_z1", 2, "deepspeed",
                                   ["parallel.pipeline_stages=1", "parallel.zero_stage=1"] + EP)


def test_expert_parallel_clips_as_one_process_and_trains_lora(family_runs_of):
    """Clipping that fires (the llm group to 0.5, all to 1.0): DP2 x EP2 takes the one-process run's norms (the llm
    group's counts each rank's experts once), coefficients, losses and weights; LoRA (the routed experts frozen,
    sliced all the same) on DP2 x EP2 with ZeRO-1 trains the one-process LoRA run's losses and adapters."""
    import numpy as np
    from helpers import train_losses
    from test_lora import LORA_SETS, STEPS
    from test_parity import _records, _weights, assert_weights_close

    import mmpipe
    from mmpipe.families.lora import adapter_state
    runs = family_runs_of("qwen3_5_moe")
    clip = ["optim.groups.llm.max_grad_norm=0.5", "optim.max_grad_norm=1.0"]
    one, _ = runs.get("clip_p1", 1, ["parallel.pipeline_stages=1"] + clip, "python", flags=["--stop-at", "3"])
    ep, _ = runs.get("clip_dp2_ep2", 2, ["parallel.pipeline_stages=1"] + clip + EP, flags=["--stop-at", "3"])
    a, b = _records(one), _records(ep)
    assert all(r["clip_coef.llm"] < 1.0 for r in a)  # the clipping fired
    for key in ("loss", "grad_norm", "grad_norm.llm", "clip_coef.llm", "clip_coef"):
        np.testing.assert_allclose([r[key] for r in b], [r[key] for r in a], rtol=1e-5, err_msg=key)
    assert_weights_close(_weights(ep, 3), _weights(one, 3), rtol=1e-4, atol=1e-6)
    ref, _ = runs.get("lora_p1", 1, LORA_SETS + ["parallel.pipeline_stages=1"], "python", flags=["--stop-at", str(STEPS)])
    lora, _ = runs.get("lora_dp2_ep2_z1", 2, LORA_SETS + ["parallel.pipeline_stages=1", "parallel.zero_stage=1"] + EP,
                       flags=["--stop-at", str(STEPS)])
    np.testing.assert_allclose(train_losses(lora), train_losses(ref), rtol=1e-5)
    got, want = adapter_state(mmpipe.load_weights(lora, STEPS)), adapter_state(mmpipe.load_weights(ref, STEPS))
    assert got.keys() == want.keys() and got
    for k in got:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")


def test_lora_on_the_routed_experts_equals_a_peft_loop_and_exports_as_peft(family_runs_of, tmp_path):
    """``optim.target_parameters`` (peft's parameter LoRA on the fused experts, as ms-swift's --target_parameters)
    beside all-linear: the same losses and adapters as ``get_peft_model`` with ``target_parameters`` on
    ``Qwen3_5MoeForConditionalGeneration``; the export is a peft adapter directory whose merged experts are mmpipe's;
    on DP2 x EP2 with ZeRO-1 (each rank its experts' base slices and rank-r factors) the same losses and adapters."""
    import numpy as np
    from helpers import train_losses
    from peft import PeftModel
    from test_lora import LORA_SETS, STEPS, peft_reference
    from transformers import AutoModelForImageTextToText

    import mmpipe
    from mmpipe.families.lora import adapter_state
    from mmpipe.train.export import export
    runs = family_runs_of("qwen3_5_moe")
    sets = LORA_SETS + ["parallel.pipeline_stages=1", "optim.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"]
    out, _ = runs.get("lora_experts_p1", 1, sets, "python", flags=["--stop-at", str(STEPS)])
    ref_losses, at_stop, init, _ = peft_reference(out, runs.data, steps=STEPS)
    np.testing.assert_allclose(train_losses(out), ref_losses, rtol=1e-5, atol=1e-6)
    got = adapter_state(mmpipe.load_weights(out, STEPS))
    experts = [k for k in got if ".mlp.experts." in k]
    assert len(experts) == 4 * 4  # four MoE blocks, two parameters, lora_A and lora_B
    for k in got:
        torch.testing.assert_close(got[k], at_stop[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
    assert any(not torch.equal(got[k], init[k]) for k in experts if ".lora_B." in k)
    path, _, _ = export(out, str(tmp_path / "peft"))
    peft_model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(path + "/base"), path)
    hf = peft_model.merge_and_unload().state_dict()
    mine = mmpipe.build_model(mmpipe.load_config(out + "/config.yaml"))
    mine.load_state_dict(mmpipe.load_weights(out, STEPS), strict=False)
    from mmpipe.families.lora import merged
    plain = merged(mine.state_dict(), mine.family.lora)
    name = "llm.blocks.2.mlp.experts.gate_up_proj"
    torch.testing.assert_close(hf["model.language_model.layers.2.mlp.experts.gate_up_proj"], plain[name],
                               rtol=1e-5, atol=1e-6)
    ep, _ = runs.get("lora_experts_dp2_ep2_z1", 2, sets + ["parallel.zero_stage=1"] + EP, flags=["--stop-at", str(STEPS)])
    np.testing.assert_allclose(train_losses(ep), train_losses(out), rtol=1e-5)
    split = adapter_state(mmpipe.load_weights(ep, STEPS))
    assert split.keys() == got.keys()
    for k in got:
        torch.testing.assert_close(split[k], got[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
