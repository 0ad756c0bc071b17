"""Image files -> uint8 (3, H, W) tensors for every family's image input.

- Images are decoded (JPEGs with libjpeg-turbo's DCT scaling via simplejpeg, at reduced size when
  the source allows and the caller accepts it; other formats with Pillow), resized so the shortest
  edge is the requested size, centre-cropped (the order and filter of transformers' image
  processor with ``resample=BILINEAR``, which an export writes) and shipped as **uint8** (3,H,W):
  the first pipeline stage normalises on the device.
- Images are converted to RGB as transformers' image processors do: EXIF orientation applied,
  transparency composited onto white, 16-bit grayscale scaled to 8 bits; more than ``MAX_PIXELS``
  pixels is refused before decoding.
"""
from __future__ import annotations

import io
import re
import warnings
from typing import Optional

import numpy as np
import torch
from PIL import Image, ImageOps

from mmpipe.data.manifest import json_type

try:  # libjpeg-turbo with DCT-domain scaling, ~15% faster than Pillow's JPEG decode here (BENCHMARKS.md)
    import simplejpeg
except ImportError:  # pragma: no cover - Pillow does the same, a little slower
    simplejpeg = None

# Images declaring more pixels than this are refused (a bad sample) before any pixel is decoded:
# Pillow's own decompression-bomb limit (89.5 Mpx; a 300 MB RGB array per loader worker).
MAX_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485


class TooLarge(ValueError):
    """An image mmpipe will not decode (too many pixels, no defined 8-bit scale): a bad sample whose
    reason is this message."""


def _check_pixels(w: int, h: int) -> None:
    if w * h > MAX_PIXELS:
        raise TooLarge(f"too large to decode safely ({w} x {h} pixels > {MAX_PIXELS})")


# EXIF orientation -> the array operation of PIL.ImageOps.exif_transpose (on (H, W, C) arrays)
_ORIENT = {2: lambda a: a[:, ::-1], 3: lambda a: a[::-1, ::-1], 4: lambda a: a[::-1],
           5: lambda a: a.transpose(1, 0, 2), 6: lambda a: np.rot90(a, -1),
           7: lambda a: np.rot90(a, -1)[::-1], 8: lambda a: np.rot90(a, 1)}
_JPEG_MODES = {"YCbCr": "RGB", "RGB": "RGB", "Gray": "L", "CMYK": "CMYK", "YCCK": "CMYK"}  # as Pillow names them


def jpeg_orientation(data: bytes) -> int:
    """The EXIF orientation (1-8) of a JPEG, 1 when it has none: a walk over the segment headers
    before the image data to the first APP1 "Exif" segment (the one Pillow reads), no decoding."""
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return 1
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xDA, 0xD9):  # start of scan / end of image: no EXIF
            return 1
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # segments without a length
            i += 2
            continue
        length = int.from_bytes(data[i + 2:i + 4], "big")
        if marker == 0xE1 and data[i + 4:i + 10] == b"Exif\0\0":
            return _tiff_orientation(data[i + 10:i + 2 + length])
        i += 2 + length
    return 1


def _tiff_orientation(t: bytes) -> int:
    order = {b"II": "little", b"MM": "big"}.get(t[:2])
    if order is None or len(t) < 8:
        return 1
    ifd = int.from_bytes(t[4:8], order)
    count = int.from_bytes(t[ifd:ifd + 2], order) if ifd + 2 <= len(t) else 0
    for k in range(count):
        e = ifd + 2 + 12 * k
        if e + 12 > len(t):
            break
        if int.from_bytes(t[e:e + 2], order) == 0x0112:  # Orientation, a SHORT (or LONG) value
            kind = int.from_bytes(t[e + 2:e + 4], order)
            v = int.from_bytes(t[e + 8:e + 10] if kind == 3 else t[e + 8:e + 12], order)
            return v if 1 <= v <= 8 else 1
    return 1


def _to_rgb(im: Image.Image) -> np.ndarray:
    """RGB uint8 (H, W, 3) as transformers' image processors convert (``convert_to_rgb``):
    transparency (alpha band, palette or colour-key ``transparency``) composited onto white,
    16-bit grayscale scaled to 8 bits (value / 257: Pillow's own convert would clip at 255; a 32-bit
    integer image, which has no defined scale, is refused as a bad sample),
    palette, CMYK, grayscale and bilevel images converted by Pillow."""
    mode = im.mode
    if mode == "RGB" and "transparency" not in im.info:
        return np.array(im)  # writable: torch.from_numpy needs it
    if mode == "I":  # 32-bit signed (e.g. TIFF): Pillow would clip at 255, transformers too
        raise TooLarge("a 32-bit integer image (mode I) has no defined 8-bit scale; save it as 8- or 16-bit")
    if mode in ("I;16", "I;16B", "I;16L", "I;16N"):
        a = np.asarray(im)
        gray = np.clip(np.rint(a / 257.0), 0, 255).astype(np.uint8)
        t = im.info.get("transparency")
        if isinstance(t, int):  # a 16-bit PNG's colour-key transparency
            gray[a == t] = 255
        return np.repeat(gray[:, :, None], 3, axis=2)
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.array(Image.alpha_composite(white, rgba).convert("RGB"))
    return np.array(im.convert("RGB"))


