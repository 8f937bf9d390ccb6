"""What one request may cost, checked before the cost is paid.

A body within the size limit can still be expensive: 60 MiB of `{},{},...` decodes to 20 million
Python objects (gigabytes), a 60 MiB message is tokenized in full before the context limit refuses
it, and a 16 KB PNG may declare 2048x2048 pixels. So, in order, each step cheap beside the next:

- `check_json_shape(raw, limits)`: on the raw bytes, before `json.loads`: how many JSON values the
  body holds and how deeply they nest (string contents removed first, so text is never counted).
- `check_request_cost(request, limits)`: on the parsed request, before anything is tokenized or
  decoded: the characters of every message (no text of C characters is fewer than C / L tokens,
  L the longest token in bytes) and the images' number, pixel area and patches, read from their
  headers; and text, pictures and each message's chat frame together against the model's context.
- `PendingBytes`: the bytes of every request being read, waiting or running, within a budget (each
  held request keeps its body's text and pictures until it is done).
"""

from __future__ import annotations

import io
import math
import re
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from apps.serve.protocol import ChatRequest, RequestError
from engine.errors import InputError
from engine.vision import MAX_IMAGE_PIXELS, MAX_PATCHES, fit_to_limits

MAX_JSON_VALUES = 250_000  # a 16,384-message conversation with a few fields each stays far below
MAX_JSON_DEPTH = 64  # a chat body nests 6 deep; tool schemas a few more
MAX_IMAGES = 16
MAX_IMAGE_AREA = 32_000_000  # source pixels of all pictures of one request (each is decoded in full)
MAX_IMAGE_PATCHES = 2 * MAX_PATCHES  # vision patches of all pictures of one request (held until they run)
FALLBACK_TOKEN_BYTES = 64  # when the tokenizer cannot say how long its longest token is
_INNERMOST = re.compile(rb"\[\]|\{\}")
_NOT_BRACKETS = bytes(range(256)).translate(None, b"[]{}")  # every byte but the four brackets


@dataclass(frozen=True)
class RequestLimits:
    """The bounds `check_json_shape` and `check_request_cost` enforce."""

    context_tokens: int
    token_bytes: int = 1  # bytes of the longest token: a token never covers more characters
    frame_tokens: int = 0  # the fewest tokens the chat format wraps one message in
    max_values: int = MAX_JSON_VALUES
    max_depth: int = MAX_JSON_DEPTH
    max_images: int = MAX_IMAGES
    max_image_area: int = MAX_IMAGE_AREA
    max_image_patches: int = MAX_IMAGE_PATCHES
    patch: int = 14
    merge: tuple[int, int] = (2, 2)

    @property
    def max_chars(self) -> int:
        return self.context_tokens * self.token_bytes

    @classmethod
    def for_model(cls, model: Any, tokenizer: Any, **overrides: Any) -> "RequestLimits":
        """The limits of `model` (its context, its vision patches) and `tokenizer` (its longest token)."""
        try:
            token_bytes = max(len(b) for b in tokenizer.encoding.token_byte_values())
        except (AttributeError, TypeError, ValueError):
            token_bytes = FALLBACK_TOKEN_BYTES
        try:
            frame = min(sum(map(len, tokenizer.message_frame(role)))
                        for role in ("system", "user", "assistant", "tool"))
        except (AttributeError, TypeError, ValueError, InputError):
            frame = 0
        vision = getattr(model, "vision", None)
        shape = {}
        if vision is not None:
            shape = {"patch": int(vision.config.patch_size), "merge": tuple(vision.config.merge_kernel)}
        return cls(context_tokens=int(model.config.max_position_embeddings), token_bytes=max(token_bytes, 1),
                   frame_tokens=frame, **{**shape, **overrides})


