"""The LLaVA-style VLM family against transformers: a tiny ``LlavaForConditionalGeneration`` (CLIP
vision + Llama; CLIP vision + Qwen2 with tied embeddings) saved with ``save_pretrained`` and loaded
through ``model.pretrained`` gives transformers' loss; a batch without images gives the bare
causal LM's loss on the same weights."""
from __future__ import annotations

import pytest
import torch
from helpers import TINY_VLM

import mmpipe

IMAGE_TOKEN = 99
N_PATCHES = 16  # (32 / 8)^2, CLS dropped


@pytest.fixture(scope="module", params=["llama", "qwen2_tied"])
def llava_dir(request, tmp_path_factory):
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        Qwen2Config,
    )
    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=32, patch_size=8)
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)
    tied = request.param == "qwen2_tied"
    text = Qwen2Config(tie_word_embeddings=True, **common) if tied else LlamaConfig(**common)
    model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text,
                                                      image_token_id=IMAGE_TOKEN, tie_word_embeddings=tied)).eval()
    d = tmp_path_factory.mktemp(request.param) / "llava"
    model.save_pretrained(str(d))
    return {"dir": str(d), "model": model, "tied": tied}


def _batch(with_images=True):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 90, (2, 28), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 24:] = 0  # right padding
    labels = ids.clone()
    labels[:, :20] = -100  # prompt and image positions are not learned
    labels[mask == 0] = -100
    pix = None
    if with_images:
        ids[:, 2:2 + N_PATCHES] = IMAGE_TOKEN
        pix = torch.randn(2, 3, 32, 32, generator=g)
    return pix, ids, mask, labels


def test_vlm_loss_matches_transformers_llava(llava_dir):
    cfg = mmpipe.load_config(None, ["model.type=vlm", f"model.pretrained={llava_dir['dir']}"])
    ours = mmpipe.build_model(cfg).eval()
    ref = llava_dir["model"]
    pix, ids, mask, labels = _batch()
    with torch.no_grad():
        want = ref(input_ids=ids, pixel_values=pix, attention_mask=mask, labels=labels).loss
        got = ours(pix, ids, mask, labels)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert ours.family.segment_graph() == {"vision": ["projector"], "projector": ["llm"], "llm": []}
    # vision_feature_layer -2: the tower's last block is not used, so the model holds 2 of its 3
    assert [n for n in ours.family.layer_names() if n.startswith("vision.blocks")] == ["vision.blocks.0",
                                                                                        "vision.blocks.1"]
    if llava_dir["tied"]:  # one parameter, as in transformers
        assert ours.llm.head.lm_head.weight is ours.llm.embed.embed_tokens.weight


def test_vlm_batch_without_images_is_the_bare_causal_lm(llava_dir):
    cfg = mmpipe.load_config(None, ["model.type=vlm", f"model.pretrained={llava_dir['dir']}"])
    ours = mmpipe.build_model(cfg).eval()
    ref = llava_dir["model"]
    _, ids, mask, labels = _batch(with_images=False)
    from transformers import AutoModelForCausalLM
    lm = AutoModelForCausalLM.from_config(ref.config.text_config).eval()  # LlamaForCausalLM / Qwen2ForCausalLM
    lm.model.load_state_dict(ref.model.language_model.state_dict())
    lm.lm_head.load_state_dict(ref.lm_head.state_dict())
    with torch.no_grad():
        want = lm(input_ids=ids, attention_mask=mask, labels=labels).loss
        got = ours(None, ids, mask, labels)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_vlm_model_config_mistakes_are_one_line_at_load():
    with pytest.raises(mmpipe.ConfigError, match="model.llm.arch='gpt' is not one of llama, qwen2"):
        mmpipe.load_config(None, ["model.type=vlm", "model.llm.arch=gpt"])
    with pytest.raises(mmpipe.ConfigError, match="not a registered model family"):
        mmpipe.load_config(None, ["model.type=vml"])


