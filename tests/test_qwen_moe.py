"""The Qwen MoE families (``model.type: qwen3_5_moe``, ``qwen3_vl_moe``): transformers' arithmetic with its router's
load-balancing loss (a directory written offline, fed by its own processor), packed = unpacked, the expert products
priced by active parameters; the layouts (P = 1, P = 2 cut between MoE blocks) train alike, export answers as
``mmpipe generate``."""
from __future__ import annotations

import pytest
import torch
from PIL import Image
from qwen_fixtures import loaded_model, resolved_family, write_chat, write_images

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
