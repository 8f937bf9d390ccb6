"""Image preprocessing for the MoonViT-V2 tower with Pillow (spec section 8).

- `open_image`: checks the source (a regular file, never a FIFO or directory), reads the header
  and refuses a zero-sized, 1-pixel-wide/tall or decompression-bomb image *before* decoding any
  pixel, then decodes, applies EXIF orientation and converts every mode to 8-bit RGB (alpha
  composited on white; palette, grey, CMYK, 16-bit and float modes scaled to 8 bits).
  Animated images (GIF, APNG, WebP) use their first frame only.
- `fit_to_limits`: the downscale rule (at most `max_patches` patches in all and `max_per_side`
  per side, aspect ratio kept, sizes truncated with `int()`).
- `preprocess_image`: the whole pipeline -> `ProcessedImage` with `pixel_values [P, 3, 14, 14]`
  (row-major patches), the patch grid (h, w), the original size and a hash of the pixels.

Every failure is one `ImageError` whose message starts with the image's name.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from engine.errors import ImageError

# refuse images above this many pixels from the header alone (PIL's own bomb error is at 179M)
MAX_IMAGE_PIXELS = 100_000_000
_BAND_PIXELS = 1 << 20  # pixels converted or hashed at a time (a band of whole rows)
MAX_PATCHES = 65536
MAX_PATCHES_PER_SIDE = 512
MIN_SIDE = 2

ImageSource = Union[str, Path, bytes, Image.Image]


@dataclass(frozen=True)
class ProcessedImage:
    """One image ready for the tower.

    Attributes:
        pixel_values: `[P, 3, patch, patch]` fp32 in [-1, 1], patches row-major over `grid`.
        grid: (h, w) in patches, both multiples of the merge kernel.
        original_size: (W, H) after EXIF orientation: the size the prompt text names.
        resized_size: (W, H) after the downscale, before padding.
        sha256: hash of the 8-bit RGB pixels and their size (the same picture hashes the same
            whatever file format carried it).
        name: what error messages and segments call the image.
        frames: frames in the source (> 1: animated, only the first was used).
        thumbnail: the oriented RGB picture scaled to fit `thumbnail` px (when asked for), for
            viewers that must never receive the full-resolution pixels.
    """

    pixel_values: torch.Tensor
    grid: tuple[int, int]
    original_size: tuple[int, int]
    resized_size: tuple[int, int]
    sha256: str
    name: str
    frames: int = 1
    thumbnail: Image.Image | None = None

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]


def _name_of(source: ImageSource, name: str | None) -> str:
    if name is not None:
        return name
    if isinstance(source, (str, Path)):
        return str(source)
    if isinstance(source, bytes):
        return "<image bytes>"
    return getattr(source, "filename", "") or "<PIL image>"


def _check_path(path: Path, name: str) -> None:
    """A regular file or nothing: opening a FIFO would block forever, a directory cannot be read."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ImageError(f"{name}: no such file") from None
    except OSError as exc:
        raise ImageError(f"{name}: cannot read ({exc.strerror or exc})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ImageError(f"{name}: is a directory, not an image file")
    if not stat.S_ISREG(st.st_mode):
        raise ImageError(f"{name}: not a regular file (a FIFO, socket or device); refusing to read it")
    if st.st_size == 0:
        raise ImageError(f"{name}: empty file, not an image")


def _check_size(width: int, height: int, name: str, max_pixels: int) -> None:
    if width <= 0 or height <= 0:
        raise ImageError(f"{name}: zero-sized image ({width}x{height})")
    if width < MIN_SIDE or height < MIN_SIDE:
        raise ImageError(f"{name}: image is {width}x{height} pixels; at least {MIN_SIDE}x{MIN_SIDE} is needed")
    if width * height > max_pixels:
        raise ImageError(f"{name}: {width}x{height} = {width * height:,} pixels exceeds the limit of "
                         f"{max_pixels:,} (decompression-bomb guard; nothing was decoded)")


def _grey_to_8bit(arr: np.ndarray, scale: float) -> Image.Image:
    """A grey image of any numeric type scaled by `scale` into 8 bits, a band of rows at a time: the
    float64 temporaries of the whole image would take 8 bytes per pixel, several times over."""
    out = np.empty(arr.shape, np.uint8)
    rows = max(1, _BAND_PIXELS // max(arr.shape[1], 1))
    for top in range(0, arr.shape[0], rows):
        band = np.nan_to_num(arr[top:top + rows].astype(np.float64)) * scale
        out[top:top + rows] = np.clip(np.rint(band), 0, 255)
    return Image.fromarray(out, "L")


def _pixel_digest(im: Image.Image) -> str:
    """sha256 of the size and the RGB bytes of `im`, read a band of rows at a time (the same digest as
    hashing `im.tobytes()` whole, without a second copy of the image)."""
    digest = hashlib.sha256(f"{im.width}x{im.height}:".encode())
    rows = max(1, _BAND_PIXELS // max(im.width, 1))
    for top in range(0, im.height, rows):
        digest.update(im.crop((0, top, im.width, min(top + rows, im.height))).tobytes())
    return digest.hexdigest()


def _to_rgb8(im: Image.Image, name: str) -> Image.Image:
    """Any Pillow mode -> 8-bit RGB; transparency is composited on white."""
    mode = im.mode
    if mode == "P":
        im = im.convert("RGBA" if "transparency" in im.info else "RGB")
    elif mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        # 16-bit (and 32-bit int) grey: scale the 16-bit range to 8 bits
        im = _grey_to_8bit(np.asarray(im), 1 / 257.0)
    elif mode == "F":
        arr = np.asarray(im)
        scale = 255.0 if np.nanmax(arr, initial=0.0) <= 1.0 else 1.0  # [0, 1] floats or 8-bit-range floats
        im = _grey_to_8bit(arr, scale)
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        im = Image.alpha_composite(white, rgba)
    if im.mode != "RGB":
        try:
            im = im.convert("RGB")
        except (ValueError, OSError) as exc:
            raise ImageError(f"{name}: cannot convert image mode {mode!r} to RGB ({exc})") from None
    return im


_SIGNATURES = {b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG", b"GIF87a": "GIF", b"GIF89a": "GIF",
               b"BM": "BMP", b"II*\x00": "TIFF", b"MM\x00*": "TIFF"}


def _why_unreadable(opener: object) -> str:
    """Pillow found no format: say whether the bytes at least start like a known image."""
    try:
        if isinstance(opener, io.BytesIO):
            head = opener.getvalue()[:32]
        else:
            with open(str(opener), "rb") as f:
                head = f.read(32)
    except OSError:
        head = b""
    kind = next((k for sig, k in _SIGNATURES.items() if head.startswith(sig)), None)
    if kind is None and head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        kind = "WebP"
    if kind is None:
        return "not an image (Pillow recognises no image format in it)"
    if kind == "PNG" and head[12:16] == b"IHDR":
        width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
        if width == 0 or height == 0:
            return f"zero-sized image ({width}x{height} in the PNG header)"
    return f"corrupt {kind} header (the file starts like a {kind} but Pillow cannot read it)"


def open_image(source: ImageSource, *, name: str | None = None,
               max_pixels: int = MAX_IMAGE_PIXELS) -> tuple[Image.Image, int]:
    """Decode `source` to an oriented 8-bit RGB image; returns it and the source's frame count.

    Raises:
        ImageError: naming the image and the problem (see the module docstring).
    """
    label = _name_of(source, name)
    if isinstance(source, Image.Image):
        return _decode(source, label, max_pixels)
    if isinstance(source, (str, Path)):
        _check_path(Path(source), label)
        opener: object = str(source)
    elif isinstance(source, bytes):
        if not source:
            raise ImageError(f"{label}: empty data, not an image")
        opener = io.BytesIO(source)
    else:
        raise ImageError(f"{label}: expected a path, bytes or a PIL image, got {type(source).__name__}")
    try:
        with warnings.catch_warnings():
            # our own limit below is stricter than Pillow's warning threshold
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(opener)  # reads the header only
    except Image.DecompressionBombError as exc:
        raise ImageError(f"{label}: too large ({exc}); decompression-bomb guard, nothing was decoded") from None
    except Image.UnidentifiedImageError:
        raise ImageError(f"{label}: {_why_unreadable(opener)}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageError(f"{label}: corrupt image header ({exc})") from None
    with im:  # the decoded copy outlives the file handle Pillow keeps for lazy (and animated) images
        return _decode(im, label, max_pixels)


def _decode(im: Image.Image, label: str, max_pixels: int) -> tuple[Image.Image, int]:
    _check_size(im.width, im.height, label, max_pixels)
    frames = int(getattr(im, "n_frames", 1) or 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            if frames > 1:
                im.seek(0)
            im.load()
            im = ImageOps.exif_transpose(im)
    except ImageError:
        raise
    except OSError as exc:
        kind = "truncated" if "truncated" in str(exc).lower() else "corrupt"
        raise ImageError(f"{label}: {kind} image data ({exc})") from None
    except (SyntaxError, ValueError, EOFError, IndexError, TypeError, KeyError, ZeroDivisionError) as exc:
        raise ImageError(f"{label}: corrupt image data ({type(exc).__name__}: {exc})") from None
    _check_size(im.width, im.height, label, max_pixels)  # EXIF rotation swaps sides only
    return _to_rgb8(im, label), frames


def _padded_grid(width: int, height: int, patch: int, merge: tuple[int, int]) -> tuple[int, int]:
    """(h, w) patches after zero-padding right/bottom to multiples of patch x merge."""
    fh, fw = patch * merge[0], patch * merge[1]
    return -(-height // fh) * merge[0], -(-width // fw) * merge[1]


def fit_to_limits(width: int, height: int, *, patch: int = 14, merge: tuple[int, int] = (2, 2),
                  max_patches: int = MAX_PATCHES, max_per_side: int = MAX_PATCHES_PER_SIDE) -> tuple[int, int]:
    """(W, H) to resize to: unchanged when within the limits, else scaled down keeping the aspect.

    The scale is the most restrictive of sqrt(max_patches / patches) and max_per_side * patch / side
    (patches counted as floor(side / patch), never below 1), never above 1; sizes are truncated
    with `int()`. When padding to whole merge windows would still exceed `max_patches`, the scale
    is tightened by the padded count until the padded grid fits.
    """
    n_h, n_w = max(1, height // patch), max(1, width // patch)
    scale = min(1.0, math.sqrt(max_patches / (n_h * n_w)),
                max_per_side * patch / height, max_per_side * patch / width)
    side_cap = max_per_side * patch
    for _ in range(64):
        new_w = min(max(1, int(width * scale)), side_cap)
        new_h = min(max(1, int(height * scale)), side_cap)
        gh, gw = _padded_grid(new_w, new_h, patch, merge)
        if gh * gw <= max_patches and gh <= max_per_side and gw <= max_per_side:
            return new_w, new_h
        scale *= min(0.999, math.sqrt(max_patches / (gh * gw)))
    raise ImageError(f"cannot fit a {width}x{height} image into {max_patches} patches")  # limits too small


def patchify(image: torch.Tensor, patch: int) -> torch.Tensor:
    """`[3, H, W]` (H, W multiples of `patch`) -> `[h * w, 3, patch, patch]`, row-major patches."""
    c, H, W = image.shape
    h, w = H // patch, W // patch
    x = image.reshape(c, h, patch, w, patch)  # [3, h, p, w, p]
    return x.permute(1, 3, 0, 2, 4).reshape(h * w, c, patch, patch)


def preprocess_image(source: ImageSource, *, name: str | None = None, patch: int = 14,
                     merge: tuple[int, int] = (2, 2), max_patches: int = MAX_PATCHES,
                     max_per_side: int = MAX_PATCHES_PER_SIDE,
                     max_pixels: int = MAX_IMAGE_PIXELS, thumbnail: int | None = None) -> ProcessedImage:
    """Decode, orient, convert, downscale, pad, normalise and patchify one image (and keep a
    thumbnail whose longest side is at most `thumbnail` px, when given)."""
    label = _name_of(source, name)
    im, frames = open_image(source, name=label, max_pixels=max_pixels)
    original = im.size
    thumb = None
    if thumbnail is not None:
        thumb = im.copy()
        thumb.thumbnail((thumbnail, thumbnail), Image.Resampling.BICUBIC)
    digest = _pixel_digest(im)
    new_size = fit_to_limits(im.width, im.height, patch=patch, merge=merge, max_patches=max_patches,
                             max_per_side=max_per_side)
    if new_size != im.size:
        im = im.resize(new_size, Image.Resampling.BICUBIC)
    pixels = torch.from_numpy(np.asarray(im, dtype=np.uint8).copy()).permute(2, 0, 1)  # [3, H, W] uint8
    gh, gw = _padded_grid(im.width, im.height, patch, merge)
    # pad with zeros before normalising, so padding becomes -1
    pixels = F.pad(pixels, (0, gw * patch - im.width, 0, gh * patch - im.height))
    normed = (pixels.float() / 255.0 - 0.5) / 0.5
    return ProcessedImage(pixel_values=patchify(normed, patch), grid=(gh, gw), original_size=original,
                          resized_size=new_size, sha256=digest, name=label, frames=frames,
                          thumbnail=thumb)
