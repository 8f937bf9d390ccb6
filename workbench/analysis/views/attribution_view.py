"""Reducer of the attribution view: which spans of the context the answer came from, as the page draws it.

Reads the trace's `attribution.json` (`workbench.trace.attribution_file`: drive mode's "Attribute"
writes it, from `workbench.attribute`) and lays it out for a reader:

- the LDS line: the surrogate's held-out Spearman correlation beside what a random ranking gives on
  that many masks (0, give or take 1/sqrt(n - 1)), and in words whether the ranking is trustworthy;
- the top spans: the ones checked one by one (exact effect beside same-size disjoint controls, rank,
  p-value, verdict in words), then the largest estimates (the surrogate's, unchecked), with how many
  of the answer's DSA selections read each ("read" beside "depended on");
- the context's text as spans, each with a shade in [-1, 1] (its effect over the largest shown:
  negative = the answer's log-probability fell when it was hidden) and its tooltip. At 128K tokens the
  text is ~10,000 sentences: only windows of `CONTEXT_SPANS` spans around the top ones are sent, the
  rest collapsed into "N more spans" markers, so the page never holds the whole context.

Re-read only when the file changed (its size and modification time) or the window option did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from workbench.analysis.causal import MIN_EFFECT_NATS
from workbench.analysis.views.base import Reducer, ViewOptions
from workbench.analysis.views.side_file_data import side_file_data
from workbench.trace.attribution_file import ATTRIBUTION_FILE, read_attribution

# a span's source (`workbench.span_attribution.result`); any other (UNVARIED: read, but kept in every mask
# beyond the masks' cap) has no effect known: drawn plain like an unread span, its record's verdict says why
CHECKED, ESTIMATED, UNREAD, UNVARIED = "checked", "estimated", "unread", "unvaried"
# spans shown on each side of a top span (the view's option "attribution_context" changes it)
CONTEXT_SPANS = 3
MAX_CONTEXT_SPANS = 50
# top spans the text opens windows around: the checked ones, then the largest estimates, this many in all
FOCUS_SPANS = 8
# a context of at most this many spans is shown whole (a short document reads better without gaps)
SHOW_ALL_SPANS = 300
# spans sent to the page at most, whatever the option says (each carries at most 400 characters of text)
MAX_SHOWN_SPANS = 600
# an LDS below this is weak whatever the number of held-out masks
TRUSTED_LDS = 0.6
TEXT_CHARS = 90  # of a top span's text in the list
# what a span may bring to the page at most (workbench.attribute cuts a span's text to 400 characters; a file
# from elsewhere may not): text, verdict and label
SPAN_CHARS, VERDICT_CHARS, LABEL_CHARS = 400, 600, 80
NO_FILE = ("no attribution in this trace yet: drive a find-fact question, then press Attribute (or write one with "
           "workbench.attribute and workbench.trace.attribution_file)")


@dataclass(frozen=True)
class SpanRow:
    """One span as the view shows it. `shade`: effect / the largest |effect| shown, in [-1, 1] (0 for an
    unread span); `tooltip`: effect, controls' range and count, rank / p-value and verdict, in words."""

    start: int
    end: int
    label: str
    text: str
    effect: float
    source: str
    shade: float
    controls: int
    control_min: float | None
    control_max: float | None
    rank: int | None
    p_value: float | None
    reads: int
    verdict: str
    tooltip: str


@dataclass(frozen=True)
class Piece:
    """One item of the context's text on the page: a span (`row`), a segment's name before its first
    shown span (`heading`), or a collapsed run of spans not sent (`hidden` spans over [start, end))."""

    kind: str  # "span" | "heading" | "more"
    start: int
    end: int
    row: SpanRow | None = None
    heading: str = ""
    hidden: int = 0


@dataclass(frozen=True, eq=False)
class SpanTrack:
    """Every span along the position axis, for the track under the DSA map (arrays in position order):
    `reads` the answer's DSA selections of its keys, `shade` its effect over the scale (0 unread)."""

    start: np.ndarray   # int64 [spans]
    end: np.ndarray     # int64 [spans]
    reads: np.ndarray   # int64 [spans]
    shade: np.ndarray   # float32 [spans], in [-1, 1]
    effect: np.ndarray  # float32 [spans], nats
    source: tuple[str, ...]


def span_track(rows: list[SpanRow]) -> SpanTrack:
    ordered = sorted(rows, key=lambda r: (r.start, r.end))
    return SpanTrack(np.array([r.start for r in ordered], np.int64), np.array([r.end for r in ordered], np.int64),
                     np.array([r.reads for r in ordered], np.int64), np.array([r.shade for r in ordered], np.float32),
                     np.array([r.effect for r in ordered], np.float32), tuple(r.source for r in ordered))


