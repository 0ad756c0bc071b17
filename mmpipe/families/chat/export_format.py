"""What an exported VLM carries besides its weights: mmpipe's plain chat template as a jinja
``chat_template``, a tokenizer that adds no special tokens (as training tokenized), and the
generation default."""
from __future__ import annotations

GENERATE_MAX_NEW_TOKENS = 32  # mmpipe generate's --max-new-tokens default, and the exported generation config's



def plain_template(image: str = "<image>") -> str:
    """mmpipe's plain chat template as a jinja chat_template (exported with the tokenizer): content as a
    string, or transformers' list form, where an image item renders as ``image`` + newline (the
    processor's placeholder: LLaVA's ``<image>``, Qwen-VL's ``<|vision_start|><|image_pad|><|vision_end|>``),
    as training data writes ``<image>\\n``, and a text item as its text."""
    return ("{% for m in messages %}<|{{ m['role'] }}|>\n"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
            "{% if c['type'] == 'image' %}" + image + "\n{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
            "{% endfor %}{% endif %}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


PLAIN_TEMPLATE = plain_template()  # LLaVA's


def no_added_special_tokens(tokenizer) -> None:
    """Make the exported tokenizer add nothing by default ([CLS]/[SEP] of mmpipe's WordPiece, a BOS):
    the run tokenized every piece with ``add_special_tokens=False``, and a processor call through
    transformers must give the same ids."""
    from tokenizers.processors import TemplateProcessing
    for attr in ("add_bos_token", "add_eos_token"):
        if getattr(tokenizer, attr, False):
            setattr(tokenizer, attr, False)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        backend.post_processor = TemplateProcessing(single="$A", pair="$A $B", special_tokens=[])


def set_generation_defaults(model, tokenizer, stop: list) -> None:
    """The exported generation config: transformers' ``generate`` stops where training's turns ended
    (``stop``: the end-of-turn ids, not the config class's default EOS), pads with the tokenizer's pad,
    and answers up to ``GENERATE_MAX_NEW_TOKENS`` (its own default, max_length=20 with the prompt,
    cuts an image prompt's answer to nothing)."""
    if stop:
        model.generation_config.eos_token_id = stop if len(stop) > 1 else stop[0]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.max_new_tokens = GENERATE_MAX_NEW_TOKENS
