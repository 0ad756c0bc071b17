"""A corpus of unusual but legitimate manifests and images (read correctly) and plainly invalid ones
(refused, naming the file and line; one bad row is skipped and counted), plus ``mmpipe data check``.
Single-process units: every file is generated here with Pillow (or written byte by byte)."""
from __future__ import annotations

import json
import struct
import warnings
import zlib

import numpy as np
import pytest
from mmpipe.data.pixels import SquarePixels
import torch
from PIL import Image, ImageOps

from mmpipe.errors import DataError


# ---- corpus helpers -----------------------------------------------------------------------------
def _png_bytes(width, height, bit_depth, color_type, raw: bytes) -> bytes:
    """A PNG written byte by byte (``raw``: the filtered scanlines; it may lie about the size)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def _halves(mode, left, right, size=32):
    im = Image.new(mode, (size, size), left)
    im.paste(Image.new(mode, (size // 2, size), right), (size // 2, 0))
    return im


def _palette(transparent: bool):
    im = Image.new("P", (32, 32), 0)
    im.paste(1, (16, 0, 32, 32))
    im.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    return im, ({"transparency": 0} if transparent else {})


def make_images(d) -> dict:
    """name -> (path, mode as stored in the file, expected RGB mean after decoding (per channel), tolerance).
    Transparent pixels are composited onto white (as transformers' image processors do)."""
    out = {}

    def save(name, im, fmt, mode, mean, tol=1.5, **kw):
        path = d / f"{name}.{fmt.lower()}"
        im.save(path, fmt, **kw)
        out[name] = (str(path), mode, mean, tol)

    save("rgb_jpeg", Image.new("RGB", (32, 32), (200, 10, 10)), "JPEG", "RGB", (200, 10, 10), 4, quality=95)
    # 16-bit grayscale: 128*257 and 65535 are 128 and 255 in 8 bits (Pillow's own convert clips to 255)
    g16 = Image.fromarray(np.hstack([np.full((32, 16), 128 * 257, np.uint16), np.full((32, 16), 65535, np.uint16)]))
    save("gray16_png", g16, "PNG", "I;16", (191.5,) * 3)
    save("gray16b_tiff", Image.frombytes("I;16B", (32, 32), np.asarray(g16, dtype=">u2").tobytes()), "TIFF",
         "I;16B", (191.5,) * 3)
    # (a 32-bit integer image, mode I, has no defined 8-bit scale: a bad sample, test_data.py)
    pal, _ = _palette(False)
    save("palette_png", pal, "PNG", "P", (127.5, 0, 127.5))
    pal, kw = _palette(True)  # index 0 (red, left half) transparent -> white
    save("palette_transparent_png", pal, "PNG", "P", (127.5, 127.5, 255), **kw)
    # left fully transparent red -> white; right half-transparent blue over white -> (127, 127, 255)
    save("rgba_png", _halves("RGBA", (255, 0, 0, 0), (0, 0, 255, 128)), "PNG", "RGBA", (191, 191, 255))
    save("la_png", _halves("LA", (0, 0), (0, 255)), "PNG", "LA", (127.5,) * 3)
    # an RGB PNG whose tRNS chunk makes pure red transparent
    save("rgb_colorkey_png", _halves("RGB", (255, 0, 0), (0, 255, 0)), "PNG", "RGB", (127.5, 255, 127.5),
         transparency=(255, 0, 0))
    save("cmyk_jpeg", Image.new("CMYK", (32, 32), (0, 255, 255, 0)), "JPEG", "CMYK", (255, 0, 0), 4, quality=95)
    save("gray_jpeg", Image.new("L", (32, 32), 100), "JPEG", "L", (100,) * 3, 2, quality=95)
    save("gray_png", Image.new("L", (32, 32), 60), "PNG", "L", (60,) * 3)
    save("bilevel_png", _halves("1", 0, 1), "PNG", "1", (127.5,) * 3)
    return out


def _quadrants(w=48, h=32) -> Image.Image:
    """Asymmetric: four differently coloured quadrants, 16-px aligned (few JPEG artefacts)."""
    a = np.zeros((h, w, 3), np.uint8)
    a[: h // 2, : w // 2] = (255, 0, 0)
    a[: h // 2, w // 2:] = (0, 255, 0)
    a[h // 2:, : w // 2] = (0, 0, 255)
    a[h // 2:, w // 2:] = (255, 255, 0)
    return Image.fromarray(a)


def _with_orientation(path, orientation: int, fmt="JPEG"):
    exif = Image.Exif()
    exif[0x0112] = orientation
    kw = {"exif": exif.tobytes(), "quality": 95} if fmt == "JPEG" else {"exif": exif}
    _quadrants().save(path, fmt, **kw)
    return str(path)


def _jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


@pytest.fixture(params=["simplejpeg", "pillow"])
def jpeg_path(request, monkeypatch):
    """Run a test with the fast JPEG decoder and again with Pillow only."""
    from mmpipe.data import decode as loader
    if request.param == "pillow":
        monkeypatch.setattr(loader, "simplejpeg", None)
    elif loader.simplejpeg is None:
        pytest.skip("simplejpeg not installed")
    return request.param


# ---- images -------------------------------------------------------------------------------------
CORPUS = ["rgb_jpeg", "gray16_png", "gray16b_tiff", "palette_png", "palette_transparent_png",
          "rgba_png", "la_png", "rgb_colorkey_png", "cmyk_jpeg", "gray_jpeg", "gray_png", "bilevel_png"]


@pytest.mark.parametrize("name", CORPUS)
def test_image_modes_decode_to_the_right_rgb(tmp_path, name):
    """16-bit, palette (with/without transparency), alpha, colour-key, CMYK, grayscale and bilevel
    images decode to the RGB a transformers image processor sees (alpha over white, 16 bit / 257)."""
    from mmpipe.data.decode import decode_sample
    path, _, mean, tol = make_images(tmp_path)[name]
    pixels, why = decode_sample(path, "a caption", 16)
    assert why is None and pixels.shape == (3, 16, 16) and pixels.dtype == torch.uint8
    got = pixels.float().mean(dim=(1, 2)).tolist()
    assert np.allclose(got, mean, atol=tol), (name, got, mean)


@pytest.mark.parametrize("orientation", [3, 6, 8, 2, 4, 5, 7])
def test_exif_orientation_is_applied(tmp_path, jpeg_path, orientation):
    """A camera JPEG's EXIF orientation is applied (as PIL.ImageOps.exif_transpose): pixels match the
    upright reference, on the fast decoder and on Pillow."""
    from mmpipe.data.decode import _decode_rgb
    path = _with_orientation(tmp_path / "o.jpg", orientation)
    with Image.open(path) as im:
        ref = np.asarray(ImageOps.exif_transpose(im).convert("RGB"), dtype=np.float32)
    with open(path, "rb") as fh:
        got = _decode_rgb(fh.read(), 1000)  # no reduced-size decode: compare at full size
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.abs(got.astype(np.float32) - ref).mean() < 3


def test_exif_orientation_of_a_png_and_of_a_reduced_jpeg_decode(tmp_path, jpeg_path):
    from mmpipe.data.decode import load_image
    for fmt, name in (("PNG", "o.png"), ("JPEG", "o.jpg")):
        path = _with_orientation(tmp_path / name, 6, fmt)
        x = load_image(path, 8)  # the JPEG is decoded at a reduced size, then oriented
        # rotated 90 degrees clockwise: the top-left quadrant (red) is now top-right
        top_right = x[:, 1, 6].tolist()
        assert top_right[0] > 200 and top_right[1] < 60 and top_right[2] < 60, (fmt, top_right)
        bottom_left = x[:, 6, 1].tolist()  # yellow (bottom-right) moved to bottom-left
        assert bottom_left[0] > 200 and bottom_left[1] > 200 and bottom_left[2] < 60, (fmt, bottom_left)


def test_huge_images_are_refused_before_decoding(tmp_path, monkeypatch, jpeg_path):
    """A header declaring more pixels than the limit is a bad sample, named, before any pixel is
    decoded: no traceback (Pillow's DecompressionBombError), no warning, no gigabytes."""
    from mmpipe.data import decode as loader
    from mmpipe.data.decode import decode_sample
    cases = {}
    # a PNG whose header declares 100000 x 100000 (Pillow alone raises DecompressionBombError)
    (tmp_path / "bomb.png").write_bytes(_png_bytes(100_000, 100_000, 1, 0, b"\0" * 64))
    cases["bomb.png"] = "100000 x 100000"  # (Pillow refuses it in open: then only the pixel count is known)
    # a valid 1-bit PNG of 10000 x 9000 (90 Mpx: Pillow only warns, then decodes 270 MB of RGB)
    (tmp_path / "big.png").write_bytes(_png_bytes(10_000, 9_000, 1, 0, (b"\0" + b"\0" * 1250) * 9000))
    cases["big.png"] = "10000 x 9000"
    # a small JPEG whose frame header is patched to claim 10000 x 10000
    Image.new("RGB", (16, 16), (1, 2, 3)).save(tmp_path / "small.jpg", quality=90)
    data = bytearray((tmp_path / "small.jpg").read_bytes())
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", 10_000, 10_000)
    (tmp_path / "claims_huge.jpg").write_bytes(bytes(data))
    cases["claims_huge.jpg"] = "10000 x 10000"
    if loader.simplejpeg is not None:  # decoding must not even start
        monkeypatch.setattr(loader.simplejpeg, "decode_jpeg", lambda *a, **k: pytest.fail("decoded a huge JPEG"))
    for name, dims in cases.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # Pillow's DecompressionBombWarning must not escape
            pixels, why = decode_sample(str(tmp_path / name), "a caption", 16)
        expect = {f"too large to decode safely ({dims} pixels > 89478485)"}
        if name == "bomb.png":
            expect.add("too large to decode safely (10000000000 pixels > 89478485)")
        assert pixels is None and why in expect, (name, why)


def test_the_pixel_limit_is_a_module_constant(tmp_path, monkeypatch, jpeg_path):
    from mmpipe.data import decode as loader
    Image.new("RGB", (64, 48), (9, 9, 9)).save(tmp_path / "a.jpg")
    Image.new("RGB", (64, 48), (9, 9, 9)).save(tmp_path / "a.png")
    monkeypatch.setattr(loader, "MAX_PIXELS", 64 * 48 - 1)
    for name in ("a.jpg", "a.png"):
        pixels, why = loader.decode_sample(str(tmp_path / name), "x", 16)
        assert pixels is None and why == "too large to decode safely (64 x 48 pixels > 3071)", why
    monkeypatch.setattr(loader, "MAX_PIXELS", 64 * 48)
    assert loader.decode_sample(str(tmp_path / "a.jpg"), "x", 16)[1] is None


# ---- manifests ----------------------------------------------------------------------------------
def test_csv_quoting_bom_and_real_line_numbers(tmp_path):
    """Excel-style CSV: UTF-8 BOM, CRLF, quoted commas, doubled quotes and a quoted newline; each
    row named by the line it starts on. An unquoted comma (3 fields) or broken quoting is one bad row."""
    from mmpipe.data.manifest import read_manifest
    Image.new("RGB", (8, 8)).save(tmp_path / "a.jpg")
    rows = ['image, caption',                 # 1 (header; the space is tolerated)
            'a.jpg,"red, with a comma"',      # 2
            'a.jpg,"she said ""hi"""',        # 3
            'a.jpg,"two\r\nlines"',           # 4-5
            'a.jpg,unquoted, comma',          # 6 bad: 3 fields
            '',                               # 7 blank
            'a.jpg,"après-midi, ünïcode"',    # 8
            ',no image',                      # 9 bad: empty image path
            'a.jpg,"bad"quote',               # 10 bad: broken quoting
            'a.jpg,last']                     # 11
    path = tmp_path / "m.csv"
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(rows).encode("utf-8") + b"\r\n")
    samples = read_manifest(str(path))
    good = [(s.line, s.text) for s in samples if s.error is None]
    assert good == [(2, "red, with a comma"), (3, 'she said "hi"'), (4, "two\r\nlines"),
                    (8, "après-midi, ünïcode"), (11, "last")]
    assert all(s.image == str(tmp_path / "a.jpg") for s in samples if s.error is None)
    bad = {s.line: s.error for s in samples if s.error is not None}
    assert sorted(bad) == [6, 9, 10], bad
    assert "3 fields" in bad[6] and "header has 2" in bad[6] and "quote" in bad[6]
    assert bad[9] == "empty image path"
    assert "quoting" in bad[10]


def test_utf16_tsv_from_a_spreadsheet(tmp_path):
    """Excel's "Unicode text" export: UTF-16 with a BOM, tab separated."""
    from mmpipe.data.manifest import read_manifest
    path = tmp_path / "m.tsv"
    path.write_bytes("image\ttext\r\na.jpg\tcafé au lait, 2 cups\r\nb.jpg\t\"quoted\ttab\"\r\n".encode("utf-16"))
    assert [(s.line, s.text) for s in read_manifest(str(path))] == [(2, "café au lait, 2 cups"), (3, "quoted\ttab")]


def test_a_manifest_that_is_not_utf8_is_one_line_naming_the_line(tmp_path, capsys):
    from mmpipe.cli.main import main
    from mmpipe.data.manifest import read_manifest
    path = tmp_path / "latin1.csv"
    path.write_bytes("image,text\na.jpg,plain\na.jpg,café crème\n".encode("latin-1"))
    with pytest.raises(DataError) as e:
        read_manifest(str(path))
    msg = str(e.value)
    assert f"{path} line 3" in msg and "UTF-8" in msg and "\n" not in msg
    assert main(["data", "check", "--manifest", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mmpipe: error: ") and f"{path} line 3" in err[0]


def test_an_unclosed_quote_is_one_line_not_a_swallowed_file(tmp_path):
    """Without this, the csv module reads every following line into one caption."""
    from mmpipe.data.manifest import read_manifest
    path = tmp_path / "m.csv"
    path.write_text('image,text\na.jpg,fine\na.jpg,"never closed\na.jpg,next\na.jpg,and more\n')
    with pytest.raises(DataError, match=rf"{path} line 3: .*quote"):
        read_manifest(str(path))


def test_a_header_without_an_image_column_is_one_line(tmp_path):
    from mmpipe.data.manifest import read_manifest
    path = tmp_path / "m.csv"
    path.write_text("path,text\na.jpg,x\n")
    with pytest.raises(DataError, match=rf"{path} line 1: .*no image column .*image, image_path"):
        read_manifest(str(path))


JSONL_ROWS = [
    '{"image": "a.jpg", "text": "a red square"}',                         # 1 ok
    '',                                                                   # 2 blank: skipped
    '{"image": "a.jpg", "caption": ["", "first real caption", "second"]}',  # 3 ok: COCO-style list
    'not json {',                                                         # 4
    '["a.jpg", "a list"]',                                                # 5
    '"just a string"',                                                    # 6
    '42',                                                                 # 7
    '{"image": "a.jpg"}',                                                 # 8
    '{"text": "no image"}',                                               # 9
    '{"image": "a.jpg", "text": 1984}',                                   # 10
    '{"image": "a.jpg", "text": true}',                                   # 11
    '{"image": "a.jpg", "text": null}',                                   # 12
    '{"image": "a.jpg", "text": {"en": "x"}}',                            # 13
    '{"image": 7, "text": "x"}',                                          # 14
    json.dumps({"image": "a.jpg", "text": "line\u2028sep, ünïcode"}, ensure_ascii=False),  # 15 ok: raw U+2028
    '{"image_path": "a.jpg", "title": "  padded  "}',                     # 16 ok
    '{"image": "a.jpg", "text": ["x", 3]}',                               # 17
]
JSONL_BAD = {4: "not valid JSON", 5: "row is a list, expected an object", 6: "row is a string, expected an object",
             7: "row is a number, expected an object", 8: "no caption field (expected one of text, caption, title)",
             9: "no image field (expected one of image, image_path, file, filepath)",
             10: "caption is a number, expected text", 11: "caption is a boolean, expected text",
             12: "caption is null, expected text", 13: "caption is an object, expected text",
             14: "image is a number, expected a file path", 17: "caption list holds a number, expected text"}


def test_jsonl_rows_of_the_wrong_type_or_shape_are_bad_rows(tmp_path):
    from mmpipe.data.manifest import read_manifest
    path = _jsonl(tmp_path / "m.jsonl", JSONL_ROWS)
    samples = read_manifest(path)
    assert len(samples) == 16  # every non-blank line, bad ones included (they count against the limit)
    assert [(s.line, s.text) for s in samples if s.error is None] == [
        (1, "a red square"), (3, "first real caption"), (15, "line\u2028sep, ünïcode"), (16, "  padded  ")]
    bad = {s.line: s.error for s in samples if s.error is not None}
    assert sorted(bad) == sorted(JSONL_BAD)
    for line, why in JSONL_BAD.items():
        assert bad[line].startswith(why), (line, bad[line])
        assert "\n" not in bad[line]


def test_bad_rows_are_substituted_counted_and_cached_alike(tmp_path):
    """A bad row flows through the bad-sample path like an unreadable image: replaced by the next
    usable row, reported as "FILE line N", and flagged the same way in a prepared cache."""
    from mmpipe.data.cache import CachedDataset, prepare
    from mmpipe.data.loader import ImageTextDataset
    from mmpipe.data.manifest import read_manifest
    Image.new("RGB", (20, 20), (0, 128, 0)).save(tmp_path / "a.jpg")
    path = _jsonl(tmp_path / "m.jsonl", JSONL_ROWS)
    samples = read_manifest(path)
    ds = ImageTextDataset(samples, SquarePixels(16))
    i4 = next(i for i, s in enumerate(samples) if s.line == 4)
    item = ds[i4]
    assert item["text"] == "line\u2028sep, ünïcode"  # the next usable row (line 15) stands in
    assert [p for p, _ in item["bad"]] == [f"{path} line {n}" for n in (4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14)]
    assert item["bad"][0][1].startswith("not valid JSON")
    out = str(tmp_path / "cache")
    r = prepare(path, out, 16, 16, workers=1, progress=False)
    assert r["bad"] == len(JSONL_BAD) and r["ok"] == 4 and r["remaining"] == 0
    cached = CachedDataset(out, SquarePixels(16))
    for i in range(len(samples)):
        assert cached[i]["bad"] == ds[i]["bad"] and cached[i]["index"] == ds[i]["index"]


def test_a_manifest_with_no_usable_row_is_one_line(tmp_path):
    from mmpipe.data.manifest import read_manifest
    path = _jsonl(tmp_path / "m.jsonl", ["5", '["a.jpg"]', '{"image": "a.jpg", "text": 3}'])
    with pytest.raises(DataError) as e:
        read_manifest(path, "data.train")
    msg = str(e.value)
    assert "no usable row" in msg and f"{path} line 1: row is a number" in msg and "\n" not in msg


# ---- mmpipe data check --------------------------------------------------------------------------
def _check_corpus(tmp_path):
    imgs = make_images(tmp_path)
    _with_orientation(tmp_path / "rot6.jpg", 6)
    (tmp_path / "bomb.png").write_bytes(_png_bytes(100_000, 100_000, 1, 0, b"\0" * 64))
    lines = [json.dumps({"image": f"{n}.{p.rsplit('.', 1)[1]}", "text": f"a {n}"}) for n, (p, *_) in imgs.items()]
    lines += [json.dumps({"image": "rot6.jpg", "caption": ["", "rotated"]}),
              json.dumps({"image": "missing.jpg", "text": "gone"}),
              json.dumps({"image": "bomb.png", "text": "huge"}),
              '{"image": "rgb_jpeg.jpeg", "text": 5}']
    return imgs, _jsonl(tmp_path / "m.jsonl", lines)


def test_data_check_json_reports_every_row_as_training_reads_it(tmp_path, capsys):
    from mmpipe.cli.main import main
    imgs, manifest = _check_corpus(tmp_path)
    rc = main(["data", "check", "--manifest", manifest, "--json", "--workers", "1", "--set", "data.decode_size=16"])
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    n = len(imgs) + 4
    assert len(rows) == n and [r["line"] for r in rows] == list(range(1, n + 1))
    for r, (name, (path, mode, mean, tol)) in zip(rows, imgs.items()):
        assert r["status"] == "ok" and r["why"] is None and r["text"] == f"a {name}" and r["image"] == path
        assert (r["width"], r["height"], r["mode"]) == (32, 32, mode), r
        assert abs(r["mean"] - sum(mean) / 3) < tol, (name, r["mean"], mean)
    rot, missing, bomb, badrow = rows[len(imgs):]
    assert rot["status"] == "ok" and rot["text"] == "rotated" and (rot["width"], rot["height"]) == (32, 48)
    assert missing == {"line": len(imgs) + 2, "image": str(tmp_path / "missing.jpg"), "text": "gone",
                       "status": "bad", "why": "missing file", "width": None, "height": None, "mode": None,
                       "mean": None}
    assert bomb["status"] == "bad" and bomb["why"].startswith("too large to decode safely (")
    assert badrow["status"] == "bad" and badrow["why"] == "caption is a number, expected text"
    # 3 of 16 unusable (18.8%) is over the default data.max_bad_fraction=0.05: exit status 1, one line
    assert rc == 1
    errs = [line for line in err.splitlines() if line.startswith("mmpipe: error:")]
    assert len(errs) == 1 and "data.max_bad_fraction=0.05" in errs[0] and "3 of 16" in errs[0]
    # a pool of workers reports exactly the same
    main(["data", "check", "--manifest", manifest, "--json", "--workers", "2", "--set", "data.decode_size=16"])
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == rows


def test_data_check_human_report_and_limit_from_the_config(tmp_path, capsys):
    from mmpipe.cli.main import main
    imgs, manifest = _check_corpus(tmp_path)
    cfg = tmp_path / "run.yaml"
    cfg.write_text("data:\n  max_bad_fraction: 0.2\n")
    rc = main(["data", "check", "--manifest", manifest, "--config", str(cfg), "--workers", "1"])
    out = capsys.readouterr().out.splitlines()
    k = len(imgs)
    assert rc == 0, out
    assert f"{manifest}: 16 rows, 13 usable, 3 unusable (18.8%)" in out
    assert f"{manifest} line {k + 2}: {tmp_path / 'missing.jpg'}: missing file" in out
    assert any(line.startswith(f"{manifest} line {k + 3}: {tmp_path / 'bomb.png'}: too large to decode safely")
               for line in out)
    assert f"{manifest} line {k + 4}: caption is a number, expected text" in out
    assert len(out) == 4
