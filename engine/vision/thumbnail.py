"""An image segment's thumbnail as PNG bytes: what a snapshot carries instead of the pixels.

A resumed session has no source pixels (its image positions are already in the state), yet viewers
still draw the picture; so a snapshot keeps each thumbnail (longest side <= THUMBNAIL_PX) as a PNG.
A snapshot may come from someone else, so reading checks the byte count first, then the PNG header
(format and size) before a single pixel is decoded.

- `encode_thumbnail(image) -> bytes`: PNG bytes of an RGB(A) `PIL.Image`.
- `decode_thumbnail(data, where) -> PIL.Image` (RGB): InputError naming `where` for anything else.
"""

from __future__ import annotations

import io

from PIL import Image

from engine.errors import InputError

THUMBNAIL_PX = 512  # longest side of the thumbnail an image segment keeps for viewers
# a 512 x 512 RGB PNG of noise is ~790 KB; anything far beyond this is not one of ours
MAX_THUMBNAIL_BYTES = 4 << 20


def encode_thumbnail(image: Image.Image) -> bytes:
    """PNG bytes of `image` (lossless: the viewer shows what the session showed)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def decode_thumbnail(data: bytes, where: str) -> Image.Image:
    """The RGB picture in `data`, a PNG of at most THUMBNAIL_PX per side (InputError naming `where`)."""
    if len(data) > MAX_THUMBNAIL_BYTES:
        raise InputError(f"{where}: {len(data):,} bytes is over the {MAX_THUMBNAIL_BYTES:,}-byte limit")
    try:
        with Image.open(io.BytesIO(data)) as im:  # header only until load(): sizes are checked first
            if im.format != "PNG":
                raise InputError(f"{where}: not a PNG ({im.format or 'unknown format'})")
            w, h = im.size
            if not (1 <= w <= THUMBNAIL_PX and 1 <= h <= THUMBNAIL_PX):
                raise InputError(f"{where}: {w}x{h} px is outside 1..{THUMBNAIL_PX} per side")
            return im.convert("RGB")
    except InputError:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        reason = str(exc).splitlines()[0][:80] if str(exc) else type(exc).__name__
        raise InputError(f"{where}: unreadable PNG ({reason})") from None
