"""Image preprocessing (spec section 8): modes, EXIF, limits, padding, patch layout, and the
bad-image matrix (each bad input gives one ImageError naming the file and the problem)."""

from __future__ import annotations

import io
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from engine.errors import ImageError, InputError
from engine.vision import fit_to_limits, open_image, preprocess_image


def _png_bytes(im: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG", **kw)
    return buf.getvalue()


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height, with one tiny IDAT: decoding it would be a bomb."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def _photo(width: int = 64, height: int = 40) -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


# ---- the bad-image matrix ----------------------------------------------------------------------

def _bad_not_image(d: Path) -> Path:
    (d / "notes.png").write_text("this is a text file, not a picture\n")
    return d / "notes.png"


def _bad_empty(d: Path) -> Path:
    (d / "empty.png").write_bytes(b"")
    return d / "empty.png"


def _bad_truncated_png(d: Path) -> Path:
    data = _png_bytes(_photo(200, 200))
    (d / "cut.png").write_bytes(data[: len(data) // 2])
    return d / "cut.png"


def _bad_truncated_jpeg(d: Path) -> Path:
    buf = io.BytesIO()
    _photo(200, 200).save(buf, format="JPEG", quality=90)
    (d / "cut.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 3])
    return d / "cut.jpg"


def _bad_corrupt_header(d: Path) -> Path:
    data = bytearray(_png_bytes(_photo()))
    data[16:24] = b"\xff" * 8  # IHDR width/height bytes -> CRC mismatch
    (d / "corrupt.png").write_bytes(bytes(data))
    return d / "corrupt.png"


def _bad_corrupt_data(d: Path) -> Path:
    data = bytearray(_png_bytes(_photo(100, 100)))
    idat = data.index(b"IDAT")
    for i in range(idat + 8, min(len(data) - 20, idat + 400)):
        data[i] ^= 0x5A
    (d / "garbled.png").write_bytes(bytes(data))
    return d / "garbled.png"


def _bad_zero_sized(d: Path) -> Path:
    (d / "zero.png").write_bytes(_png_header_only(0, 10))
    return d / "zero.png"


def _bad_one_pixel(d: Path) -> Path:
    Image.new("RGB", (1, 1), (255, 0, 0)).save(d / "dot.png")
    return d / "dot.png"


def _bad_one_pixel_tall(d: Path) -> Path:
    Image.new("RGB", (300, 1)).save(d / "line.png")
    return d / "line.png"


def _bad_bomb(d: Path) -> Path:
    (d / "bomb.png").write_bytes(_png_header_only(40000, 40000))  # 1.6 G pixels from a 60-byte file
    return d / "bomb.png"


def _bad_directory(d: Path) -> Path:
    (d / "photos.png").mkdir()
    return d / "photos.png"


def _bad_fifo(d: Path) -> Path:
    os.mkfifo(d / "pipe.png")  # opening it would block forever: it must never be opened
    return d / "pipe.png"


def _bad_missing(d: Path) -> Path:
    return d / "nowhere.png"


def _bad_gif_garbage(d: Path) -> Path:
    (d / "fake.gif").write_bytes(b"GIF89a" + b"\x00" * 3)
    return d / "fake.gif"


BAD_IMAGES = {
    "not_an_image": (_bad_not_image, "not an image"),
    "empty_file": (_bad_empty, "empty"),
    "truncated_png": (_bad_truncated_png, "truncated|corrupt"),
    "truncated_jpeg": (_bad_truncated_jpeg, "truncated|corrupt"),
    "corrupt_header": (_bad_corrupt_header, "corrupt|not an image"),
    "corrupt_data": (_bad_corrupt_data, "corrupt|truncated"),
    "zero_sized": (_bad_zero_sized, r"zero-sized image \(0x10"),
    "one_by_one": (_bad_one_pixel, r"1x1 pixels"),
    "one_pixel_tall": (_bad_one_pixel_tall, r"300x1 pixels"),
    "decompression_bomb": (_bad_bomb, "decompression-bomb"),
    "directory": (_bad_directory, "is a directory"),
    "fifo": (_bad_fifo, "not a regular file"),
    "missing": (_bad_missing, "no such file"),
    "gif_garbage": (_bad_gif_garbage, "corrupt GIF header"),
}


@pytest.mark.timeout(20)  # a FIFO that got opened would hang here
@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_bad_image_gives_one_clear_error(case, tmp_path):
    make, message = BAD_IMAGES[case]
    path = make(tmp_path)
    with pytest.raises(ImageError, match=message) as info:
        preprocess_image(path)
    err = info.value
    assert str(err).startswith(str(path) + ":"), str(err)  # names the file first
    assert isinstance(err, InputError)  # the CLI prints InputError messages without a traceback
    assert err.__cause__ is None and "\n" not in str(err)


def test_bomb_is_refused_from_the_header_before_decoding(tmp_path, monkeypatch):
    path = _bad_bomb(tmp_path)
    loaded = []
    monkeypatch.setattr(Image.Image, "load", lambda self: loaded.append(1))
    with pytest.raises(ImageError, match="nothing was decoded"):
        open_image(path)
    assert not loaded


def test_bomb_limit_is_a_parameter():
    data = _png_bytes(_photo(100, 100))
    with pytest.raises(ImageError, match="exceeds the limit of 5,000"):
        preprocess_image(data, name="upload.png", max_pixels=5000)
    assert preprocess_image(data, max_pixels=10000).grid == (8, 8)


def test_zero_sized_pil_image():
    with pytest.raises(ImageError, match=r"^pasted: zero-sized image \(0x5\)"):
        preprocess_image(Image.new("RGB", (0, 5)), name="pasted")


def test_bytes_and_names_in_errors():
    with pytest.raises(ImageError, match=r"^upload\.bin: not an image"):
        preprocess_image(b"\x00\x01garbage", name="upload.bin")
    with pytest.raises(ImageError, match="empty data"):
        preprocess_image(b"")


# ---- modes, orientation, frames -----------------------------------------------------------------

def _rgb_of(im: Image.Image) -> np.ndarray:
    p = preprocess_image(im)
    h, w = p.resized_size[1], p.resized_size[0]
    grid_h, grid_w = p.grid
    x = p.pixel_values.reshape(grid_h, grid_w, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, grid_h * 14, grid_w * 14)
    return ((x[:, :h, :w] * 0.5 + 0.5) * 255).round().permute(1, 2, 0).numpy().astype(np.int64)


def test_rgba_is_composited_on_white():
    im = Image.new("RGBA", (30, 20), (200, 0, 0, 0))  # fully transparent red
    im.putpixel((0, 0), (200, 0, 0, 255))
    im.putpixel((1, 0), (0, 0, 200, 128))
    rgb = _rgb_of(im)
    assert (rgb[5, 5] == 255).all()  # transparent -> white
    assert rgb[0, 0].tolist() == [200, 0, 0]
    assert abs(rgb[0, 1, 0] - 127) <= 1 and abs(rgb[0, 1, 2] - 227) <= 1  # half over white


def test_palette_with_transparency_grey_cmyk_and_16_bit():
    pal = Image.new("P", (20, 20), 0)
    pal.putpalette([10, 20, 30] + [0, 0, 0] * 255)
    pal.info["transparency"] = 0
    assert (_rgb_of(pal) == 255).all()
    pal.info.pop("transparency")
    assert _rgb_of(pal)[3, 3].tolist() == [10, 20, 30]
    assert _rgb_of(Image.new("L", (20, 20), 77))[0, 0].tolist() == [77, 77, 77]
    assert _rgb_of(Image.new("1", (20, 20), 1))[0, 0].tolist() == [255, 255, 255]
    assert _rgb_of(Image.new("CMYK", (20, 20), (0, 0, 0, 0)))[0, 0].tolist() == [255, 255, 255]
    sixteen = Image.fromarray(np.full((20, 20), 128 * 257, dtype=np.uint16))
    assert sixteen.mode.startswith("I;16")
    assert _rgb_of(sixteen)[0, 0].tolist() == [128, 128, 128]
    la = Image.new("LA", (20, 20), (0, 0))
    assert (_rgb_of(la) == 255).all()


def test_16_bit_png_file_round_trip(tmp_path):
    arr = np.linspace(0, 65535, 40 * 30).reshape(30, 40).astype(np.uint16)
    Image.fromarray(arr).save(tmp_path / "deep.png")
    rgb = _rgb_of(Image.open(tmp_path / "deep.png"))
    assert rgb[0, 0, 0] == 0 and rgb[-1, -1, 0] == 255


def test_exif_orientation_is_applied(tmp_path):
    im = Image.new("RGB", (40, 20), (0, 0, 0))
    im.paste((255, 0, 0), (0, 0, 10, 20))  # red strip on the left
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    im.save(tmp_path / "rot.jpg", exif=exif, quality=95)
    p = preprocess_image(tmp_path / "rot.jpg")
    assert p.original_size == (20, 40)  # displayed width x height
    rgb = _rgb_of(Image.open(tmp_path / "rot.jpg"))
    assert rgb[2, 10, 0] > 200 and rgb[-3, 10, 0] < 60  # the strip now runs along the top


def test_animated_gif_uses_the_first_frame(tmp_path):
    frames = [Image.new("RGB", (30, 30), c) for c in ((255, 0, 0), (0, 0, 255))]
    frames[0].save(tmp_path / "anim.gif", save_all=True, append_images=frames[1:], duration=100, loop=0)
    p = preprocess_image(tmp_path / "anim.gif")
    assert p.frames == 2
    rgb = _rgb_of(Image.open(tmp_path / "anim.gif"))
    assert rgb[5, 5, 0] > 200 and rgb[5, 5, 2] < 50


# ---- limits, padding, layout --------------------------------------------------------------------

@pytest.mark.parametrize("size, expected", [
    ((896, 896), (896, 896)),  # within the limits: untouched
    ((3840, 2160), (3840, 2160)),  # 274 x 154 patches < 65536: untouched (~42K patches)
    ((8000, 1000), (7168, 896)),  # per-side limit 512 x 14 = 7168 px
    ((5000, 5000), (3557, 3557)),  # total limit: sqrt(65536 / 357^2) gives 3585 px = 258 padded
    # patches a side, too many; the padded count tightens it to 3557 px (256 x 256 padded patches)
    ((4000, 3000), (4000, 3000)),  # 285 x 214 patches: within the limits
    ((6000, 4000), (4357, 2904)),
])
def test_fit_to_limits(size, expected):
    assert fit_to_limits(*size) == expected
    w, h = fit_to_limits(*size)
    assert (-(-h // 28) * 2) * (-(-w // 28) * 2) <= 65536


def test_large_image_is_downscaled_bicubic_keeping_the_aspect():
    big = Image.new("RGB", (1400, 700), (0, 128, 255))
    p = preprocess_image(big, max_patches=1024)
    w, h = p.resized_size
    assert p.original_size == (1400, 700)
    assert abs(w / h - 2.0) < 0.02 and p.num_patches <= 1024
    assert p.grid == (-(-h // 28) * 2, -(-w // 28) * 2)


def test_padding_is_minus_one_and_patches_are_row_major():
    arr = np.zeros((30, 45, 3), dtype=np.uint8)
    for r in range(30):
        for c in range(45):
            arr[r, c] = ((r * 7) % 256, (c * 5) % 256, 99)
    p = preprocess_image(Image.fromarray(arr, "RGB"))
    assert p.grid == (4, 4) and p.pixel_values.shape == (16, 3, 14, 14)
    # patch (row 1, col 2) = pixels rows 14..27, cols 28..41
    patch = p.pixel_values[1 * 4 + 2]
    expected = (torch.from_numpy(arr[14:28, 28:42]).permute(2, 0, 1).float() / 255 - 0.5) / 0.5
    assert torch.equal(patch, expected)
    assert (p.pixel_values[-1] == -1).all()  # rows 42..55 x cols 42..55: all padding
    # patch (2, 3) = rows 28..41 x cols 42..55: padding except its top-left 2 x 3 corner
    last = p.pixel_values[2 * 4 + 3]
    assert (last[:, 2:, :] == -1).all() and (last[:, :, 3:] == -1).all()
    assert (last[2, :2, :3] == (torch.tensor(99.0) / 255 - 0.5) / 0.5).all()
    assert p.pixel_values.min() >= -1 and p.pixel_values.max() <= 1


def test_hash_depends_on_pixels_not_on_the_container(tmp_path):
    im = _photo()
    im.save(tmp_path / "a.png")
    im.save(tmp_path / "b.webp", lossless=True)
    a, b = preprocess_image(tmp_path / "a.png"), preprocess_image(tmp_path / "b.webp")
    assert a.sha256 == b.sha256 == preprocess_image(im).sha256
    assert preprocess_image(_photo(64, 41)).sha256 != a.sha256
