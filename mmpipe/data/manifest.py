"""Image-caption manifests: JSONL (``{"image": path, "text": caption}`` per line; ``image_path`` /
``caption`` accepted) or CSV/TSV with a header naming those columns. Image paths are relative to
the manifest's directory unless absolute.

Accepted forms: UTF-8 (a BOM is fine) or UTF-16 with a BOM (a spreadsheet's "Unicode text"); CRLF
or LF line ends; standard CSV quoting (quoted commas, doubled quotes, line breaks in a quoted
field); a caption that is a list of strings (COCO style) gives its first non-empty one; blank lines
are skipped. Every row keeps the real line it starts on.

A row that cannot be used (not JSON, not an object, no image/caption field, a caption that is not
text, a CSV row with the wrong number of fields or broken quoting) is kept as a *bad row*
(``Sample.error`` says why): the loader skips and counts it like an unreadable image, named
``FILE line N``. Only a file that cannot be read at all (not found, not UTF-8, an unclosed quote
that would swallow the rest of the file) or has no usable row is a one-line ``DataError``.
"""
from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass
from typing import Optional

from mmpipe.errors import DataError

IMAGE_KEYS = ("image", "image_path", "file", "filepath")
TEXT_KEYS = ("text", "caption", "title")


@dataclass(frozen=True)
class Sample:
    image: str
    text: str
    manifest: str = ""  # the file and line the row was read from ("" when built in code)
    line: int = 0
    error: Optional[str] = None  # why the row is unusable (then ``text`` is "")

    @property
    def where(self) -> str:
        return f"{self.manifest} line {self.line}" if self.manifest else self.image


def json_type(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    return {dict: "an object", list: "a list", str: "a string"}.get(type(v), f"a {type(v).__name__}")


def _field(row: dict, keys) -> tuple[bool, object]:
    """(found, value) of the first key present with a non-null value (null only if all are null)."""
    found = False
    for k in keys:
        if k in row:
            if row[k] is not None:
                return True, row[k]
            found = True
    return found, None


def _image(row: dict) -> str:
    found, v = _field(row, IMAGE_KEYS)
    if not found:
        raise ValueError(f"no image field (expected one of {', '.join(IMAGE_KEYS)})")
    if not isinstance(v, str):
        raise ValueError(f"image is {json_type(v)}, expected a file path")
    if not v.strip():
        raise ValueError("empty image path")
    return v


def _caption(row: dict) -> str:
    found, v = _field(row, TEXT_KEYS)
    if not found:
        raise ValueError(f"no caption field (expected one of {', '.join(TEXT_KEYS)})")
    return caption_text(v)


def caption_text(v) -> str:
    """A caption field's text: a string, or of a list (several captions per image) the first
    non-empty one; ``ValueError`` otherwise. The same rule for manifests and shards."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):  # several captions per image (COCO style): the first non-empty one
        for c in v:
            if not isinstance(c, str):
                raise ValueError(f"caption list holds {json_type(c)}, expected text")
        return next((c for c in v if c.strip()), "")
    raise ValueError(f"caption is {json_type(v)}, expected text")


def require_manifest(path: str, key: str = "data.train") -> None:
    if not path:
        raise DataError(f"{key} is not set: point it at a .jsonl or .csv manifest (mmpipe data synth --out DIR makes one)")
    if not os.path.isfile(path):
        raise DataError(f"{key}: manifest not found: {path} (fix the path, or run mmpipe data synth --out DIR)")


def _text(path: str) -> str:
    with open(path, "rb") as fh:
        data = fh.read()
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        try:
            return data.decode("utf-16")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not valid UTF-16 (byte {e.start}); re-save it as UTF-8") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path} line {line}: not UTF-8 (byte {data[e.start:e.start + 1]!r}); re-save the file as "
                        "UTF-8 (e.g. in a spreadsheet: CSV UTF-8)") from None


def _lines(text: str):
    """(line number, line) on \\n, \\r\\n or \\r only: JSON strings may hold U+2028 and the like."""
    return enumerate(io.StringIO(text, newline=""), start=1)


def manifest_format(path: str, text: str) -> str:
    """``jsonl``, ``csv`` or ``tsv``: by the extension in any case (``.CSV``, ``.Jsonl``); where the
    extension says nothing, by the content (a first record that opens ``{`` is JSON lines, a header
    line with a tab and no comma is TSV, else CSV)."""
    ext = os.path.splitext(path)[1].lower()
    if ext in (".csv", ".tsv"):
        return ext[1:]
    if ext in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if first.startswith("{"):
        return "jsonl"
    return "tsv" if "\t" in first and "," not in first else "csv"


def _csv_rows(path: str, text: str, delimiter: str = ","):
    """(line, row dict or None, why) per record; ``line`` is where the record starts."""
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True)
    header = None
    while True:
        start = reader.line_num + 1
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            if "unexpected end of data" in str(e):
                raise DataError(f"{path} line {start}: a quoted field opened here is never closed (every later line "
                                "would be read into it); fix the quote") from None
            if header is None:
                raise DataError(f"{path} line {start}: bad CSV quoting in the header ({e})") from None
            yield start, None, f"bad CSV quoting ({e}): quote a field that holds a quote, doubling the quotes in it"
            continue
        if not fields:
            continue  # blank line
        if header is None:
            header = [h.strip() for h in fields]
            for what, keys in (("image", IMAGE_KEYS), ("caption", TEXT_KEYS)):
                if not any(k in header for k in keys):
                    raise DataError(f"{path} line {start}: the header has no {what} column (expected one of "
                                    f"{', '.join(keys)}; found {', '.join(header)})")
            continue
        extra = any(f.strip() for f in fields[len(header):])  # empty trailing fields are harmless
        if len(fields) < len(header) or extra:
            n, sep = len(fields), "tab" if delimiter == "\t" else "comma"
            yield start, None, (f"{n} field{'s' if n != 1 else ''}, the header has {len(header)} (quote a caption "
                                f"that holds a {sep}: \"a, b\")")
            continue
        yield start, dict(zip(header, fields)), None


def _jsonl_rows(text: str):
    for i, line in _lines(text):
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            yield i, None, f"not valid JSON ({e.msg}, column {e.colno})"
            continue
        if not isinstance(row, dict):
            yield i, None, f"row is {json_type(row)}, expected an object like {{\"image\": ..., \"text\": ...}}"
            continue
        yield i, row, None


def read_manifest(path: str, key: str = "data.train", require_usable: bool = True) -> list[Sample]:
    """Every row of the manifest, unusable ones included (``error`` set). A manifest with no row, or
    (with ``require_usable``) no usable row, is a ``DataError``."""
    require_manifest(path, key)
    base = os.path.dirname(os.path.abspath(path))
    text = _text(path)
    fmt = manifest_format(path, text)
    rows = _jsonl_rows(text) if fmt == "jsonl" else _csv_rows(path, text, "\t" if fmt == "tsv" else ",")
    samples = []
    for line, row, why in rows:
        image = ""
        if row is not None:
            try:
                image = _image(row)
                image = image if os.path.isabs(image) else os.path.join(base, image)
                caption = _caption(row)
            except ValueError as e:
                why = str(e)
        samples.append(Sample(image, "", path, line, why) if why is not None else Sample(image, caption, path, line))
    if not samples:
        raise DataError(f"{key}: manifest {path} has no samples")
    if require_usable and all(s.error is not None for s in samples):
        first = samples[0]
        raise DataError(f"{key}: manifest {path} has no usable row ({len(samples)} unusable, first: {first.where}: "
                        f"{first.error})")
    return samples
