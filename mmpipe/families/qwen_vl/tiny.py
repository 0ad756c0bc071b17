"""A tiny Qwen2.5-VL written offline, laid out as ``save_pretrained`` writes Qwen/Qwen2.5-VL-*-Instruct
(model, Qwen2 tokenizer with Qwen2-VL's special tokens and chat template, image and video processors),
with random weights: a stand-in for a downloaded checkpoint in tests and parity checks."""
from __future__ import annotations

import random
from typing import Optional

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]  # in Qwen2-VL's id order

# Qwen2-VL-7B-Instruct's chat_template.json
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def default_texts(n: int = 400, seed: int = 0) -> list:
    """English-ish sentences in the words of mmpipe's synthetic data (colours, shapes, places,
    questions), so the BPE merges cover what tests feed it."""
    from mmpipe.data import synth
    rng = random.Random(seed)
    out = ["You are a helpful assistant.", "system user assistant"] + [f"{q} {a}" for q, a in synth.TEXT_QA]
    for _ in range(n):
        color, shape, number = rng.choice(list(synth.COLORS)), rng.choice(synth.SHAPES), rng.choice(synth.NUMBERS)
        where = f"at the {rng.choice(list(synth.ROWS))} {rng.choice(list(synth.COLS))}"
        out.append(rng.choice([f"what colour are the shapes? {color}", f"what kind of shape is shown? {shape}",
                               f"how many shapes are there? {number}", f"where is the shape? {where}",
                               f"a {rng.choice(list(synth.SIZES))} {color} {shape} {where}.",
                               f"Is there a {color} {shape}? Yes, {number} of them, {where}."]))
    return out


def _tokenizer(texts, vocab_size: int):
    """Byte-level BPE over ``texts`` with Qwen2's normalizer and pre-tokenizer, the special tokens
    appended after it (as Qwen2's are), wrapped as transformers' Qwen2 tokenizer (in transformers 5 the
    tokenizers-backed class; ``Qwen2TokenizerFast`` is an alias), which keeps the trained backend."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = Qwen2Tokenizer(tokenizer_object=tok, unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                          extra_special_tokens=SPECIAL_TOKENS[1:], model_max_length=32768)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _randomize(model) -> None:
    """Weights away from transformers' init (norms at 1, biases at 0), so a parity check sees every
    parameter: matrices ~ N(0, 0.02), norm weights 1 + N(0, 0.1), biases ~ N(0, 0.02)."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn_like(p)
            p.copy_(1 + 0.1 * noise if p.ndim == 1 and not name.endswith("bias") else 0.02 * noise)


