"""Two tiny browser-side components (Panel `JSComponent`, no build step, no network):

- `TokenStrip`: generated text as clickable tokens. Clicking a token sets `selected` (its position),
  which the dashboard links to the shared selection. Pieces are inserted with `textContent`, so a
  document containing `<script>` is shown as text, never parsed as HTML.
- `WidthProbe`: reports its own pixel width, so the server bins position axes to the screen.
- `strip_tokens(generated)`: the strip's rows; a chat's structure (control tags such as `<|close|>`
  and the tag names between `<|open|>`/`<|close|>` and `<|sep|>`) is drawn as small grey marks
  (still clickable, the tag in its tooltip), so "Generated text" reads as the answer.
"""

from __future__ import annotations

import re
from typing import Iterable

import param
from panel.custom import JSComponent


STRIP_HEIGHT = 160  # pixels: about seven lines of tokens
# a tokenizer's control pieces: <|close|>, <|sep|>, <|end_of_msg|>, [BOS], [EOS], <|media_pad|>, ...
CONTROL_PIECE = re.compile(r"^(<\|[A-Za-z0-9_:\-]{1,40}\|>|\[(BOS|EOS|PAD|UNK)\])$")


def strip_tokens(generated: Iterable[tuple[int, str]]) -> list[list]:
    """[[position, piece, control], ...] for `TokenStrip.tokens`: `control` marks a chat structure
    token (a control piece, or the tag name after `<|open|>` / `<|close|>` up to `<|sep|>`)."""
    rows: list[list] = []
    in_tag = False
    for position, piece in generated:
        control = bool(CONTROL_PIECE.match(piece))
        if piece in ("<|open|>", "<|close|>"):
            in_tag = True
        elif piece == "<|sep|>" or (control and in_tag):
            in_tag = False
        elif in_tag:
            control = True
        rows.append([position, piece, control])
    return rows


class TokenStrip(JSComponent):
    """Clickable tokens: `tokens` is a list of [position, piece]; `selected` is the clicked position."""

    tokens = param.List(default=[], doc="[[position, piece(, control)], ...] shown in order (the server caps the "
                                        "length); a control token is drawn as a small grey mark (`strip_tokens`)")
    selected = param.Integer(default=None, allow_None=True, doc="position of the clicked token (None: none)")
    placeholder = param.String(default="(no generated text yet)", doc="shown while there are no tokens")

    def __init__(self, **params) -> None:
        # a fixed height (the text scrolls inside): the strip's module renders after the page's first
        # layout, and a strip that then grew to its text's height made the browser lay the whole page
        # out again (about a quarter of a second per page open); a live session's streaming text no
        # longer pushes the views below it down either
        params.setdefault("height", STRIP_HEIGHT)
        super().__init__(**params)

    _esm = """
export function render({ model, el }) {
  // one style sheet for every token (inline styles per span cost the browser a style recalculation each)
  const sheet = document.createElement('style');
  sheet.textContent = '.k3-tokens { font-family: ui-monospace, monospace; font-size: 13px; line-height: 1.7;' +
    ' white-space: pre-wrap; overflow-wrap: anywhere; word-break: break-all; overflow-y: auto;' +
    ' height: 100%; padding: 4px; width: 100%; box-sizing: border-box; contain: content; }' +
    ' .k3-token { cursor: pointer; border-bottom: 1px dotted #999; }' +
    ' .k3-token.k3-selected { background: #ffd54f; }' +
    ' .k3-token.k3-control { display: inline-block; width: 5px; height: 0.9em; margin: 0 1px; background: #ccc;' +
    ' border: none; vertical-align: middle; overflow: hidden; color: transparent; font-size: 1px; }';
  const box = document.createElement('div');
  box.className = 'k3-tokens';
  el.append(sheet, box);
  // a span carries only its class and its text: the position lives in `positions` (span i = token i) and
  // the "position N" tooltip is set when the pointer first rests on a span, so a thousand tokens cost a
  // thousand small elements and nothing more (no per-span attributes to create, store and match)
  let positions = [];
  let shown = null;
  const index = (span) => Array.prototype.indexOf.call(box.children, span);
  const paint = () => {
    if (shown !== null) { shown.classList.remove('k3-selected'); shown = null; }
    if (model.selected === null || model.selected === undefined) { return; }
    const i = positions.indexOf(Number(model.selected));
    if (i >= 0) { shown = box.children[i]; shown.classList.add('k3-selected'); }
  };
  box.onclick = (event) => {
    const s = event.target.closest('.k3-token');
    if (s) { model.selected = positions[index(s)]; paint(); }
  };
  box.onmouseover = (event) => {
    const s = event.target.closest('.k3-token');
    if (s && !s.title) { s.title = 'position ' + positions[index(s)] + (s.dataset.tag ? ': ' + s.dataset.tag : ''); }
  };
  const span = (piece, control) => {
    const s = document.createElement('span');
    s.className = control ? 'k3-token k3-control' : 'k3-token';
    if (control) { s.dataset.tag = piece; } else { s.textContent = piece; }  // text, never HTML
    return s;
  };
  const draw = () => {
    // reading the box's scroll geometry makes the browser lay out the page there and then: only a strip that
    // already shows tokens asks whether the reader is at its end (the first draw goes to the end, in the next
    // frame, when the page is laid out anyway)
    const stick = positions.length === 0 || box.scrollTop + box.clientHeight >= box.scrollHeight - 4;
    const tokens = model.tokens;
    if (!tokens.length) {
      const p = document.createElement('i');
      p.textContent = model.placeholder;
      box.replaceChildren(p);
      positions = [];
      shown = null;
      return;
    }
    // while a session streams, the new list extends the shown one: append only the new tokens
    const n = positions.length;
    const extends_shown = n > 0 && n <= tokens.length && positions[0] === tokens[0][0] &&
      positions[n - 1] === tokens[n - 1][0];
    const spans = document.createDocumentFragment();
    for (let i = extends_shown ? n : 0; i < tokens.length; i++) { spans.append(span(tokens[i][1], tokens[i][2] === true)); }
    if (extends_shown) { box.append(spans); } else { box.replaceChildren(spans); shown = null; }
    positions = tokens.map((t) => t[0]);
    paint();
    if (stick) { requestAnimationFrame(() => { box.scrollTop = box.scrollHeight; }); }
  };
  draw();
  model.on('tokens', draw);
  model.on('selected', paint);
}
"""


def link_selection(strip: TokenStrip, state: param.Parameterized) -> None:
    """Keep `strip.selected` and the shared `state.position` in step, both ways (every view that
    shows clickable tokens selects the same token)."""

    def clicked(event: param.parameterized.Event) -> None:
        if event.new is not None:
            state.position = event.new

    def moved(event: param.parameterized.Event) -> None:
        strip.selected = event.new

    strip.param.watch(clicked, "selected")
    state.param.watch(moved, "position")


class WidthProbe(JSComponent):
    """An empty strip that reports its width in CSS pixels (`px`), debounced, on load and on resize."""

    px = param.Integer(default=0, doc="measured width in CSS pixels (0 until the browser reports it)")

    _esm = """
export function render({ model, el }) {
  let timer = null;
  const report = () => {
    clearTimeout(timer);
    timer = setTimeout(() => { const w = Math.round(el.getBoundingClientRect().width); if (w > 0) model.px = w; }, 250);
  };
  const observer = new ResizeObserver(report);
  observer.observe(el);
  report();
  model.on('remove', () => observer.disconnect());
}
"""
