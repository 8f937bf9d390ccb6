"""The spans an attribution scores: made from the context's own text (sentences, paragraphs, segments;
an image's patches in groups of rows) or given as positions, each checked.

A span is a range of token positions, end exclusive, as the trace numbers them. Automatic spans never
cross a segment boundary (a document, a turn, an image), so a span's text is always one source's.
Boundaries are found on the tokens' own text: a sentence ends after a token whose text ends with `.`,
`!` or `?` (closing quotes and brackets allowed) followed by white space, or holding a line break; a
paragraph ends at a blank line. A span longer than `max_tokens` is cut (a sentence of a table or a
code block without punctuation would otherwise be one span of thousands of tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from engine.errors import InputError

SPAN_MODES = ("sentences", "paragraphs", "segments")
# tokens per automatic span at most (a long unpunctuated run is cut into pieces this long)
MAX_SPAN_TOKENS = 256
# image patch groups per image at most (each group: whole rows of the image's token grid)
IMAGE_GROUPS = 8
_SENTENCE_END = ".!?"
_CLOSERS = "\"')]}»”’"


@dataclass(frozen=True)
class Span:
    """One span of the context: [start, end) token positions, a label (its segment's name, or the given
    one) and its kind (`sentence`, `paragraph`, `segment`, `image patches`, `given`)."""

    start: int
    end: int
    label: str
    kind: str


class _TokenText:
    """Each token id's own text, decoded once per id (a long context repeats a small vocabulary)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self.cache.get(token)
        if text is None:
            text = self.cache[token] = self.tokenizer.decode([token]) if self.tokenizer is not None else ""
        return text


def _ends_sentence(text: str, following: str) -> bool:
    if "\n" in text:
        return True
    bare = text.rstrip()
    trailing_space = len(bare) < len(text)
    bare = bare.rstrip(_CLOSERS)
    if not bare or bare[-1] not in _SENTENCE_END:
        return False
    return trailing_space or not following or following[:1].isspace()


def _cut(start: int, end: int, boundaries: Sequence[int], max_tokens: int) -> list[tuple[int, int]]:
    """[start, end) cut after each boundary position (exclusive ends) and into pieces of at most max_tokens."""
    out, at = [], start
    for b in list(boundaries) + [end]:
        if b <= at:
            continue
        while b - at > max_tokens:
            out.append((at, at + max_tokens))
            at += max_tokens
        out.append((at, b))
        at = b
    return out


def _image_groups(seg: Any, groups: int) -> list[tuple[int, int, str]]:
    """An image segment's positions: its patches in up to `groups` bands of whole patch rows (row-major
    tokens), and the turn's own tokens around them (role tags, image markers) as spans of their own."""
    image = seg.image or {}
    rows, cols = int(image.get("grid_rows") or 0), int(image.get("grid_cols") or 0)
    first = int(image.get("token_start", seg.start))
    if rows < 1 or cols < 1 or not seg.start <= first or first + rows * cols > seg.end:
        return [(seg.start, seg.end, "image patches")]
    last = first + rows * cols
    per = -(-rows // groups)
    cuts = [first + r * cols for r in range(per, rows, per)]
    out = [(seg.start, first, "image turn")] if first > seg.start else []
    out += [(a, b, "image patches") for a, b in _cut(first, last, cuts, last - first)]
    return out + ([(last, seg.end, "image turn")] if seg.end > last else [])


def automatic_spans(session: Any, mode: str, end: int | None = None, max_tokens: int = MAX_SPAN_TOKENS) -> list[Span]:
    """The context's spans in `mode` (see the module doc), over positions [0, end) (default: every token).

    Image segments are always cut into groups of patch rows (their text has no sentences)."""
    if mode not in SPAN_MODES:
        raise InputError(f"spans must be one of {', '.join(SPAN_MODES)} or a list of (start, end) spans, got {mode!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InputError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    end = len(session.tokens) if end is None else end
    tokens = session.tokens
    text_of = _TokenText(session.tokenizer)
    out: list[Span] = []
    for seg in session.segments:
        lo, hi = seg.start, min(seg.end, end)
        if hi <= lo:
            continue
        if seg.kind == "image":
            out += [Span(a, b, seg.name, kind) for a, b, kind in _image_groups(seg, IMAGE_GROUPS) if b <= end]
            continue
        if mode == "segments":
            out += [Span(a, b, seg.name, "segment") for a, b in _cut(lo, hi, (), max(max_tokens, hi - lo))]
            continue
        boundaries = []
        previous = ""
        for p in range(lo, hi):
            text = text_of(tokens[p])
            following = text_of(tokens[p + 1]) if p + 1 < hi else ""
            if mode == "sentences" and _ends_sentence(text, following):
                boundaries.append(p + 1)
            elif mode == "paragraphs" and "\n\n" in previous[-1:] + text:
                boundaries.append(p + 1)
            previous = text or previous
        kind = "sentence" if mode == "sentences" else "paragraph"
        pieces: list[tuple[int, int]] = []
        for a, b in _cut(lo, hi, boundaries, max_tokens):
            # a piece of white space only (a blank line between sentences) joins the span before it
            if pieces and not "".join(text_of(tokens[p]) for p in range(a, b)).strip():
                pieces[-1] = (pieces[-1][0], b)
            else:
                pieces.append((a, b))
        out += [Span(a, b, seg.name, kind) for a, b in pieces]
    return out


def given_spans(spans: Any, end: int) -> list[Span]:
    """Spans given by the caller: (start, end) or (label, start, end) items, each inside [0, end)."""
    if isinstance(spans, (str, bytes)) or not isinstance(spans, Sequence):
        raise InputError(f"spans must be one of {', '.join(SPAN_MODES)} or a list of (start, end) spans, got "
                         f"{type(spans).__name__}")
    if not spans:
        raise InputError("spans: the list is empty; give at least one (start, end) span")
    out = []
    for i, item in enumerate(spans):
        if isinstance(item, Span):
            label, start, stop = item.label, item.start, item.end
        elif isinstance(item, (list, tuple)) and len(item) in (2, 3):
            label, (start, stop) = (str(item[0]), item[1:]) if len(item) == 3 else (f"span {i}", item)
        else:
            raise InputError(f"spans[{i}]: each span is (start, end) or (label, start, end), got {item!r:.80}")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, stop)):
            raise InputError(f"spans[{i}]: start and end must be integer token positions, got {item!r:.80}")
        if not 0 <= start < stop <= end:
            raise InputError(f"spans[{i}] ({label}): [{start}, {stop}) is not inside the context's {end} tokens "
                             "(positions are end exclusive)")
        out.append(Span(int(start), int(stop), label, "given"))
    return out


def span_text(session: Any, span: Span, limit: int = 400) -> str:
    """The span's text (cut to `limit` characters with an ellipsis: a JSON result stays readable)."""
    if session.tokenizer is None:
        return f"tokens {span.start}:{span.end}"
    text = session.tokenizer.decode(list(session.tokens[span.start:span.end]))
    return text if len(text) <= limit else text[: limit - 1] + "…"


__all__ = ["SPAN_MODES", "MAX_SPAN_TOKENS", "Span", "automatic_spans", "given_spans", "span_text"]
