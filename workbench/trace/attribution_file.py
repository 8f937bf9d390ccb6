"""The attribution file: which spans of the context an answer came from, kept with the trace it measured.

One JSON file in the trace directory, `attribution.json`: the `workbench attribute --json` object
(`Attribution.to_json()`: the answer, the target, the surrogate's LDS, every span with its effect,
controls, rank, p-value, verdict and DSA reads) plus a `check` naming what was attributed and a
`format` tag. Written after the recording, like the effects table (the masks' runs are branches of
their own, never rows of the recorded session's tables), atomically (a crash leaves the previous file
whole), and deleted with the session when a new recording replaces the directory
(`workbench.trace.target`). JSON, not pickle: a trace may come from anyone, and reading one runs no
code. Any JSON reader opens it:

    jq '.spans[:3][] | {start, end, effect, verdict}' traces/demo/attribution.json

`read_attribution` checks what a view relies on (types, ranges, sizes) and raises TraceError naming
the first problem; the dashboard shows that message instead of the view.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from workbench.trace.errors import TraceError
from workbench.trace.side_files import SideFile

ATTRIBUTION_FILE = "attribution.json"
FORMAT = "k3wb.attribution/1"
# 128K tokens cut into sentences are ~10,000 spans of at most 400 characters of text each: far below this
MAX_ATTRIBUTION_BYTES = 64 << 20
MAX_SPANS = 200_000
SIDE_FILE = SideFile(ATTRIBUTION_FILE, "an attribution", MAX_ATTRIBUTION_BYTES)
_NUMBERS = ("effect", "estimate", "control_min", "control_max", "p_value")
# workbench.span_attribution.result's sources ("unvaried": read, but beyond the masks' cap of 384 spans)
_SOURCES = ("checked", "estimated", "unread", "unvaried")


def attribution_record(attribution: Any, check: str) -> dict[str, Any]:
    """What the file holds for `attribution` (an `Attribution`, or its `to_json()` dict): its JSON form,
    the `check` (what was attributed, in words) and the format tag."""
    body = attribution if isinstance(attribution, Mapping) else attribution.to_json()
    return {"format": FORMAT, "check": str(check), **dict(body)}


def write_attribution(trace: Any, attribution: Any, check: str) -> Path:
    """Write `attribution` (an `Attribution` or its `to_json()` dict) into the trace directory, replacing
    the previous one: a temporary file, fsynced, then renamed over it."""
    final = SIDE_FILE.target(trace)
    record = attribution_record(attribution, check)
    check_record(record, final)
    # allow_nan=False: a NaN would make the file unreadable to strict JSON readers (to_json() maps them to null)
    return SIDE_FILE.write_bytes(trace, json.dumps(record, allow_nan=False).encode("utf-8"))


def read_attribution(trace: Any) -> dict[str, Any] | None:
    """The trace's attribution (the dict `write_attribution` wrote), or None when it has none. A file that
    is too large, not JSON or not an attribution is a TraceError naming it and the problem."""
    data = SIDE_FILE.read_bytes(trace)
    if data is None:
        return None
    path = SIDE_FILE.path(trace)
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise TraceError(f"{path}: not a readable attribution ({' '.join(str(exc).split())[:200]})") from None
    check_record(record, path)
    return record


def _number(value: Any, allow_none: bool = True) -> bool:
    if value is None:
        return allow_none
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_record(record: Any, path: Path) -> None:
    """TraceError naming the first field of `record` a view could not show (wrong type, out of range)."""
    def bad(what: str) -> TraceError:
        return TraceError(f"{path}: not an attribution ({what})")

    if not isinstance(record, dict):
        raise bad(f"a JSON {type(record).__name__}, not an object")
    if record.get("format") != FORMAT:
        raise bad(f"format {str(record.get('format'))[:40]!r}, expected {FORMAT!r}")
    for key in ("check", "answer", "target"):
        if not isinstance(record.get(key), str):
            raise bad(f"{key!r} is not text")
    if not _number(record.get("lds")) or not _number(record.get("target_logprob"), allow_none=False):
        raise bad("'lds' or 'target_logprob' is not a finite number")
    for key in ("masks", "holdout", "candidates", "runs", "context_tokens"):
        if not _count(record.get(key)):
            raise bad(f"{key!r} is not a count")
    if not isinstance(record.get("notes", []), list) or not all(isinstance(n, str) for n in record.get("notes", [])):
        raise bad("'notes' is not a list of text")
    spans = record.get("spans")
    if not isinstance(spans, list) or len(spans) > MAX_SPANS:
        raise bad(f"'spans' is not a list of at most {MAX_SPANS:,} spans")
    end = record["context_tokens"]
    for i, span in enumerate(spans):
        if not isinstance(span, dict):
            raise bad(f"span {i} is not an object")
        start, stop = span.get("start"), span.get("end")
        if not (_count(start) and _count(stop) and start < stop <= end):
            raise bad(f"span {i}: need 0 <= start < end <= {end} (the context), got {start!r:.20}, {stop!r:.20}")
        if not all(_number(span.get(k)) for k in _NUMBERS):
            raise bad(f"span {i}: one of {', '.join(_NUMBERS)} is not a finite number")
        if span.get("source") not in _SOURCES:
            raise bad(f"span {i}: source {str(span.get('source'))[:20]!r} is not one of {', '.join(_SOURCES)}")
        if not all(isinstance(span.get(k, ""), str) for k in ("text", "verdict", "label", "kind")):
            raise bad(f"span {i}: text, verdict, label or kind is not text")
        if not (_count(span.get("controls", 0)) and _count(span.get("reads", 0))):
            raise bad(f"span {i}: 'controls' or 'reads' is not a count")
        if span.get("rank") is not None and not _count(span["rank"]):
            raise bad(f"span {i}: 'rank' is not a count")


__all__ = ["ATTRIBUTION_FILE", "FORMAT", "MAX_ATTRIBUTION_BYTES", "attribution_record", "check_record",
           "read_attribution", "write_attribution"]
