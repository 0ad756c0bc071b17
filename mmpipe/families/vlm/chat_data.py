"""Chat data for VLMs: LLaVA JSON and ms-swift JSONL read into one record, encoded into token ids
and labels.

- LLaVA JSON: a list of ``{"id", "image", "conversations": [{"from": "human" | "gpt", "value"}]}``
  (``image`` relative to ``data.image_folder``; absent for a text-only sample).
- ms-swift JSONL: one ``{"messages": [{"role": "system" | "user" | "assistant", "content"}],
  "images": [...]}`` per line (image paths relative to the file's directory).

``<image>`` in a message marks where an image goes; it expands to exactly the vision tower's
patch count of image tokens. Labels: every assistant turn (its text and the end-of-turn token) is
learned; system text, prompts, role markers, image tokens and padding are -100. A sample longer
than ``max_length`` is cut after its last complete image; if an image itself does not fit, the
sample is dropped (and counted), never cut through its image tokens.

The chat template is the tokenizer's own (``tokenizer.chat_template``, e.g. a Qwen2 or Llama
tokenizer directory): each assistant turn is what rendering one more message adds after the
generation prompt, so label boundaries are exact. Without one, the plain template::

    <|system|>\\n{text}<|end|>\\n<|user|>\\n{text}<|end|>\\n<|assistant|>\\n{text}<|end|>\\n
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

from mmpipe.data.loader import _item_key, decode_sample, finish_pixels
from mmpipe.errors import DataError

IMAGE = "<image>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_TOKENS = (IMAGE,) + ROLE_TOKENS
# ShareGPT / LLaVA / ms-swift role spellings -> the three roles a chat template knows (ms-swift maps
# human/user, gpt/bot/chatgpt/assistant and system the same way); any other role is refused
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "bot": "assistant", "chatgpt": "assistant",
         "assistant": "assistant", "system": "system"}


def _roles(raw: list) -> tuple:
    """(roles, error): each turn's role mapped by ``ROLES``; an unknown one is the sample's error."""
    out = []
    for r in raw:
        role = ROLES.get(str(r).strip().lower())
        if role is None:
            return (), f"unknown role {str(r)!r} (known: {', '.join(ROLES)})"
        out.append(role)
    return tuple(out), None


def _image_paths(value, folder: str) -> tuple:
    """(paths, error) from ms-swift's ``images``: one path, a list of paths, or of ``{"path": ...}``
    (the ``datasets`` Image form); relative paths against ``folder``."""
    items = [value] if isinstance(value, dict) or (isinstance(value, str) and value) else list(value or [])
    paths = []
    for it in items:
        p = it.get("path") if isinstance(it, dict) else it
        if not isinstance(p, str) or not p:
            what = "bytes without a path" if isinstance(it, dict) and it.get("bytes") else repr(it)[:60]
            return (), f"image entry {what} is not a path (give a file path, or {{\"path\": ...}})"
        paths.append(p if os.path.isabs(p) else os.path.join(folder, p))
    return tuple(paths), None


@dataclass(frozen=True)
class ChatSample:
    messages: tuple  # ((role, text), ...) with role in system / user / assistant
    images: tuple = ()
    where: str = ""
    error: Optional[str] = None


@dataclass
class Encoded:
    input_ids: list
    labels: list
    images: tuple = ()
    truncated: bool = False
    dropped: Optional[str] = None  # why the sample cannot be used at this length


def _check(messages, images) -> Optional[str]:
    if not messages or not any(r == "assistant" for r, _ in messages):
        return "no assistant turn to learn"
    n = sum(t.count(IMAGE) for _, t in messages)
    if n != len(images):
        return f"{n} {IMAGE} marker(s) but {len(images)} image(s)"
    return None


def read_llava_json(path: str, image_folder: Optional[str] = None) -> list:
    """LLaVA's JSON list; bad entries are kept with ``error`` (skipped and counted by the loader)."""
    with open(path, encoding="utf-8") as fh:
        try:
            rows = json.load(fh)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON ({e}); expected a LLaVA list of conversations") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: expected a JSON list of {{id, image, conversations}} entries")
    folder = image_folder or os.path.dirname(os.path.abspath(path))
    out = []
    for i, row in enumerate(rows):
        where = f"{path} entry {i}" + (f" (id {row.get('id')})" if isinstance(row, dict) and "id" in row else "")
        conv = row.get("conversations") if isinstance(row, dict) else None
        if not isinstance(conv, list) or not all(isinstance(t, dict) and "value" in t for t in conv):
            out.append(ChatSample((), (), where, "no conversations list of {from, value}"))
            continue
        roles, error = _roles([t.get("from", "user") for t in conv])
        msgs = tuple(zip(roles, (str(t["value"]) for t in conv)))
        images, bad = _image_paths(row.get("image"), folder)
        out.append(ChatSample(msgs, images, where, error or bad or _check(msgs, images)))
    return out