@dataclass(frozen=True, eq=False)
class AttributionData:
    check: str = ""             # what was attributed ("the fact: greenhouse alarm")
    summary: str = ""           # the answer, the target and its log-probability, masks and runs
    lds: float | None = None
    lds_line: str = ""          # "LDS 0.86 on 16 held-out masks (a random ranking: 0 ± 0.26): trustworthy"
    trusted: bool = False
    top: tuple[SpanRow, ...] = ()
    pieces: tuple[Piece, ...] = ()
    spans: int = 0              # spans in the attribution (shown or not)
    shown: int = 0              # spans sent to the page
    scale: float = 0.0          # nats a full shade stands for (`shade_scale`)
    marks: tuple[tuple[int, int, str], ...] = ()  # the checked spans' ranges (drawn on the DSA map)
    track: SpanTrack | None = None  # every span's reads and effect along the position axis
    extent: int = 0             # the context's length (tokens)
    notes: tuple[str, ...] = ()
    note: str = ""              # why there is nothing to show ("" when there is)


def lds_words(lds: float | None, masks: int) -> tuple[str, bool]:
    """The LDS in one line, beside a random ranking's spread on the `masks` it was measured on (each
    predicted by a surrogate fitted without it), and whether it is trusted."""
    if lds is None:
        return ("LDS not measured (the masks all scored alike, or no span was varied): trust the checked spans' "
                "verdicts, not the estimates' order"), False
    spread = 1.0 / math.sqrt(max(masks - 1, 1))
    trusted = lds >= TRUSTED_LDS and lds >= 2 * spread
    chance = f"a random ranking scores 0 ± {spread:.2f} on {masks} masks"
    if trusted:
        meaning = "the ranking is trustworthy"
    elif lds >= TRUSTED_LDS:
        meaning = "weak: too few held-out masks to tell it from a lucky random ranking"
    else:
        meaning = "the ranking is weak: trust the checked spans' verdicts, not the estimates' order"
    return (f"LDS {lds:.2f} on {masks} masks, each predicted by a surrogate fitted without it ({chance}): {meaning}",
            trusted)


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def span_tooltip(span: dict, lds_line: str) -> str:
    """A span's tooltip: its effect (exact or estimated), its controls, rank and p-value, its verdict."""
    where = f"tokens {span['start']}–{span['end']} ({span.get('label') or 'context'}); read by the answer's DSA " \
            f"selections {span.get('reads', 0):,} times"
    effect = _num(span.get("effect")) or 0.0
    source = span.get("source")
    if source == UNREAD:
        return f"{where}. Unread: no DSA layer read it while answering, so hiding it changes nothing (0, exact)."
    if source == ESTIMATED:
        return (f"{where}. Estimated effect {effect:+.3f} nats (the surrogate's weight, not run alone, no controls; "
                f"{lds_line}).")
    if source != CHECKED:
        return f"{where}. No effect known ({source}): {span.get('verdict') or 'neither estimated nor checked'}."
    n = int(span.get("controls") or 0)
    low, high = _num(span.get("control_min")), _num(span.get("control_max"))
    controls = (f"{n} random same-size disjoint spans changed it by {low:+.3f} to {high:+.3f}"
                if n and low is not None and high is not None else "no control fitted")
    rank, p = span.get("rank"), _num(span.get("p_value"))
    ranked = (f"; rank {rank} of {n + 1} (1 = the largest drop), p = {p:.2f} (the smallest {n} controls allow: "
              f"{1 / (n + 1):.2f})" if rank is not None and p is not None else "")
    return f"{where}. Hidden alone: {effect:+.3f} nats (exact); {controls}{ranked}. {span.get('verdict', '')}"


def shade_scale(spans: list[dict]) -> float:
    """Nats a full shade stands for: the largest exact effect (a checked span's), else the largest estimate,
    and never less than MIN_EFFECT_NATS (a change the verdicts call too small to matter is never drawn in
    full colour). A surrogate fitted on few masks can give estimates far larger than any measured
    effect; scaled to those, the measured drops would be drawn blank, so estimates beyond it are drawn full."""
    checked = [abs(_num(s.get("effect")) or 0.0) for s in spans if s.get("source") == CHECKED]
    if max(checked, default=0.0) > 0:
        return max(max(checked), MIN_EFFECT_NATS)
    estimated = [abs(_num(s.get("effect")) or 0.0) for s in spans if s.get("source") == ESTIMATED]
    return max(max(estimated, default=0.0), MIN_EFFECT_NATS)


def span_rows(record: dict, lds_line: str) -> list[SpanRow]:
    """Every span of the record as a `SpanRow`, in the record's order (checked first, by effect)."""
    rows = []
    scale = shade_scale(record["spans"])
    for s in record["spans"]:
        effect = _num(s.get("effect")) or 0.0
        known = s.get("source") in (CHECKED, ESTIMATED)
        shade = max(-1.0, min(1.0, effect / scale)) if known and scale > 0 else 0.0
        rows.append(SpanRow(int(s["start"]), int(s["end"]), str(s.get("label") or "")[:LABEL_CHARS],
                            str(s.get("text") or "")[:SPAN_CHARS],
                            effect, str(s["source"]), shade, int(s.get("controls") or 0), _num(s.get("control_min")),
                            _num(s.get("control_max")), s.get("rank"), _num(s.get("p_value")),
                            int(s.get("reads") or 0), str(s.get("verdict") or "")[:VERDICT_CHARS],
                            span_tooltip(s, lds_line)[:VERDICT_CHARS + 400]))
    return rows


