"""Reducer of view 1, the session map, whose data is also every other view's context.

From session.json: status, segments, progress (tokens done / total, tokens/s, ETA), timings, marked key
ranges (a planted needle); from the token table: the generated text (the newest MAX_GENERATED tokens)
and the token text the DSA read-out quotes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workbench.analysis import TokenText
from workbench.trace import Trace

from workbench.analysis.views.base import Reducer, ViewOptions

MAX_GENERATED = 1000  # generated tokens sent to the browser (the newest ones)
MAX_TURNS = 64  # served turns kept for the status line (the newest ones)

Marks = tuple[tuple[int, int, str], ...]


@dataclass(frozen=True)
class RecordingMapData:
    """The followed recording as the views draw it (segments, progress, generated tokens)."""

    status: str = "waiting"  # waiting | recording | complete | failed
    tokens: int = 0
    extent: int = 1  # right end of every position axis
    progress: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    segments: tuple[dict, ...] = ()
    marks: Marks = ()  # marked key ranges (start, end, label), e.g. a planted needle
    generated: tuple[tuple[int, str], ...] = ()  # (position, piece) of the newest generated tokens
    # a served conversation's turns (`workbench serve`): prompt, reused and generated tokens, TTFT, TPOT, finish
    requests: tuple[dict, ...] = ()
    token_text: TokenText = field(default_factory=TokenText, repr=False)  # for the read-out's quotes


def session_marks(session: dict) -> Marks:
    """Key ranges worth marking: a `"marks": [{"start", "end", "label"}]` list in session.json, plus the
    needle of `workbench demo` ("demo") or of a synthetic trace ("synthetic")."""
    found = []
    for mark in session.get("marks") or []:
        if isinstance(mark, dict) and {"start", "end"} <= set(mark):
            found.append((int(mark["start"]), int(mark["end"]), str(mark.get("label", "marked"))))
    for key in ("demo", "synthetic"):
        needle = (session.get(key) or {}).get("needle") if isinstance(session.get(key), dict) else None
        if isinstance(needle, (list, tuple)) and len(needle) == 2:
            found.append((int(needle[0]), int(needle[1]), "needle"))
    return tuple(found)


def generated_tokens(text: TokenText, segments: tuple[dict, ...]) -> tuple[tuple[int, str], ...]:
    """(position, piece) of the generated segments' tokens, the newest MAX_GENERATED of them."""
    spans = [(int(g["start"]), int(g["end"])) for g in segments if g["kind"] == "generated"]
    if not spans:
        return ()
    out: list[tuple[int, str]] = []
    for start, end in spans:
        out.extend(text.span(start, max(end, start)))
    # the recorder may write a generated token before session.json's segment end catches up
    out.extend(text.span(spans[-1][1], 1 << 62))
    return tuple(out[-MAX_GENERATED:])


def served_turns(session: dict) -> tuple[dict, ...]:
    """The turns a server recorded (`session.json` `requests`), each with only numbers and a short finish
    reason (a trace may come from anyone: nothing else of an entry reaches a view)."""
    out = []
    for entry in (session.get("requests") or [])[-MAX_TURNS:] if isinstance(session.get("requests"), list) else []:
        if not isinstance(entry, dict):
            continue
        row = {k: entry[k] for k in ("turn", "start", "end", "prompt_tokens", "cached_tokens", "completion_tokens",
                                     "ttft_s", "tpot_s")
               if isinstance(entry.get(k), (int, float)) and not isinstance(entry.get(k), bool)}
        reason = entry.get("finish_reason")
        if isinstance(reason, str) and reason.isalpha() and len(reason) <= 16:
            row["finish_reason"] = reason
        out.append(row)
    return tuple(out)


class RecordingMapReducer(Reducer[RecordingMapData]):
    """session.json and the token table -> `RecordingMapData` (the token table is re-read when it grows)."""

    data_type = RecordingMapData

    def reduce(self, trace: Trace, options: ViewOptions, session: RecordingMapData | None = None) -> RecordingMapData:
        s = trace.session
        segments = tuple({k: seg.get(k) for k in ("id", "kind", "name", "start", "end", "modality")}
                         | {"image": seg.get("image"), "thumbnail": seg.get("thumbnail")} for seg in s.get("segments", []))
        progress = dict(s.get("progress") or {})
        tokens = int(s.get("tokens", 0))
        total = int(progress.get("total") or 0) if progress.get("phase") == "prefill" else 0
        extent = max(tokens, total, max((int(g["end"]) for g in segments), default=0), 1)
        parts = tuple(trace.parts("tokens"))
        text = self.memo("token_text", (parts,),
                         lambda: TokenText(trace.table("tokens", columns=["position", "piece", "segment"])))
        generated = self.memo("generated", (text, segments), lambda: generated_tokens(text, segments))
        return self.result(status=trace.status, tokens=tokens, extent=extent, progress=progress,
                           timings=dict(s.get("timings") or {}), segments=segments, marks=session_marks(s),
                           generated=generated, token_text=text, requests=served_turns(s))