def _mrope_section(head_dim: int) -> list:
    """Qwen2.5-VL's split of the rotary half of a head over (time, height, width): 1/4, 3/8, 3/8
    ([16, 24, 24] at head_dim 128; [1, 1, 2] at 8)."""
    half = head_dim // 2
    t = half // 4
    return [t, (half - t) // 2, half - t - (half - t) // 2]


def write_tiny_qwen2_5_vl(out_dir: str, seed: int = 0, texts=None, vocab_size: int = 400,
                          min_pixels: int = 28 * 28 * 4, max_pixels: int = 28 * 28 * 64,
                          vision: Optional[dict] = None, text: Optional[dict] = None) -> str:
    """Write a random tiny ``Qwen2_5_VLForConditionalGeneration`` with its processor to ``out_dir``
    (a 4-block ViT with windows of 2x2 merged tokens and full attention at blocks 1 and 3, a 3-block
    decoder); ``vision`` / ``text`` override config fields. ``seed`` sets the weights only: every seed
    gets the same tokenizer (trained on ``texts``, default ``default_texts()``). Returns ``out_dir``."""
    import torch
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                              Qwen2VLImageProcessor, Qwen2VLVideoProcessor)
    tok = _tokenizer(texts or default_texts(), vocab_size)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vis = {"depth": 4, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "patch_size": 14,
           "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 56, "fullatt_block_indexes": [1, 3],
           "in_channels": 3, **(vision or {})}
    txt = {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 64, "max_position_embeddings": 512, "vocab_size": len(tok),
           "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
           "pad_token_id": ids["<|endoftext|>"], **(text or {})}
    head_dim = txt["hidden_size"] // txt["num_attention_heads"]
    txt.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0,
                                       "mrope_section": _mrope_section(head_dim)})
    vis.setdefault("out_hidden_size", txt["hidden_size"])
    config = Qwen2_5_VLConfig(vision_config=vis, text_config=txt, tie_word_embeddings=False,
                              image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                              vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    _randomize(model)
    model.save_pretrained(out_dir)
    geometry = {"patch_size": vis["patch_size"], "temporal_patch_size": vis["temporal_patch_size"],
                "merge_size": vis["spatial_merge_size"],
                "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels}}
    processor = Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(**geometry),
                                    video_processor=Qwen2VLVideoProcessor(**geometry),
                                    tokenizer=tok, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out_dir)
    return out_dir


def write_tiny_qwen3_5(out_dir: str, seed: int = 0, texts=None, vocab_size: int = 400,
                       min_pixels: int = 32 * 32 * 4, max_pixels: int = 32 * 32 * 36,
                       vision: Optional[dict] = None, text: Optional[dict] = None) -> str:
    """Write a random tiny ``Qwen3_5ForConditionalGeneration`` with its processor to ``out_dir``: a 2-block ViT
    (patch 16, a 4 x 4 learned position grid), a 4-block hybrid decoder (linear, linear, linear, full: the
    3:1 pattern) with GatedDeltaNet heads 2 (key) / 4 (value), partial rotary over interleaved sections;
    the tokenizer and chat template of ``write_tiny_qwen2_5_vl`` (byte-level BPE, Qwen's special tokens,
    ChatML); ``Qwen3VLProcessor`` with Qwen2-VL's image processor at patch 16 (mean and std 0.5) and
    Qwen3-VL's video processor. Returns ``out_dir``."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    tok = _tokenizer(texts or default_texts(), vocab_size)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vis = {"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "patch_size": 16,
           "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 16, "in_channels": 3,
           **(vision or {})}
    txt = {"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 32, "intermediate_size": 64, "max_position_embeddings": 512, "vocab_size": len(tok),
           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
           "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
           "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
           "pad_token_id": ids["<|endoftext|>"], **(text or {})}
    rotary = int(txt["head_dim"] * 0.25)
    txt.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                       "mrope_section": [rotary // 2 - 2 * (rotary // 8), rotary // 8, rotary // 8],
                                       "mrope_interleaved": True})
    vis.setdefault("out_hidden_size", txt["hidden_size"])
    config = Qwen3_5Config(vision_config=vis, text_config=txt, tie_word_embeddings=False,
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    return _save_qwen3(Qwen3_5ForConditionalGeneration, config, vis, tok, seed, min_pixels, max_pixels, out_dir)


def write_tiny_qwen3_vl(out_dir: str, seed: int = 0, texts=None, vocab_size: int = 400,
                        min_pixels: int = 32 * 32 * 4, max_pixels: int = 32 * 32 * 36,
                        vision: Optional[dict] = None, text: Optional[dict] = None) -> str:
    """Write a random tiny ``Qwen3VLForConditionalGeneration`` with its processor to ``out_dir``: a 3-block ViT
    (patch 16, a 4 x 4 learned position grid) with DeepStack after blocks 0 and 1 (added after decoder layers 0
    and 1), a 4-block Qwen3 decoder (q/k norm, interleaved multimodal rotary positions); the tokenizer, chat
    template and processor of ``write_tiny_qwen3_5``. Returns ``out_dir``."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    tok = _tokenizer(texts or default_texts(), vocab_size)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vis = {"depth": 3, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "patch_size": 16,
           "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 16, "in_channels": 3,
           "deepstack_visual_indexes": [0, 1], **(vision or {})}
    txt = {"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 512, "vocab_size": len(tok),
           "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
           "pad_token_id": ids["<|endoftext|>"], **(text or {})}
    half = txt["head_dim"] // 2
    txt.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True,
                                       "mrope_section": [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]})
    vis.setdefault("out_hidden_size", txt["hidden_size"])
    config = Qwen3VLConfig(vision_config=vis, text_config=txt, tie_word_embeddings=False,
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    return _save_qwen3(Qwen3VLForConditionalGeneration, config, vis, tok, seed, min_pixels, max_pixels, out_dir)


def _save_qwen3(model_cls, config, vis: dict, tok, seed: int, min_pixels: int, max_pixels: int, out_dir: str) -> str:
    """A Qwen3 family's random model (``seed``) and its ``Qwen3VLProcessor`` (Qwen2-VL's image processor at the
    ViT's geometry, mean and std 0.5; Qwen3-VL's video processor; ChatML) saved to ``out_dir``."""
    import torch
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor
    torch.manual_seed(seed)
    model = model_cls(config)
    _randomize(model)
    model.save_pretrained(out_dir)
    geometry = {"patch_size": vis["patch_size"], "temporal_patch_size": vis["temporal_patch_size"],
                "merge_size": vis["spatial_merge_size"]}
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**geometry, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                              size={"shortest_edge": min_pixels, "longest_edge": max_pixels}),
        video_processor=Qwen3VLVideoProcessor(**geometry), tokenizer=tok, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out_dir)
    return out_dir