def check_json_shape(raw: bytes, limits: RequestLimits) -> None:
    """Refuse (RequestError 413) a body of more than `max_values` JSON values or nested deeper than
    `max_depth`, reading only its bytes. Invalid JSON passes: `json.loads` then names the problem."""
    # escapes first: a `\\` pair is one character, and `\"` then never opens or closes a string
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    quotes = unescaped.count(b'"')
    # every string is a value or a key (each key has a value): more quotes than that is too many values
    if quotes > 4 * (limits.max_values + 1):
        raise _too_many(quotes // 4, limits)
    # what lies outside strings (structure, numbers, literals), without white space
    skeleton = b"".join(unescaped.split(b'"')[0::2]).translate(None, b" \t\r\n")
    del unescaped
    # a non-empty container of k elements has k - 1 commas: elements = commas + non-empty containers
    empty = skeleton.count(b"[]") + skeleton.count(b"{}")
    values = skeleton.count(b",") + skeleton.count(b"[") + skeleton.count(b"{") - empty + 1
    if values > limits.max_values:
        raise _too_many(values, limits)
    brackets = skeleton.translate(None, _NOT_BRACKETS)
    for _ in range(limits.max_depth):  # each pass removes the innermost level
        if not brackets:
            return
        inner = _INNERMOST.sub(b"", brackets)  # one scan: a pair a removal exposes waits for the next pass
        if len(inner) == len(brackets):
            return  # unbalanced: not JSON, json.loads says where
        brackets = inner
    if brackets:
        raise RequestError(f"the request body nests JSON deeper than the {limits.max_depth} levels allowed",
                           status=413)


def _too_many(values: int, limits: RequestLimits) -> RequestError:
    return RequestError(f"the request body holds at least {values:,} JSON values; at most {limits.max_values:,} "
                        "are allowed", status=413)


BOMB = (-1, -1)  # `image_size` of a picture Pillow will not open for its size


def image_size(source: bytes | Path) -> tuple[int, int] | None:
    """(width, height) from an image's header, nothing decoded; `BOMB` when Pillow refuses it for its size;
    None when it cannot be read (the engine's own reader then names the problem) or is no regular file."""
    try:
        if isinstance(source, Path) and not source.is_file():
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            opener = io.BytesIO(source) if isinstance(source, bytes) else source
            with Image.open(opener) as im:  # reads the header only
                return im.size
    except Image.DecompressionBombError:
        return BOMB
    except Exception:  # noqa: BLE001 - any unreadable header is the engine's to describe, after these checks
        return None


def image_patches(width: int, height: int, limits: RequestLimits) -> int:
    """Vision patches of a `width` x `height` picture once it is scaled to the tower's limits and padded."""
    new_w, new_h = fit_to_limits(width, height, patch=limits.patch, merge=limits.merge)
    fh, fw = limits.patch * limits.merge[0], limits.patch * limits.merge[1]
    return math.ceil(new_h / fh) * limits.merge[0] * math.ceil(new_w / fw) * limits.merge[1]


def check_request_cost(request: ChatRequest, limits: RequestLimits) -> None:
    """Refuse (RequestError 400, naming the problem) what would cost more than the limits allow to tokenize
    or decode; reads the images' headers only."""
    chars = sum(len(m.text) for m in request.messages if m.text)
    if chars > limits.max_chars:
        raise RequestError(f"the messages hold {chars:,} characters, more than the model's context of "
                           f"{limits.context_tokens:,} tokens can hold (at most {limits.max_chars:,})",
                           param="messages")
    images = [(m, k, source) for m in request.messages for k, source in enumerate(m.images)]
    if len(images) > limits.max_images:
        raise RequestError(f"the messages hold {len(images)} images; at most {limits.max_images} are allowed per "
                           "request", param="messages")
    area = patches = 0
    for message, k, source in images:
        size = image_size(source)
        if size is None:
            continue
        if size == BOMB:
            raise RequestError(f"{message.label} image {k}: more pixels than an image may hold (decompression-bomb "
                               "guard; nothing was decoded)", param="messages")
        width, height = size
        if width * height > MAX_IMAGE_PIXELS:
            raise RequestError(f"{message.label} image {k}: {width}x{height} pixels, more than the "
                               f"{MAX_IMAGE_PIXELS:,} allowed (nothing was decoded)", param="messages")
        area += width * height
        if width > 0 and height > 0:
            try:
                patches += image_patches(width, height, limits)
            except InputError:  # a size the tower cannot take: the engine's reader names it
                pass
        if area > limits.max_image_area:
            raise RequestError(f"the images of this request hold more than {limits.max_image_area:,} pixels "
                               f"together (up to {message.label} image {k}); send fewer or smaller pictures",
                               param="messages")
        if patches > limits.max_image_patches:
            raise RequestError(f"the images of this request need more than {limits.max_image_patches:,} vision "
                               f"patches together (up to {message.label} image {k}); send fewer or smaller "
                               "pictures", param="messages")
    merged = patches // (limits.merge[0] * limits.merge[1])
    fewest = math.ceil(chars / limits.token_bytes) + merged + limits.frame_tokens * len(request.messages)
    if fewest > limits.context_tokens:
        raise RequestError(f"the conversation would hold at least {fewest:,} tokens; the model's limit is "
                           f"{limits.context_tokens:,}", param="messages")


class PendingBytes:
    """The body bytes of every request being read, waiting or running, within `budget` bytes."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.held = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bool:
        """Hold `nbytes` more; False (nothing held) when that would pass the budget."""
        with self._lock:
            if self.held + nbytes > self.budget:
                return False
            self.held += nbytes
            return True

    def give_back(self, nbytes: int) -> None:
        with self._lock:
            self.held = max(0, self.held - nbytes)


__all__ = ["PendingBytes", "RequestLimits", "check_json_shape", "check_request_cost", "image_size"]
