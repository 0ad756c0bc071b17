"""``ChatFamily``: what every chat family shares (the LLaVA-style VLM, and any later one such as a
native-resolution VLM), so none imports another family's internals.

A chat family reads chat records (LLaVA JSON, ms-swift JSONL), encodes them with the tokenizer's
chat template or the plain one (``<image>`` expanding to each image's own token count:
``image_tokens``), packs them (``data.packing``), trains the token-mean next-token loss over the
global batch and is evaluated on validation loss and token accuracy; ``mmpipe generate`` answers
with it through its transformers model (``hf.hf_model``). A subclass gives its layers, its
``image_token_id``, its image input (``pixels``: how an image file becomes tower input and how a
micro-batch's images are batched) and its token count per image.
"""
from __future__ import annotations

from typing import ClassVar, Optional

import torch

from mmpipe.errors import ConfigError
from mmpipe.families.base import Family
from mmpipe.families.chat import loss as lm
from mmpipe.families.chat.check import run_chat_check
from mmpipe.families.chat.dataset import ChatCollate, ChatDataset, PackedChatDataset
from mmpipe.families.chat.encoder import add_chat_tokens, ChatEncoder
from mmpipe.families.chat.records import chat_texts, IMAGE, read_chat, SPECIAL_TOKENS
from mmpipe.families.towers.common import ATTENTION_CHOICES