def test_projector_only_training_keeps_the_frozen_llm_on_the_gradient_path(llava_dir):
    """LLaVA stage 1 (vision and LM frozen, projector trained): only the vision tower may run
    without autograd; the LM blocks after the merge carry the projector's gradient."""
    from mmpipe.config.groups import apply_freeze, frozen_layout, resolve_groups
    cfg = mmpipe.load_config(None, ["model.type=vlm", f"model.pretrained={llava_dir['dir']}",
                                    "optim.freeze_vision=true", "optim.freeze_text=true"])
    model = mmpipe.build_model(cfg)
    groups = resolve_groups(cfg.optim, type(model.family))
    _, frozen, fo = frozen_layout(model.family, groups)
    assert fo == {"vision.embed", "vision.blocks.0", "vision.blocks.1"}
    model.executor.forward_only = frozenset(fo)
    apply_freeze(model.named_parameters(), groups)
    pix, ids, mask, labels = _batch()
    model(pix, ids, mask, labels).backward()
    assert model.projector.linear_1.weight.grad.abs().sum() > 0
    assert all(p.grad is None for n, p in model.named_parameters() if not n.startswith("projector."))


@pytest.mark.parametrize("sets,expect", [
    (["data.cache=/tmp"], "model.type=vlm reads chat data"),
    (["data.train=/nonexistent/chat.jsonl"], "data.train: file not found: /nonexistent/chat.jsonl"),
    (["model.pretrained=/nonexistent"], "model.pretrained: /nonexistent is neither a local save_pretrained directory "
                                        "(there is none at /nonexistent) nor a hub id"),
    (["model.llm.arch=mistral"], "model.llm.arch='mistral' is not one of llama, qwen2"),
    (["optim.vit_lr=1e-4", "optim.groups.vision.lr=2e-4"], "optim.vit_lr=0.0001 contradicts optim.groups.vision.lr"),
    # ms-swift's --train_type defaults to lora, mmpipe's to full: LoRA keys alone would train every weight
    (["optim.lora_rank=16", "optim.target_modules=[q_proj]"],
     "optim.lora_rank, optim.target_modules set but optim.train_type is full"),
    (["optim.vit_lr=1e-4", "optim.freeze_vit=true"], "optim.vit_lr=0.0001 is set but the vision group trains nothing"),
    (["optim.train_type=lora", "optim.aligner_lr=1e-4"], "the projector group trains nothing (LoRA's default"),
    (["optim.train_type=lora", "optim.lora_dropout=1.0"], "optim.lora_dropout=1.0 is out of range: it accepts 0 <= "
                                                          "value < 1"),
])
def test_vlm_config_mistakes_are_one_line(tmp_path, capsys, sets, expect):
    from mmpipe.cli.main import main
    args = ["train", "--config", TINY_VLM, "--set", f"train.output_dir={tmp_path / 'o'}",
            "--set", f"data.train={tmp_path / 'chat.jsonl'}"]
    (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}, '
                                         '{"role": "assistant", "content": "hello"}]}\n')
    for s_ in sets:
        args += ["--set", s_]
    rc = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and expect in err[0], err


def test_lora_keys_under_a_chosen_full_train_type_are_said(tmp_path, capsys):
    from mmpipe.train.setup import check_lora_keys
    check_lora_keys(mmpipe.load_config(TINY_VLM, ["optim.train_type=full", "optim.lora_rank=16"]))
    assert "optim.train_type=full trains every weight; optim.lora_rank are not used" in capsys.readouterr().out
    check_lora_keys(mmpipe.load_config(TINY_VLM, ["optim.train_type=full"]))
    assert capsys.readouterr().out == ""


