"""Chat samples -> token ids and labels, by the tokenizer's chat template or mmpipe's plain one.

``<image>`` expands to the image's own number of image tokens: the family's ``image_tokens(path)``
(a fixed count for a square tower, ``(h/p)(w/p)`` for a native-resolution one; wrapped in the
family's ``image_wrap`` tokens, e.g. Qwen-VL's ``<|vision_start|>`` / ``<|vision_end|>``), so truncation,
packing lengths and length grouping use real counts. ``<video>`` expands to the family's video tokens
(``ChatFamily.video_input``: its frames' tokens and any timestamp text, from the file's header); a family
without one drops the sample, named. Labels: every assistant turn (its text and
the end-of-turn token) is learned; system text, prompts, role markers, image tokens and padding are
-100. A sample longer than ``max_length`` is cut after its last complete image; if an image itself
does not fit, the sample is dropped (and counted), never cut through its image tokens.

The chat template is the tokenizer's own (``tokenizer.chat_template``, e.g. a Qwen2 or Llama
tokenizer directory): each assistant turn is what rendering one more message adds after the
generation prompt, so label boundaries are exact. Without one, the plain template::

    <|system|>\\n{text}<|end|>\\n<|user|>\\n{text}<|end|>\\n<|assistant|>\\n{text}<|end|>\\n
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

from mmpipe.errors import DataError
from mmpipe.families.chat.records import IMAGE, SPECIAL_TOKENS, VIDEO, ChatSample

_MARKS = re.compile("(" + re.escape(IMAGE) + "|" + re.escape(VIDEO) + ")")


@dataclass
class Encoded:
    input_ids: list
    labels: list
    images: tuple = ()
    truncated: bool = False
    dropped: Optional[str] = None  # why the sample cannot be used at this length
    videos: tuple = ()
    media: tuple = ()  # "image" / "video" of each visual input, in token order (what the loader decodes, in order)


class ChatEncoder:
    """Token ids and labels of a chat sample: each piece is tokenized on its own (no special tokens
    added), so label boundaries are exact whatever the tokenizer merges."""

    def __init__(self, tokenizer, image_token_id: int, image_tokens: Callable, max_length: int, wrap: tuple = ((), ()),
                 video=None, no_video: str = "this model type has no video input"):
        """``image_tokens(image)``: the number of image tokens an image (a path) becomes, the family's
        (``ChatFamily.image_tokens``); ``wrap``: token ids around each image's run (``image_wrap``); ``video``: the
        family's video tokens (``video_ids(source)`` -> the token ids of a video, ``pad_id``), None: a sample with a
        video is dropped with ``no_video``."""
        self.tok, self.image_id, self.max_length = tokenizer, image_token_id, max_length
        self.image_tokens = image_tokens
        self.before, self.after = list(wrap[0]), list(wrap[1])
        self.video, self.no_video = video, no_video
        self.visual_ids = {image_token_id} | ({video.pad_id} if video is not None else set())

    def _ids(self, text: str, counts=None, videos=None, spans=None) -> list:
        """Token ids of ``text``; its ``<image>`` markers take the next counts of ``counts`` (an iterator of
        image-token counts, in marker order), its ``<video>`` markers the next of ``videos`` (token-id lists);
        ``spans`` gets (kind, start, end) of each expansion."""
        out = []
        for part in _MARKS.split(text):
            if part == IMAGE or part == VIDEO:
                add = (self.before + [self.image_id] * next(counts) + self.after) if part == IMAGE else next(videos)
                if spans is not None:
                    spans.append(("image" if part == IMAGE else "video", len(out), len(out) + len(add)))
                out += add
            elif part:
                out += self.tok(part, add_special_tokens=False)["input_ids"]
        return out

    def video_ids(self, videos) -> list:
        """The token ids of each video, in order (from its header; one that cannot be read raises ``DataError``)."""
        out = []
        for v in videos:
            try:
                out.append(list(self.video.video_ids(v)))
            except FileNotFoundError:
                raise DataError(f"{v}: no such file") from None
            except Exception as e:  # noqa: BLE001 - the container's or the processor's refusal: the sample's error
                raise DataError(f"{v}: cannot read the video ({type(e).__name__}: {_first_line(e)})") from None
        return out

    def counts(self, images) -> list:
        """Image-token count of each image, in order (a native-resolution family reads each file's
        header: one that cannot be read raises ``DataError`` naming it)."""
        out = []
        for im in images:
            try:
                out.append(int(self.image_tokens(im)))
            except FileNotFoundError:
                raise DataError(f"{im}: no such file") from None
            except (OSError, SyntaxError) as e:  # PIL's errors for a corrupt file
                raise DataError(f"{im}: cannot read the image's size ({type(e).__name__}: {_first_line(e)})") from None
            except ValueError as e:  # the processor refuses the size (e.g. an aspect ratio over its limit of 200)
                raise DataError(f"{im}: the image processor refuses its size: {_first_line(e)}") from None
        return out

    def pieces(self, messages) -> list:
        """[(text, learned)]: the tokenizer's chat template, else the plain one."""
        if getattr(self.tok, "chat_template", None):
            return self._template_pieces(messages)
        out = []
        for role, text in messages:
            learned = role == "assistant"
            out.append((f"<|{role}|>\n", False))
            out.append((text + "<|end|>", learned))
            out.append(("\n", False))
        return out

    def _render(self, messages, generation_prompt: bool = False) -> str:
        if not messages:
            return ""
        return self.tok.apply_chat_template([{"role": r, "content": t} for r, t in messages], tokenize=False,
                                            add_generation_prompt=generation_prompt)

    def _template_pieces(self, messages) -> list:
        out, done = [], ""
        for i, (role, _) in enumerate(messages):
            if role != "assistant":
                continue
            prompt, full = self._render(messages[:i], True), self._render(messages[:i + 1])
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise DataError("data.tokenizer: its chat template does not render a conversation prefix by prefix "
                                "(turn i's text changes when turn i+1 is added), so assistant turns cannot be "
                                "labelled; remove chat_template from its tokenizer_config.json to use mmpipe's "
                                "plain template")
            out += [(prompt[len(done):], False), (full[len(prompt):], True)]
            done = full
        tail = self._render(messages)[len(done):]
        return out + ([(tail, False)] if tail else [])

    def end_of_turn_ids(self) -> list:
        """The token(s) that end an assistant turn, as the labels learned them: the first token of what
        rendering an assistant message adds after its content (mmpipe's template: ``<|end|>``;
        ChatML: ``<|im_end|>``), and the tokenizer's EOS. Generation stops at any of them."""
        marker = "\u2063"  # a content no template alters
        if getattr(self.tok, "chat_template", None):
            full = self._render((("user", "q"), ("assistant", marker)))
            after = full[full.rindex(marker) + len(marker):]
        else:
            after = "<|end|>"
        ids = self.tok(after, add_special_tokens=False)["input_ids"][:1] if after.strip() else []
        eos = self.tok.eos_token_id
        return ids + ([eos] if eos is not None and eos not in ids else [])

    def prompt_ids(self, messages, images=(), videos=()) -> list:
        """Token ids of ``messages`` (with ``images`` / ``videos``, one per ``<image>`` / ``<video>`` marker in
        order) followed by the assistant's turn header (generation)."""
        counts = iter(self.counts(images))
        vids = iter(self.video_ids(videos) if videos else [])
        if getattr(self.tok, "chat_template", None):
            return self._ids(self._render(messages, True), counts, vids)
        return [t for text, _ in self.pieces(messages) for t in self._ids(text, counts, vids)] + \
            self._ids("<|assistant|>\n")

    def encode(self, sample: ChatSample) -> Encoded:
        ids, labels, spans = [], [], []
        if sample.videos and self.video is None:
            return Encoded([], [], (), False, self.no_video)
        try:
            counts = self.counts(sample.images)
            videos = self.video_ids(sample.videos) if sample.videos else []
        except DataError as e:
            return Encoded([], [], (), False, str(e))
        it, vit = iter(counts), iter(videos)
        for text, learned in self.pieces(sample.messages):
            found = []
            piece = self._ids(text, it, vit, found)
            spans += [(kind, a + len(ids), b + len(ids)) for kind, a, b in found]
            ids += piece
            labels += [(t if learned and t not in self.visual_ids else -100) for t in piece]
        return self._fit(Encoded(ids, labels, sample.images, videos=tuple(sample.videos),
                                 media=tuple(k for k, _, _ in spans)), spans)

    def _fit(self, enc: Encoded, spans: list) -> Encoded:
        """Cut to ``max_length`` after the last image or video that fits whole; drop when none can be kept."""
        if len(enc.input_ids) <= self.max_length:
            return enc
        cut, keep = self.max_length, len(spans)
        for k, (_, start, end) in enumerate(spans):
            if end > cut:  # this image / video would be cut through: end the sample before it
                cut, keep = start, k
                break
        if keep == 0 and spans:
            return Encoded([], [], (), True, f"its first {spans[0][0]} ends at token {spans[0][2]}, "
                                             f"beyond data.max_length={self.max_length}")
        labels = enc.labels[:cut]
        if all(t == -100 for t in labels):
            return Encoded([], [], (), True, f"nothing to learn within data.max_length={self.max_length}")
        media = enc.media[:keep]
        n_images, n_videos = media.count("image"), media.count("video")
        return Encoded(enc.input_ids[:cut], labels, enc.images[:n_images], True, videos=enc.videos[:n_videos],
                       media=media)


def chat_special_tokens(tokenizer) -> tuple:
    """``<image>``, and the plain template's role markers when the tokenizer has no template."""
    return (IMAGE,) if getattr(tokenizer, "chat_template", None) else SPECIAL_TOKENS


def add_chat_tokens(tokenizer):
    """Make the chat tokens single special tokens of ``tokenizer`` (in place, in a fixed order)."""
    missing = [t for t in chat_special_tokens(tokenizer) if t not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
    return tokenizer


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
