"""Drive-mode uploads, bounded on the server: documents (UTF-8 text) and images (PNG, JPEG, WebP).

The browser's `max_file_size` is only advice: a page whose limit is lifted can push any amount in
1 MiB chunks. `BoundedFileDropper` therefore counts bytes as each chunk arrives and drops a file's
buffer the moment it passes `max_bytes` (the rest of its chunks are ignored), lets at most
`max_pending` files be in flight at once, and keeps nothing it refused; each refusal is one line in
`refused` for the page. `classify_upload` then decides what a complete file is, by its bytes (never
by the name or the browser's MIME type): a PNG, JPEG or WebP image that Pillow can decode within
the pixel limit, or UTF-8 text.
"""

from __future__ import annotations

from dataclasses import dataclass

import panel as pn
import param

from engine.errors import ImageError
from engine.vision import open_image

TEXT_SUFFIXES = [".txt", ".md", ".csv", ".json", ".py"]
IMAGE_SUFFIXES = [".png", ".jpg", ".jpeg", ".webp"]
# what the browser widget itself refuses: far above `max_bytes`, because a file the browser drops never
# reaches the server and the app could not say why; one over `max_bytes` is refused by the server
# at its first chunk, with a message (its later chunks are still sent, and ignored)
BROWSER_MAX_FILE_SIZE = "1024MB"
# an uploaded image decodes to at most this many pixels (about 8K x 5K; the tower downscales anyway)
MAX_UPLOAD_PIXELS = 40_000_000


class UploadError(ValueError):
    """An upload the runner refuses; the message names the file and the problem."""


@dataclass(frozen=True)
class Upload:
    """A checked upload: `kind` "text" (payload str) or "image" (payload: the file's bytes)."""

    name: str
    kind: str
    payload: str | bytes

    @property
    def size(self) -> int:
        return len(self.payload.encode("utf-8")) if isinstance(self.payload, str) else len(self.payload)


def image_format(data: bytes) -> str | None:
    """"PNG", "JPEG" or "WebP" from the file's first bytes; None for anything else."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    return None


def classify_upload(name: str, content: str | bytes, max_bytes: int) -> Upload:
    """The upload as text or image, or UploadError naming `name` and the problem."""
    data = content.encode("utf-8") if isinstance(content, str) else bytes(content)
    if len(data) > max_bytes:
        raise UploadError(f"{name}: {len(data):,} bytes is over the {max_bytes:,}-byte upload limit")
    if not data:
        raise UploadError(f"{name}: empty file")
    fmt = image_format(data)
    if fmt is not None:
        try:
            open_image(data, name=name, max_pixels=MAX_UPLOAD_PIXELS)
        except ImageError as exc:
            raise UploadError(str(exc)) from None
        return Upload(name, "image", data)
    if name.lower().endswith(tuple(IMAGE_SUFFIXES)):
        raise UploadError(f"{name}: not a PNG, JPEG or WebP image (the file's bytes say otherwise)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UploadError(f"{name}: not UTF-8 text, nor a PNG, JPEG or WebP image") from None
    if not text.strip():
        raise UploadError(f"{name}: empty file")
    return Upload(name, "text", text)


class BoundedFileDropper(pn.widgets.FileDropper):
    """A FileDropper that enforces its size limit on the server, chunk by chunk (see the module docstring)."""

    max_bytes = param.Integer(default=4 << 20, bounds=(1, None), doc="largest file accepted, bytes (server-side)")
    max_pending = param.Integer(default=4, bounds=(1, None), doc="files that may be in flight at once")
    refused = param.List(default=[], doc="one line per file refused while it arrived (newest last)")

    # server-side only: never synced to the browser's model
    _rename = {**pn.widgets.FileDropper._rename, "max_bytes": None, "max_pending": None, "refused": None}

    def __init__(self, **params) -> None:
        super().__init__(**params)
        self._sizes: dict[str, int] = {}  # bytes buffered so far per file in flight
        self._dropped: set[str] = set()  # files refused mid-way: their remaining chunks are ignored

    def _refuse(self, name: str, why: str) -> None:
        self._file_buffer.pop(name, None)
        self._sizes.pop(name, None)
        self._dropped.add(name)
        self.refused = [*self.refused[-9:], f"{name}: {why}"]

    def _process_event(self, event) -> None:
        data = event.data
        if event.event_name == "delete_event":
            super()._process_event(event)
            return
        name = str(data.get("name", "?"))
        chunk = data.get("data") or b""
        size = len(chunk.encode("utf-8")) if isinstance(chunk, str) else len(chunk)
        index, total = int(data.get("chunk", 0)), int(data.get("total_chunks", 0))
        if index == 1:
            self._dropped.discard(name)
            self._file_buffer.pop(name, None)
            self._sizes.pop(name, None)
            if len(self._sizes) >= self.max_pending:
                self._refuse(name, f"refused: {self.max_pending} uploads are already in progress")
                return
            if total < 1 or (total - 1) * max(int(self.chunk_size), 1) >= self.max_bytes + 1:
                self._refuse(name, f"over the {self.max_bytes:,}-byte upload limit ({total} chunks announced)")
                return
            self._file_buffer[name] = []
            self._sizes[name] = 0
        elif name in self._dropped or name not in self._sizes:
            return  # the rest of a refused file, or chunks without a first one
        self._sizes[name] += size
        if self._sizes[name] > self.max_bytes:
            self._refuse(name, f"over the {self.max_bytes:,}-byte upload limit (stopped after "
                               f"{self._sizes[name]:,} bytes)")
            return
        self._file_buffer[name].append(chunk)
        if index < total:
            return
        buffers = self._file_buffer.pop(name)
        self._sizes.pop(name, None)
        joined = "".join(buffers) if buffers and isinstance(buffers[0], str) else b"".join(buffers)
        # hand the file over and forget it: the runner keeps what it accepts, the widget keeps nothing
        self.mime_type = {name: str(data.get("type", ""))}
        self.value = {name: joined}
        self.value = {}