def _decode_rgb(data: bytes, size: int, info: Optional[dict] = None, draft: bool = True) -> np.ndarray:
    """RGB uint8 (H, W, 3), upright (EXIF orientation applied). With ``draft``, a JPEG at least
    twice the target is decoded straight to a reduced size (libjpeg's DCT scaling, never below
    ``size``): most of the decode work is skipped, but the pixels are not those of a full decode. An image of more than ``MAX_PIXELS`` raises ``TooLarge`` before it is
    decoded. ``info``, if given, receives the image's upright ``width``, ``height`` and file ``mode``."""
    if simplejpeg is not None and data[:2] == b"\xff\xd8":
        try:
            h, w, space, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError:
            h = None  # not readable here: Pillow decides
        if h is not None:
            _check_pixels(w, h)
            orientation = jpeg_orientation(data)
            m = size if draft and min(h, w) >= 2 * size else 0
            try:
                arr = simplejpeg.decode_jpeg(data, "RGB", min_height=m, min_width=m)
            except ValueError:
                pass  # truncated, unusual coding, ...: Pillow decides (and raises for what it cannot read)
            else:
                if orientation != 1:
                    arr = _ORIENT[orientation](arr)
                if info is not None:
                    info.update(width=h if orientation >= 5 else w, height=w if orientation >= 5 else h,
                                mode=_JPEG_MODES.get(space, space))
                return arr
    with warnings.catch_warnings():  # Pillow warns above its limit (refused below), raises above twice it
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            im = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as e:
            pixels = re.search(r"\((\d+) pixels\)", str(e))
            raise TooLarge(f"too large to decode safely ({pixels.group(1) if pixels else 'more than 2 x'} pixels > "
                           f"{MAX_PIXELS})") from None
    with im:
        w, h = im.size
        _check_pixels(w, h)
        mode = im.mode
        if draft and im.format == "JPEG" and min(w, h) >= 2 * size:
            im.draft("RGB", (size, size))
        im.load()
        orientation = im.getexif().get(0x0112, 1)
        ImageOps.exif_transpose(im, in_place=True)
        if info is not None:
            swap = orientation in (5, 6, 7, 8)
            info.update(width=h if swap else w, height=w if swap else h, mode=mode)
        return _to_rgb(im)


def load_image(path, size: int, info: Optional[dict] = None, draft: bool = True) -> torch.Tensor:
    """Decode -> RGB (upright, transparency on white) -> shortest edge ``size`` -> centre ``size`` x
    ``size`` crop, uint8 (3, size, size).

    ``path`` is a file name or a binary file object. The resize is torchvision's antialiased
    bilinear resize on the uint8 tensor, then ``center_crop``: exactly what transformers' image
    processor (``CLIPImageProcessor(resample=BILINEAR)``, torchvision backend) computes from a full
    decode, so with ``draft=False`` an exported model sees training's pixels. ``draft``: a large
    JPEG may be decoded at reduced size (faster, a few grey levels off). ``info``: see ``_decode_rgb``."""
    if hasattr(path, "read"):
        data = path.read()
    else:
        with open(path, "rb") as fh:
            data = fh.read()
    arr = _decode_rgb(data, size, info, draft)
    x = torch.from_numpy(np.ascontiguousarray(arr)).permute(2, 0, 1)
    h, w = x.shape[1:]
    if min(h, w) != size:
        from torchvision.transforms.v2 import functional as F
        x = F.resize(x, [size], antialias=True)  # shortest edge = size, the other int(size * long / short)
        h, w = x.shape[1:]
    if h != size or w != size:
        top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))  # torchvision's center_crop
        x = x[:, top:top + size, left:left + size]
    return x.contiguous()


def decode_sample(path, text: str, size: int, info: Optional[dict] = None, draft: bool = True
                  ) -> tuple[Optional[torch.Tensor], Optional[str]]:
    """(uint8 image, None), or (None, why the sample is unusable). ``path`` may be a file-like object.
    Nothing a file holds raises: a corrupt image of any kind is a bad sample. ``draft``: see
    ``load_image``."""
    if not isinstance(text, str):  # e.g. a shard's JSON caption that is a number
        return None, f"caption is {json_type(text)}, expected text"
    if not text.strip():
        return None, "empty caption"
    try:
        return load_image(path, size, info, draft), None
    except FileNotFoundError:
        return None, "missing file"
    except TooLarge as e:
        return None, str(e)
    except MemoryError:
        raise
    except Exception as e:  # Pillow raises many kinds (OSError, SyntaxError, struct.error, ...) on corrupt files
        return None, f"cannot decode ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
