"""A session's segments (labelled token ranges) and how a snapshot's segment list and image thumbnails
are read back: every field checked, an InputError naming the entry (a snapshot may come from anyone)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from engine.errors import InputError
from engine.vision.thumbnail import decode_thumbnail

THUMBNAIL_TENSOR = "thumbnails."  # + segment id: a snapshot's PNG bytes of that image's thumbnail
# segments one session may hold (snapshots and traces refuse more): each is one append or generate
# call, and every view of a session lists them, so a file claiming millions would stall each page load
MAX_SEGMENTS = 1 << 14
# characters of a segment's name (a file name, "question", a request id): session.json lists every
# name, and it must stay within the trace reader's size limit (the trace writer refuses longer ones)
MAX_SEGMENT_NAME = 4096


@dataclass
class Segment:
    """A labelled token range of the context: a document, a chat turn, generated text or an image."""

    id: int
    kind: str  # "document" | "turn" | "generated" | "image"
    name: str
    start: int
    end: int
    role: str | None = None
    modality: str = "text"
    # image segments: width/height (original pixels), patch_rows/patch_cols (tower grid), grid_rows/
    # grid_cols (merged grid = token layout), token_start/token_end (the image positions), sha256
    image: dict | None = None


def segments_from_json(raw: Any, n_tokens: int) -> list[Segment]:
    """A snapshot's segment list, checked field by field (InputError naming the entry)."""
    if not isinstance(raw, list):
        raise InputError(f"snapshot segments must be a list, got {type(raw).__name__}")
    if len(raw) > MAX_SEGMENTS:
        raise InputError(f"snapshot holds {len(raw):,} segments, more than the {MAX_SEGMENTS:,} a session may have")
    names = {f.name: f for f in fields(Segment)}
    out = []
    for i, seg in enumerate(raw):
        if not isinstance(seg, dict):
            raise InputError(f"snapshot segment {i} must be an object, got {type(seg).__name__}")
        unknown = sorted(map(str, set(seg) - set(names)))
        missing = sorted(k for k in ("id", "kind", "name", "start", "end") if k not in seg)
        if unknown or missing:
            raise InputError(f"snapshot segment {i}: " + "; ".join(
                ([f"unknown key(s) {', '.join(unknown)[:80]}"] if unknown else [])
                + ([f"missing {', '.join(missing)}"] if missing else [])))
        for key in ("id", "start", "end"):
            if type(seg[key]) is not int:
                raise InputError(f"snapshot segment {i}: {key} must be an integer, got {seg[key]!r:.40}")
        for key in ("kind", "name", "modality"):
            if key in seg and not isinstance(seg[key], str):
                raise InputError(f"snapshot segment {i}: {key} must be a string, got {seg[key]!r:.40}")
        if seg.get("role") is not None and not isinstance(seg["role"], str):
            raise InputError(f"snapshot segment {i}: role must be a string or null")
        if seg.get("image") is not None and not isinstance(seg["image"], dict):
            raise InputError(f"snapshot segment {i}: image must be an object or null")
        if not 0 <= seg["start"] <= seg["end"] <= n_tokens:
            raise InputError(f"snapshot segment {i}: range [{seg['start']}, {seg['end']}) is outside the "
                             f"{n_tokens} tokens")
        # a session appends segments one after another: ids count up from 0 and ranges never overlap
        if seg["id"] != i:
            raise InputError(f"snapshot segment {i}: id must be {i} (segments are numbered in order), got {seg['id']}")
        if out and seg["start"] < out[-1].end:
            raise InputError(f"snapshot segment {i}: range [{seg['start']}, {seg['end']}) starts before segment "
                             f"{i - 1} ends ({out[-1].end}); segments follow one another")
        out.append(Segment(**seg))
    return out


def thumbnails_from_tensors(tensors: dict[str, torch.Tensor], segments: list[Segment]) -> dict[int, Any]:
    """A snapshot's `thumbnails.<id>` PNG bytes -> {segment id: RGB picture}, each checked (InputError)."""
    images = {seg.id for seg in segments if seg.image is not None}
    out: dict[int, Any] = {}
    for key in sorted(k for k in tensors if k.startswith(THUMBNAIL_TENSOR)):
        where = f"snapshot thumbnail {key[:60]!r}"
        digits = key[len(THUMBNAIL_TENSOR):]
        if not (digits.isascii() and digits.isdigit()) or len(digits) > 9:
            raise InputError(f"{where}: the name must be thumbnails.<segment id>")
        seg_id = int(digits)
        if seg_id not in images:
            raise InputError(f"{where}: segment {seg_id} is not an image segment")
        t = tensors[key]
        if t.dtype != torch.uint8 or t.ndim != 1:
            raise InputError(f"{where}: must be PNG bytes (uint8 [n]), got {str(t.dtype).removeprefix('torch.')} "
                             f"{list(t.shape)}")
        out[seg_id] = decode_thumbnail(t.numpy().tobytes(), where)  # byte count, format and size checked first
    return out