def focus_rows(rows: list[SpanRow], count: int = FOCUS_SPANS) -> list[SpanRow]:
    """The spans the text opens windows around: the checked ones, then the largest estimated drops (an
    estimated rise is no reason to look at a span first)."""
    checked = [r for r in rows if r.source == CHECKED]
    estimated = sorted((r for r in rows if r.source == ESTIMATED and r.effect < 0), key=lambda r: r.effect)
    return (checked + estimated)[:max(count, len(checked))]


def text_pieces(rows: list[SpanRow], focus: list[SpanRow], context: int) -> list[Piece]:
    """The context's text as pieces in position order: all spans for a short context, else windows of
    `context` spans around each focus span (at most MAX_SHOWN_SPANS), the rest as "more" markers, and a
    heading where the segment changes."""
    ordered = sorted(rows, key=lambda r: (r.start, r.end))
    if len(ordered) <= SHOW_ALL_SPANS:
        keep = set(range(len(ordered)))
    else:
        index = {(r.start, r.end): i for i, r in enumerate(ordered)}
        keep = set()
        for r in focus:
            i = index[(r.start, r.end)]
            window = set(range(max(0, i - context), min(len(ordered), i + context + 1)))
            if len(keep | window) > MAX_SHOWN_SPANS:
                break
            keep |= window
    pieces: list[Piece] = []
    label, hidden_from, hidden = None, None, 0
    for i, row in enumerate(ordered):
        if i not in keep:
            hidden_from = row.start if hidden == 0 else hidden_from
            hidden += 1
            continue
        if hidden:
            pieces.append(Piece("more", hidden_from, row.start, hidden=hidden))
            hidden = 0
        if row.label != label:
            label = row.label
            pieces.append(Piece("heading", row.start, row.start, heading=label))
        pieces.append(Piece("span", row.start, row.end, row=row))
    if hidden:
        pieces.append(Piece("more", hidden_from, ordered[-1].end, hidden=hidden))
    return pieces


def _short(text: str, chars: int = TEXT_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= chars else text[:chars - 1] + "…"


def attribution_data(record: dict, context: int = CONTEXT_SPANS) -> dict[str, Any]:
    """The view's fields from an attribution record (`read_attribution`)."""
    line, trusted = lds_words(_num(record.get("lds")), int(record["masks"]) + int(record["holdout"]))
    rows = span_rows(record, line)
    focus = focus_rows(rows)
    pieces = text_pieces(rows, focus, max(0, min(int(context), MAX_CONTEXT_SPANS)))
    right = {True: " (right)", False: " (wrong)"}.get(record.get("right"), "")
    summary = (f"answer {_short(record['answer'])!r}{right}; target {_short(record['target'])!r}: log-probability "
               f"{record['target_logprob']:.3f} nats without intervention. {len(rows):,} spans, "
               f"{record['candidates']:,} varied by {record['masks']} random masks, {record['runs']:,} runs in "
               f"{float(record.get('attribution_s') or 0):.1f} s"
               + (" (KDA writes suppressed too)" if record.get("kda") else ""))
    top = tuple(SpanRow(**{**r.__dict__, "text": _short(r.text)}) for r in focus)
    return {"check": _short(str(record["check"]), 200), "summary": summary, "lds": _num(record.get("lds")), "lds_line": line,
            "trusted": trusted, "top": top, "pieces": tuple(pieces), "spans": len(rows),
            "shown": sum(p.kind == "span" for p in pieces), "scale": shade_scale(record["spans"]),
            "marks": tuple((r.start, r.end, f"checked {r.start}–{r.end}") for r in rows if r.source == CHECKED),
            "track": span_track(rows), "extent": int(record["context_tokens"]),
            "notes": tuple(_short(n, 400) for n in (record.get("notes") or ())[:8]), "note": ""}


def _empty(note: str) -> dict[str, Any]:
    return {**{k: v for k, v in AttributionData().__dict__.items()}, "note": note}


class AttributionReducer(Reducer[AttributionData]):
    """trace -> `AttributionData` (its attribution file, re-read when the file or the window option changed)."""

    data_type = AttributionData

    def reduce(self, trace: Any, options: ViewOptions, session: Any) -> AttributionData:
        context = options.get("attribution_context", CONTEXT_SPANS)
        fields = side_file_data(self, "attribution", trace.path / ATTRIBUTION_FILE,
                                lambda: self._read(trace, context), _empty, NO_FILE, options=context)
        return self.result(**fields)

    @staticmethod
    def _read(trace: Any, context: Any) -> dict[str, Any]:
        record = read_attribution(trace.path)
        if record is None or not record["spans"]:
            return _empty("the attribution holds no spans")
        try:
            context = int(context)
        except (TypeError, ValueError):
            context = CONTEXT_SPANS
        return attribution_data(record, context)


__all__ = ["AttributionData", "AttributionReducer", "Piece", "SpanRow", "SpanTrack", "attribution_data", "lds_words",
           "span_tooltip", "span_track", "text_pieces", "CONTEXT_SPANS", "MAX_SHOWN_SPANS", "SHOW_ALL_SPANS"]