def read_swift_jsonl(path: str) -> list:
    """ms-swift's JSONL (``messages`` + ``images``); a bad line is kept with ``error``."""
    folder = os.path.dirname(os.path.abspath(path))
    out = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path} line {n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                out.append(ChatSample((), (), where, f"not JSON ({e.msg})"))
                continue
            msgs = row.get("messages") if isinstance(row, dict) else None
            if not isinstance(msgs, list) or not all(isinstance(m, dict) and "content" in m for m in msgs):
                out.append(ChatSample((), (), where, "no messages list of {role, content}"))
                continue
            roles, error = _roles([m.get("role", "user") for m in msgs])
            msgs = tuple(zip(roles, (str(m["content"]) for m in msgs)))
            images, bad = _image_paths(row.get("images"), folder)
            msgs = _add_default_tags(msgs, len(images))
            out.append(ChatSample(msgs, images, where, error or bad or _check(msgs, images)))
    return out


def _add_default_tags(messages: tuple, n_images: int) -> tuple:
    """As ms-swift's ``Template._add_default_tags``: images with fewer ``<image>`` tags than images get
    the missing tags at the start of the first message after the system turn."""
    missing = n_images - sum(t.count(IMAGE) for _, t in messages)
    first = next((i for i, (r, _) in enumerate(messages) if r != "system"), None)
    if missing <= 0 or first is None:
        return messages
    role, text = messages[first]
    return messages[:first] + ((role, IMAGE * missing + text),) + messages[first + 1:]


def read_chat(path: str, image_folder: Optional[str] = None, key: str = "data.train") -> list:
    if not path or not os.path.isfile(path):
        raise DataError(f"{key}: file not found: {path} (give a LLaVA .json or an ms-swift .jsonl chat file)")
    return (read_llava_json(path, image_folder) if os.path.splitext(path)[1].lower() == ".json"
            else read_swift_jsonl(path))


class ChatEncoder:
    """Token ids and labels of a chat sample: each piece is tokenized on its own (no special tokens
    added), so label boundaries are exact whatever the tokenizer merges."""

    def __init__(self, tokenizer, image_token_id: int, n_image_tokens: int, max_length: int):
        self.tok, self.image_id, self.n_image, self.max_length = tokenizer, image_token_id, n_image_tokens, max_length

    def _ids(self, text: str) -> list:
        out = []
        for k, part in enumerate(text.split(IMAGE)):
            if k:
                out += [self.image_id] * self.n_image
            if part:
                out += self.tok(part, add_special_tokens=False)["input_ids"]
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

    def prompt_ids(self, messages) -> list:
        """Token ids of ``messages`` followed by the assistant's turn header (generation)."""
        if getattr(self.tok, "chat_template", None):
            return self._ids(self._render(messages, True))
        return [t for text, _ in self.pieces(messages) for t in self._ids(text)] + self._ids("<|assistant|>\n")

    def encode(self, sample: ChatSample) -> Encoded:
        ids, labels = [], []
        for text, learned in self.pieces(sample.messages):
            piece = self._ids(text)
            ids += piece
            labels += [(t if learned and t != self.image_id else -100) for t in piece]
        return self._fit(Encoded(ids, labels, sample.images))

    def _fit(self, enc: Encoded) -> Encoded:
        """Cut to ``max_length`` after the last image that fits whole; drop when none can be kept."""
        if len(enc.input_ids) <= self.max_length:
            return enc
        cut = self.max_length
        keep_images = len(enc.images)
        # each image is n_image image tokens, in order: the k-th image starts at the (k * n_image)-th one,
        # whether or not images touch (<image><image>, or a newline the tokenizer drops between them)
        positions = [i for i, t in enumerate(enc.input_ids) if t == self.image_id]
        starts = positions[::self.n_image]
        for k, s in enumerate(starts):
            if s + self.n_image > cut:  # this image would be cut through: end the sample before it
                cut, keep_images = s, k
                break
        if keep_images < len(enc.images) and keep_images == 0 and starts:
            return Encoded([], [], (), True, f"its first image ends at token {starts[0] + self.n_image}, "
                                             f"beyond data.max_length={self.max_length}")
        labels = enc.labels[:cut]
        if all(t == -100 for t in labels):
            return Encoded([], [], (), True, f"nothing to learn within data.max_length={self.max_length}")
        return Encoded(enc.input_ids[:cut], labels, enc.images[:keep_images], True)


def chat_special_tokens(tokenizer) -> tuple:
    """``<image>``, and the plain template's role markers when the tokenizer has no template."""
    return (IMAGE,) if getattr(tokenizer, "chat_template", None) else SPECIAL_TOKENS


def add_chat_tokens(tokenizer):
    """Make the chat tokens single special tokens of ``tokenizer`` (in place, in a fixed order)."""
    missing = [t for t in chat_special_tokens(tokenizer) if t not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
    return tokenizer


def chat_texts(samples: list) -> list:
    """The message texts of chat samples, without image markers (tokenizer training)."""
    return [t.replace(IMAGE, " ") for s in samples for _, t in s.messages]


class ChatDataset:
    """Chat samples for the loader: images decoded to the tower's size, ids and labels encoded. An
    unusable sample (a bad entry, a missing or corrupt image, nothing left at ``max_length``) is
    replaced by the next usable one, deterministically (every stage and layout agrees), and
    reported in the item's ``bad`` list, as for image-caption data."""

    def __init__(self, samples: list, encoder: ChatEncoder, image_size: int, decode_size: Optional[int] = None,
                 augment=None):
        self.samples, self.encoder, self.image_size = samples, encoder, image_size
        self.decode_size, self.augment = decode_size or image_size, augment

    def __len__(self):
        return len(self.samples)

    @property
    def lengths(self) -> list:
        """Encoded token counts (length grouping, packing); an unusable sample counts as 0."""
        def n(s):
            if s.error is not None:
                return 0
            enc = self.encoder.encode(s)
            return 0 if enc.dropped else len(enc.input_ids)
        return [n(s) for s in self.samples]

    def first_unusable(self) -> tuple:
        """(where, why) of the first sample that cannot be used as it stands (no image decoded)."""
        for s in self.samples:
            why = s.error if s.error is not None else self.encoder.encode(s).dropped
            if why is not None:
                return s.where, why
        return "", "none found"

    def _load(self, j: int, epoch: int = 0):
        s = self.samples[j]
        if s.error is not None:
            return None, (s.where, s.error)
        enc = self.encoder.encode(s)
        if enc.dropped:
            return None, (s.where, f"dropped: {enc.dropped}")
        images = []
        for path in enc.images:
            pixels, why = decode_sample(path, IMAGE, self.decode_size, draft=False)  # a full decode: an
            if pixels is None:  # exported processor, given the user's PIL image, then sees these pixels
                return None, (path, why)
            images.append(finish_pixels(pixels, self.image_size, self.augment, j, epoch))
        return {"input_ids": enc.input_ids, "labels": enc.labels, "images": images, "truncated": enc.truncated}, None

    def __getitem__(self, item) -> dict:
        idx, epoch = _item_key(item)
        bad = []
        for step in range(len(self)):
            j = (idx + step) % len(self)
            fields, why = self._load(j, epoch)
            if fields is not None:
                return {**fields, "index": j, "key": self.samples[j].where, "bad": bad}
            bad.append(why)
        raise DataError(f"no usable sample in the chat data (first failure: {bad[0][0]}: {bad[0][1]})")


def plan_packs(lengths: list, max_length: int, window: int = 1000) -> list:
    """Sample indices -> packs (lists of indices) of total length <= ``max_length``: within each window
    of ``window`` samples (in data order), first-fit decreasing; a sample is never split, an empty
    one (unusable: length 0) is left out, and a pack keeps its samples in data order."""
    packs = []
    for lo in range(0, len(lengths), window):
        bins, room = [], []
        for i in sorted(range(lo, min(lo + window, len(lengths))), key=lambda i: (-lengths[i], i)):
            n = lengths[i]
            if n <= 0:
                continue
            for b in range(len(bins)):
                if room[b] >= n:
                    bins[b].append(i)
                    room[b] -= n
                    break
            else:
                bins.append([i])
                room.append(max_length - n)
        packs.extend(sorted(b) for b in sorted(bins, key=min))
    return packs


class PackedChatDataset:
    """``data.packing``: each item is a pack of chat samples (``plan_packs`` over their encoded
    lengths) concatenated into one sequence, each sample's first label hidden (nothing predicts
    across samples) and ``segments`` numbering the samples (the collate writes them into the
    attention mask: the model attends within a sample and restarts positions at each). A sample that
    fails to load (e.g. its image no longer decodes) is dropped from its pack and reported; a pack
    with none left is replaced by the next, as an unusable sample is."""

    def __init__(self, chat: ChatDataset, max_length: int):
        import bisect
        self.chat = chat
        self.sample_lengths = chat.lengths
        self.packs = plan_packs(self.sample_lengths, max_length)
        if not self.packs:
            where, why = chat.first_unusable()
            raise DataError(f"no usable sample in the chat data to pack (the first, {where}: {why})")
        # an unusable sample (left out of every pack) is reported with the pack that follows it in data
        # order, once per epoch, as an unpacked run reports it when it draws it
        firsts = [p[0] for p in self.packs]
        self.unusable: dict = {}
        for i, n in enumerate(self.sample_lengths):
            if n <= 0:
                j = min(bisect.bisect_right(firsts, i), len(self.packs) - 1)
                self.unusable.setdefault(j, []).append(i)

    def __len__(self):
        return len(self.packs)

    @property
    def lengths(self) -> list:
        return [sum(self.sample_lengths[i] for i in p) for p in self.packs]

    def __getitem__(self, item) -> dict:
        idx, epoch = _item_key(item)
        bad = []
        for step in range(len(self)):
            j = (idx + step) % len(self)
            for i in self.unusable.get(j, ()):
                fields, why = self.chat._load(i, epoch)
                bad.append(why if fields is None else (self.chat.samples[i].where, "not packed (no tokens)"))
            ids, labels, segments, images, keys, truncated = [], [], [], [], [], 0
            for i in self.packs[j]:
                fields, why = self.chat._load(i, epoch)
                if fields is None:
                    bad.append(why)
                    continue
                k = len(fields["input_ids"])
                ids += fields["input_ids"]
                labels += [-100] + list(fields["labels"][1:])  # position k-1 of the last sample predicts none of this one
                segments += [len(keys) + 1] * k
                images += fields["images"]
                keys.append(self.chat.samples[i].where)
                truncated += bool(fields["truncated"])
            if keys:
                return {"input_ids": ids, "labels": labels, "segments": segments, "images": images,
                        "truncated": truncated, "index": j, "keys": keys, "bad": bad}
        raise DataError(f"no usable sample in the chat data (first failure: {bad[0][0]}: {bad[0][1]})")


class ChatCollate:
    """Samples -> the VLM's batch: ``pixel_values`` every image of the micro-batch in order (uint8;
    a (0, 3, S, S) tensor when it has none: pipeline stages exchange tensors only), ``input_ids``
    padded with the pad id to a multiple of ``pad_multiple``, ``attention_mask``, ``labels`` padded
    with -100; plus ``index``, ``keys``, ``bad`` and the count of truncated samples."""

    def __init__(self, pad_id: int, image_size: int, pad_multiple: int = 1, pad_to: Optional[int] = None):
        self.pad_id, self.image_size, self.pad_multiple, self.pad_to = pad_id, image_size, max(1, pad_multiple), pad_to

    def __call__(self, items: list) -> dict:
        import torch
        n = max(len(it["input_ids"]) for it in items)
        n = self.pad_to or -(-n // self.pad_multiple) * self.pad_multiple
        ids = torch.full((len(items), n), self.pad_id, dtype=torch.int64)
        labels = torch.full((len(items), n), -100, dtype=torch.int64)
        mask = torch.zeros((len(items), n), dtype=torch.int64)
        for i, it in enumerate(items):
            k = len(it["input_ids"])
            ids[i, :k] = torch.as_tensor(it["input_ids"])
            labels[i, :k] = torch.as_tensor(it["labels"])
            mask[i, :k] = torch.as_tensor(it["segments"]) if "segments" in it else 1  # packed: segment ids
        images = [im for it in items for im in it["images"]]
        pixels = (torch.stack(images) if images else
                  torch.zeros((0, 3, self.image_size, self.image_size), dtype=torch.uint8))
        return {"pixel_values": pixels, "input_ids": ids, "attention_mask": mask,
                "labels": labels, "index": torch.tensor([it["index"] for it in items]),
                "keys": [k for it in items for k in (it["keys"] if "keys" in it else [it["key"]])],
                "bad": [b for it in items for b in it["bad"]],
                "truncated": sum(int(it["truncated"]) for it in items)}