class ChatFamily(Family):
    inputs: ClassVar[tuple] = ("pixel_values", "input_ids", "attention_mask")
    labels: ClassVar[tuple] = ("labels",)
    special_tokens: ClassVar[tuple] = SPECIAL_TOKENS  # the plain template's (a template adds only <image>)
    dynamic_shapes: ClassVar[bool] = True  # images per micro-batch vary (0 for text-only micro-batches)
    token_mean: ClassVar[bool] = True
    packs: ClassVar[bool] = True  # data.packing: several chat samples per sequence (PackedChatDataset)
    generates: ClassVar[bool] = True  # mmpipe generate / --eval answer with it
    data_format: ClassVar[str] = "chat"
    image_token_id: Optional[int] = None
    # what follows the markers ``mmpipe generate`` puts before a prompt given media but no marker: LLaVA's
    # ``<image>\n`` + question (its scripts' DEFAULT_IMAGE_TOKEN + "\n"); a family whose chat template puts the
    # media straight before the text (Qwen's, as transformers' processor renders image items) gives ""
    marker_join: ClassVar[str] = "\n"

    @classmethod
    def validate(cls, model_cfg, where: str) -> None:
        attention = getattr(model_cfg, "attention", "sdpa")
        if attention not in ATTENTION_CHOICES:
            raise ConfigError(f"{where}: model.attention={attention!r} is not one of {', '.join(ATTENTION_CHOICES)} "
                              "(sdpa: packed rows through a block-diagonal mask; varlen: by their span boundaries)")

    # ---- data ----------------------------------------------------------------------------------
    @classmethod
    def read_records(cls, path, data_cfg, key):
        return read_chat(path, data_cfg.image_folder, key)

    @classmethod
    def record_texts(cls, records):
        return chat_texts(records)

    @classmethod
    def prepare_tokenizer(cls, tokenizer):
        return add_chat_tokens(tokenizer)

    @classmethod
    def check_data(cls, path, cfg, as_json=False, workers=1):
        return run_chat_check(path, cfg, as_json)

    @classmethod
    def check_source(cls, kind):
        if kind != "manifest":
            raise ConfigError(f"model.type={cls.name} reads chat data (data.train: LLaVA .json or ms-swift .jsonl), not "
                              f"{'data.cache' if kind == 'cache' else 'tar shards'}; unset it and give the chat file")

    @classmethod
    def resolve_image_token(cls, model_cfg, tokenizer) -> None:
        """``model.image_token_id`` from the tokenizer's ``<image>`` (in place, on a thawed copy)."""
        image_id = tokenizer.convert_tokens_to_ids(IMAGE)
        if model_cfg.image_token_id is None:
            model_cfg.image_token_id = image_id
        elif model_cfg.image_token_id != image_id:
            raise ConfigError(f"model.image_token_id={model_cfg.image_token_id} but the tokenizer's {IMAGE} is "
                              f"{image_id}: unset model.image_token_id, or use the tokenizer the model was trained with")

    def image_tokens(self, image, data_cfg=None) -> int:
        """How many image tokens the image (a path) becomes in the token sequence (``data_cfg``: the
        run's data section, whose image bounds a native-resolution family resizes within)."""
        raise NotImplementedError

    def image_wrap(self, tokenizer) -> tuple:
        """(token ids before, token ids after) each image's run of image tokens (Qwen-VL:
        ``<|vision_start|>`` and ``<|vision_end|>``); none by default."""
        return (), ()

    def video_input(self, tokenizer, data_cfg=None):
        """The family's video input (``video_ids(source)``: a video's token ids from its header; ``load(source)``:
        its visual items; ``pad_id``), or None: a sample with a video is dropped, named."""
        return None

    def encoder(self, tokenizer, max_length: int, data_cfg=None):
        from functools import partial

        return ChatEncoder(tokenizer, self.image_token_id, partial(self.image_tokens, data_cfg=data_cfg), max_length,
                           self.image_wrap(tokenizer), video=self.video_input(tokenizer, data_cfg),
                           no_video=f"has a video, but model.type={self.name} has no video input (qwen2_5_vl, qwen3_vl "
                                    "and qwen3_5 have); the sample is skipped")

    def cost_driver(self, segment: str) -> str:
        """The tower and what maps its tokens into the decoder (LLaVA's projector, Qwen's merger) compute on
        image tokens; the decoder on token slots."""
        return "vision" if segment in ("vision", "projector", "merger") else "tokens"

    def batch_units(self, batch: dict) -> tuple:
        """(image tokens, token slots): the vision tower's and projector's work scales with the images'
        tokens (a native-resolution image its own count; a text-only row none)."""
        ids = batch["input_ids"]
        return float((ids == self.image_token_id).sum()), float(ids.numel())

    def dataset(self, records, tokenizer, data_cfg, seed=None):
        chat = ChatDataset(records, self.encoder(tokenizer, data_cfg.max_length, data_cfg),
                           self.pixels(self.cfg, data_cfg, seed))
        return PackedChatDataset(chat, data_cfg.max_length) if getattr(data_cfg, "packing", False) else chat

    def collate(self, tokenizer, data_cfg):
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        return ChatCollate(pad, self.pixels(self.cfg, data_cfg), data_cfg.pad_multiple,
                           data_cfg.max_length if data_cfg.padding == "max_length" else None)

    # ---- loss and evaluation ---------------------------------------------------------------------
    def loss(self, outputs, labels, normaliser=None) -> torch.Tensor:
        return lm.causal_lm_loss(outputs, labels, normaliser)

    def eval_stats(self, logits, labels) -> torch.Tensor:
        return lm.token_stats(logits, labels)

    def loss_units(self, labels) -> int:
        return lm.label_tokens(labels)

    def evaluate(self, outputs, labels, samples) -> dict:
        """Validation loss (mean over label tokens) and next-token accuracy (micro-batches are not
        padded: ``dynamic_shapes``)."""
        loss, n, right = torch.stack([o.double().cpu() for o in outputs]).sum(0).tolist()
        return {"val_loss": loss / max(n, 1), "token_accuracy": right / max(n, 1), "val_tokens": int(n)}

    def eval_line(self, record) -> str:
        return (f"val loss {record['val_loss']:.4f}, token accuracy {record['token_accuracy']:.3f} "
                f"({record['val_tokens']} tokens)")

    # ---- generation --------------------------------------------------------------------------------
    def generation_inputs(self, images: list, data_cfg=None) -> dict:
        """The transformers model's image inputs for ``images`` (paths) at generation, prepared as
        training prepared them."""
        raise NotImplementedError

    def generation_kwargs(self, input_ids, image_inputs: dict) -> dict:
        """What the transformers model's ``generate`` takes besides the ids and mask: the image
        inputs, and whatever the family derives from the prompt (Qwen-VL's ``mm_token_type_ids``)."""
        return image_inputs
