"""Chat records: LLaVA JSON and ms-swift JSONL read into one ``ChatSample``.

- LLaVA JSON: a list of ``{"id", "image", "conversations": [{"from": "human" | "gpt", "value"}]}``
  (``image`` relative to ``data.image_folder``; absent for a text-only sample).
- ms-swift JSONL: one ``{"messages": [{"role": "system" | "user" | "assistant", "content"}],
  "images": [...], "videos": [...]}`` per line (paths relative to the file's directory; a video is a file, a
  directory of frames, or a list of frame files).
- LLaVA JSON's ``video`` (LLaVA-Video), relative to ``data.image_folder``.

``<image>`` / ``<video>`` in a message marks where an image / a video goes (ms-swift's rule: missing marks are
added at the start of the first non-system turn). A family without video input drops a sample with one (counted,
named). A bad entry is kept with its ``error``
(skipped and counted by the loader, reported by ``mmpipe data check``).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

from mmpipe.errors import DataError

IMAGE = "<image>"
VIDEO = "<video>"
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


def _video_paths(value, folder: str) -> tuple:
    """(videos, error) from ms-swift's ``videos`` / LLaVA's ``video``: one entry or a list; an entry is a path (a
    file or a directory of frames) or a list of frame paths (kept as a tuple)."""
    items = [value] if isinstance(value, (str, dict)) and value else list(value or [])
    out = []
    for it in items:
        if isinstance(it, (list, tuple)):
            frames, bad = _image_paths(list(it), folder)
            if bad:
                return (), "video " + bad
            out.append(tuple(frames))
            continue
        paths, bad = _image_paths(it, folder)
        if bad:
            return (), "video " + bad
        out.append(paths[0])
    return tuple(out), None


@dataclass(frozen=True)
class ChatSample:
    messages: tuple  # ((role, text), ...) with role in system / user / assistant
    images: tuple = ()
    where: str = ""
    error: Optional[str] = None
    videos: tuple = ()  # each a path (a file, a directory of frames) or a tuple of frame paths


def _check(messages, images, videos=()) -> Optional[str]:
    if not messages or not any(r == "assistant" for r, _ in messages):
        return "no assistant turn to learn"
    for mark, media, what in ((IMAGE, images, "image"), (VIDEO, videos, "video")):
        n = sum(t.count(mark) for _, t in messages)
        if n != len(media):
            return f"{n} {mark} marker(s) but {len(media)} {what}(s)"
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
        videos, bad_video = _video_paths(row.get("video") or row.get("videos"), folder)
        msgs = _video_marks(msgs, images, videos)
        out.append(ChatSample(msgs, images, where, error or bad or bad_video or _check(msgs, images, videos), videos))
    return out


def _video_marks(messages: tuple, images: tuple, videos: tuple) -> tuple:
    """A LLaVA JSON row's ``<video>`` marks: a row with videos and no image whose ``<image>`` marks are as many as
    its videos and that has no ``<video>`` mark marks the videos with them (LLaVA-Video's and LLaVA-NeXT-Video's
    data write the video's place as ``<image>``); missing marks are added as ms-swift adds them."""
    if videos and not images and not any(VIDEO in t for _, t in messages) \
            and sum(t.count(IMAGE) for _, t in messages) == len(videos):
        messages = tuple((r, t.replace(IMAGE, VIDEO)) for r, t in messages)
    return _add_default_tags(messages, len(videos), VIDEO)


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
            videos, bad_video = _video_paths(row.get("videos"), folder)
            msgs = _add_default_tags(_add_default_tags(msgs, len(images)), len(videos), VIDEO)
            out.append(ChatSample(msgs, images, where, error or bad or bad_video or _check(msgs, images, videos),
                                  videos))
    return out


def _add_default_tags(messages: tuple, n_media: int, mark: str = IMAGE) -> tuple:
    """As ms-swift's ``Template._add_default_tags``: media with fewer ``mark`` tags than items get the missing
    tags at the start of the first message after the system turn."""
    missing = n_media - sum(t.count(mark) for _, t in messages)
    first = next((i for i, (r, _) in enumerate(messages) if r != "system"), None)
    if missing <= 0 or first is None:
        return messages
    role, text = messages[first]
    return messages[:first] + ((role, mark * missing + text),) + messages[first + 1:]


def read_chat(path: str, image_folder: Optional[str] = None, key: str = "data.train") -> list:
    if not path or not os.path.isfile(path):
        raise DataError(f"{key}: file not found: {path} (give a LLaVA .json or an ms-swift .jsonl chat file)")
    return (read_llava_json(path, image_folder) if os.path.splitext(path)[1].lower() == ".json"
            else read_swift_jsonl(path))


def chat_texts(samples: list) -> list:
    """The message texts of chat samples, without image markers (tokenizer training)."""
    return [t.replace(IMAGE, " ").replace(VIDEO, " ") for s in samples for _, t in s.messages]


