"""The picture of an image segment, read from the trace: its thumbnail PNG, never the source pixels.

The recorder stores each image's thumbnail (longest side <= 512 px) as `images/<segment id>.png` in
the trace directory and names it in the segment (`"thumbnail"`). A trace may come from someone else,
so the name is checked like any other input: relative, inside the trace directory, a regular file
of bounded size whose header (read before any pixel is decoded) is at most MAX_THUMBNAIL_SIDE.

- `thumbnail_path(trace_dir, segment)`: the checked path (None when the segment names none).
- `read_thumbnail(trace_dir, segment, max_side)`: an RGB(A) `PIL.Image`, downscaled to `max_side`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from workbench.trace.errors import TraceCorruptError

MAX_THUMBNAIL_BYTES = 8 << 20
MAX_THUMBNAIL_SIDE = 2048  # the recorder writes <= 512; anything much larger is not ours


def _name_in(segment: dict) -> str | None:
    name = segment.get("thumbnail")
    if name is None:
        name = (segment.get("image") or {}).get("thumbnail")
    return None if name is None else str(name)


def thumbnail_path(trace_dir: Path, segment: dict) -> Path | None:
    """The thumbnail file of an image segment, checked to lie inside `trace_dir` (raises TraceCorruptError)."""
    name = _name_in(segment)
    if name is None:
        return None
    where = f"segment {segment.get('id')} thumbnail {name!r}"
    if not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise TraceCorruptError(f"{where}: must be a relative path inside the trace directory")
    root = Path(trace_dir).resolve()
    path = (root / name).resolve()
    if root not in path.parents:
        raise TraceCorruptError(f"{where}: points outside the trace directory")
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise TraceCorruptError(f"{where}: file missing") from None
    if not stat.S_ISREG(info.st_mode):
        raise TraceCorruptError(f"{where}: not a regular file")
    if info.st_size > MAX_THUMBNAIL_BYTES:
        raise TraceCorruptError(f"{where}: {info.st_size:,} bytes is over the {MAX_THUMBNAIL_BYTES:,}-byte limit")
    return path


def read_thumbnail(trace_dir: Path, segment: dict, max_side: int = 512):
    """The segment's thumbnail as an RGBA `PIL.Image` whose longest side is at most `max_side` (None if none)."""
    from PIL import Image

    path = thumbnail_path(trace_dir, segment)
    if path is None:
        return None
    where = f"segment {segment.get('id')} thumbnail {path.name}"
    try:
        with Image.open(path) as im:  # header only: the size is checked before decoding
            if im.format != "PNG":
                raise TraceCorruptError(f"{where}: not a PNG ({im.format})")
            if max(im.size) > MAX_THUMBNAIL_SIDE or min(im.size) < 1:
                raise TraceCorruptError(f"{where}: {im.size[0]}x{im.size[1]} px is outside 1..{MAX_THUMBNAIL_SIDE}")
            im = im.convert("RGBA")
    except TraceCorruptError:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise TraceCorruptError(f"{where}: unreadable PNG ({exc})") from None
    if max(im.size) > max_side:
        im.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
    return im