TINY_EXPERTS = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "router_aux_loss_coef": 0.01}


def write_tiny_qwen3_5_moe(out_dir: str, seed: int = 0, texts=None, vocab_size: int = 400,
                           min_pixels: int = 32 * 32 * 4, max_pixels: int = 32 * 32 * 36,
                           vision: Optional[dict] = None, text: Optional[dict] = None) -> str:
    """Write a random tiny ``Qwen3_5MoeForConditionalGeneration`` with its processor to ``out_dir``: the ViT and
    hybrid decoder of ``write_tiny_qwen3_5`` with a sparse MoE block in every layer (8 experts of width 16, top-2,
    a shared expert of width 16 behind its gate; the aux loss weighted 0.01 so that it shows in a tiny run);
    tokenizer, chat template and processor as ``write_tiny_qwen3_5``. Returns ``out_dir``."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    tok = _tokenizer(texts or default_texts(), vocab_size)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vis = {"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "patch_size": 16,
           "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 16, "in_channels": 3,
           **(vision or {})}
    txt = {"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 32, "max_position_embeddings": 512, "vocab_size": len(tok),
           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
           "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "shared_expert_intermediate_size": 16,
           **TINY_EXPERTS, "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
           "pad_token_id": ids["<|endoftext|>"], **(text or {})}
    rotary = int(txt["head_dim"] * 0.25)
    txt.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                       "mrope_section": [rotary // 2 - 2 * (rotary // 8), rotary // 8, rotary // 8],
                                       "mrope_interleaved": True})
    vis.setdefault("out_hidden_size", txt["hidden_size"])
    config = Qwen3_5MoeConfig(vision_config=vis, text_config=txt, tie_word_embeddings=False,
                              image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                              vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    return _save_qwen3(Qwen3_5MoeForConditionalGeneration, config, vis, tok, seed, min_pixels, max_pixels, out_dir)


def write_tiny_qwen3_vl_moe(out_dir: str, seed: int = 0, texts=None, vocab_size: int = 400,
                            min_pixels: int = 32 * 32 * 4, max_pixels: int = 32 * 32 * 36,
                            vision: Optional[dict] = None, text: Optional[dict] = None) -> str:
    """Write a random tiny ``Qwen3VLMoeForConditionalGeneration`` with its processor to ``out_dir``: the ViT with
    DeepStack and the decoder of ``write_tiny_qwen3_vl`` whose blocks 0, 1 and 3 are sparse (8 experts of width 16,
    top-2; block 2 dense: ``mlp_only_layers``); tokenizer, chat template and processor as ``write_tiny_qwen3_5``.
    Returns ``out_dir``."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
    tok = _tokenizer(texts or default_texts(), vocab_size)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vis = {"depth": 3, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "patch_size": 16,
           "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 16, "in_channels": 3,
           "deepstack_visual_indexes": [0, 1], **(vision or {})}
    txt = {"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 512, "vocab_size": len(tok),
           "mlp_only_layers": [2], **TINY_EXPERTS, "bos_token_id": ids["<|endoftext|>"],
           "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"], **(text or {})}
    half = txt["head_dim"] // 2
    txt.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True,
                                       "mrope_section": [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]})
    vis.setdefault("out_hidden_size", txt["hidden_size"])
    config = Qwen3VLMoeConfig(vision_config=vis, text_config=txt, tie_word_embeddings=False,
                              image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                              vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    return _save_qwen3(Qwen3VLMoeForConditionalGeneration, config, vis, tok, seed, min_pixels, max_pixels, out_dir)