def test_ms_swift_flags_set_groups():
    """optim.freeze_vit / freeze_aligner / freeze_llm freeze the vision / projector / llm groups;
    optim.vit_lr and aligner_lr set their lr (ms-swift's names)."""
    from mmpipe.config.groups import resolve_groups
    from mmpipe.families.vlm import VlmFamily
    cfg = mmpipe.load_config(TINY_VLM, ["optim.freeze_llm=true", "optim.vit_lr=1e-5", "optim.aligner_lr=3e-4"])
    g = {x.name: x for x in resolve_groups(cfg.optim, VlmFamily)}
    assert g["llm"].frozen and not g["vision"].frozen and not g["projector"].frozen
    assert g["vision"].lr == 1e-5 and g["projector"].lr == 3e-4 and g["llm"].lr == cfg.optim.lr
    cfg = mmpipe.load_config(TINY_VLM, ["optim.freeze_vit=true", "optim.freeze_aligner=true"])
    g = {x.name: x for x in resolve_groups(cfg.optim, VlmFamily)}
    assert g["vision"].frozen and g["projector"].frozen and not g["llm"].frozen


def test_vision_and_llm_from_their_own_directories(tmp_path):
    """model.vision.pretrained (a CLIPVisionModel) + model.llm.pretrained (a LlamaForCausalLM): the
    tower holds the CLIP weights, a text-only batch gives the bare LM's loss, and a tokenizer that
    adds <image> beyond the LM's vocabulary gets a row of its own (the LM's rows kept)."""
    from transformers import (
        CLIPVisionConfig,
        CLIPVisionModel,
        LlamaConfig,
        LlamaForCausalLM,
    )
    torch.manual_seed(0)
    clip = CLIPVisionModel(CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                            num_attention_heads=4, image_size=32, patch_size=8))
    lm = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)).eval()
    clip.save_pretrained(str(tmp_path / "clip"))
    lm.save_pretrained(str(tmp_path / "lm"))
    cfg = mmpipe.load_config(None, ["model.type=vlm", f"model.vision.pretrained={tmp_path / 'clip'}",
                                    f"model.llm.pretrained={tmp_path / 'lm'}", "model.llm.vocab_size=101",
                                    "model.image_token_id=100"])
    ours = mmpipe.build_model(cfg).eval()
    assert torch.equal(ours.vision.embed.embeddings.patch_embedding.weight,
                       clip.embeddings.patch_embedding.weight)
    assert torch.equal(ours.get_parameter("vision.blocks.1.mlp.fc1.weight"),
                       clip.encoder.layers[1].mlp.fc1.weight)
    emb = ours.llm.embed.embed_tokens.weight
    assert emb.shape == (101, 32) and torch.equal(emb[:100], lm.model.embed_tokens.weight)
    _, ids, mask, _ = _batch(with_images=False)
    with torch.no_grad():  # over the LM's 100 tokens, the logits are the LM's own (at the real tokens:
        logits = ours.eval_outputs(None, ids, mask)  # a padding position's output is no one's, and mmpipe's
        keep = mask.bool()  # mask-free causal attention computes it differently)
        torch.testing.assert_close(logits[..., :100][keep], lm(input_ids=ids, attention_mask=mask).logits[keep],
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("sets,match", [
    (["model.vision.hidden_size=30"], "model.vision.hidden_size=30 is not divisible by model.vision.num_attention_heads=4"),
    (["model.vision.patch_size=64"], "model.vision.patch_size=64 is larger than model.vision.image_size=32"),
    (["model.llm.num_key_value_heads=3"], "model.llm.num_key_value_heads=3 does not divide model.llm.num_attention_heads=4"),
    (["model.llm.hidden_size=36"], "head size 9 .* is odd"),
    (["optim.freeze_vit=true", "optim.freeze_aligner=true", "optim.freeze_llm=true"], "every parameter group is frozen"),
], ids=["vision_heads", "patch", "kv_heads", "rotary", "all_frozen"])
def test_vlm_shape_mistakes_are_one_line_errors(sets, match):
    """Issue 29, item 15: each was a traceback from transformers' layers (one at step 1)."""
    from helpers import TINY_VLM

    from mmpipe.config.groups import resolve_groups
    from mmpipe.config.resolve import build_family
    from mmpipe.errors import ConfigError
    with pytest.raises(ConfigError, match=match):  # at load (the file named), or at the groups for freezing
        cfg = mmpipe.load_config(TINY_VLM, ["model.llm.vocab_size=200", "model.image_token_id=199"] + sets)
        family = build_family(cfg.model, 0)
        resolve_groups(cfg.optim, type(family))


def test_a_llava_directory_brings_its_feature_layer_and_strategy(tmp_path):
    """Issue 29, item 7: the directory's vision_feature_layer / select strategy are the model loaded
    (they were silently mmpipe's defaults); a configured value that disagrees is refused in one line.
    The loaded model gives transformers' own loss."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from mmpipe.errors import ConfigError
    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=32, patch_size=8)
    text = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)
    ref = LlavaForConditionalGeneration(LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN, vision_feature_layer=-1,
        vision_feature_select_strategy="full")).eval()
    d = str(tmp_path / "llava")
    ref.save_pretrained(d)
    ours = mmpipe.build_model(mmpipe.load_config(None, ["model.type=vlm", f"model.pretrained={d}"])).eval()
    assert (ours.family.cfg.vision_feature_layer, ours.family.cfg.vision_feature_select_strategy) == (-1, "full")
    assert len([n for n in ours.family.layer_names() if n.startswith("vision.blocks")]) == 3  # the last block used
    pix, ids, mask, labels = _batch()
    ids[:, 2:2 + N_PATCHES + 1] = IMAGE_TOKEN  # "full": the class token's feature too
    labels[:, :20] = -100
    with torch.no_grad():
        want = ref(input_ids=ids, pixel_values=pix, attention_mask=mask, labels=labels).loss
        got = ours(pix, ids, mask, labels)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    with pytest.raises(ConfigError, match="vision_feature_layer=-3 but model.pretrained .* was trained with -1"):
        mmpipe.build_model(mmpipe.load_config(None, ["model.type=vlm", f"model.pretrained={d}",
                                                     "model.vision_feature_layer=-3"]))


@pytest.fixture(scope="module")
def siglip_llava_dir(tmp_path_factory):
    """LLaVA with SigLIP's ViT as the OneVision / PaliGemma-era models ship it: the last layer's
    hidden states, every patch (strategy ``full``; SigLIP has no class token)."""
    from transformers import LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, SiglipVisionConfig
    torch.manual_seed(0)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                image_size=32, patch_size=8)
    text = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)
    model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN,
                                                      vision_feature_layer=-1,
                                                      vision_feature_select_strategy="full")).eval()
    d = tmp_path_factory.mktemp("siglip_llava") / "llava"
    model.save_pretrained(str(d))
    return {"dir": str(d), "model": model}


def test_a_siglip_tower_llava_gives_transformers_loss_on_a_mixed_batch(siglip_llava_dir, tmp_path):
    """One row with an image (16 patch tokens, no class token), one text-only: transformers' loss; the
    plain weights go back to a LlavaForConditionalGeneration that gives it too."""
    cfg = mmpipe.load_config(None, ["model.type=vlm", f"model.pretrained={siglip_llava_dir['dir']}"])
    ours = mmpipe.build_model(cfg).eval()
    assert ours.family.siglip_tower and ours.family.n_image_tokens() == 16
    assert [n for n in ours.family.layer_names() if n.startswith("vision.blocks")] == [f"vision.blocks.{i}"
                                                                                        for i in range(3)]
    ref = siglip_llava_dir["model"]
    _, ids, mask, labels = _batch(with_images=False)
    ids[0, 2:2 + N_PATCHES] = IMAGE_TOKEN
    pix = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(input_ids=ids, pixel_values=pix, attention_mask=mask, labels=labels).loss
        got = ours(pix, ids, mask, labels)
        again = ours.family.hf.hf_model(ours.state_dict())(input_ids=ids, pixel_values=pix, attention_mask=mask,
                                                           labels=labels).loss
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(again, want, atol=1e-5, rtol=0)
