"""Two tiny browser-side components (Panel `JSComponent`, no build step, no network):

- `TokenStrip`: generated text as clickable tokens. Clicking a token sets `selected` (its position),
  which the dashboard links to the shared selection. Pieces are inserted with `textContent`, so a
  document containing `<script>` is shown as text, never parsed as HTML.
- `WidthProbe`: reports its own pixel width, so the server bins position axes to the screen.
"""

from __future__ import annotations

import param
from panel.custom import JSComponent


class TokenStrip(JSComponent):
    """Clickable tokens: `tokens` is a list of [position, piece]; `selected` is the clicked position."""

    tokens = param.List(default=[], doc="[[position, piece], ...] shown in order (the server caps the length)")
    selected = param.Integer(default=None, allow_None=True, doc="position of the clicked token (None: none)")
    placeholder = param.String(default="(no generated text yet)", doc="shown while there are no tokens")

    _esm = """
export function render({ model, el }) {
  // one style sheet for every token (inline styles per span cost the browser a style recalculation each)
  const sheet = document.createElement('style');
  sheet.textContent = '.k3-tokens { font-family: ui-monospace, monospace; font-size: 13px; line-height: 1.7;' +
    ' white-space: pre-wrap; overflow-wrap: anywhere; word-break: break-all; overflow-y: auto;' +
    ' max-height: 160px; padding: 4px; width: 100%; box-sizing: border-box; }' +
    ' .k3-token { cursor: pointer; border-bottom: 1px dotted #999; }' +
    ' .k3-token.k3-selected { background: #ffd54f; }';
  const box = document.createElement('div');
  box.className = 'k3-tokens';
  el.append(sheet, box);
  let shown = null;
  const paint = () => {
    if (shown !== null) { shown.classList.remove('k3-selected'); shown = null; }
    if (model.selected === null || model.selected === undefined) { return; }
    const hit = box.querySelector(`[data-pos="${Number(model.selected)}"]`);
    if (hit) { hit.classList.add('k3-selected'); shown = hit; }
  };
  box.onclick = (event) => {
    const s = event.target.closest('.k3-token');
    if (s) { model.selected = Number(s.dataset.pos); paint(); }
  };
  const draw = () => {
    const stick = box.scrollTop + box.clientHeight >= box.scrollHeight - 4;
    shown = null;
    if (!model.tokens.length) {
      const p = document.createElement('i');
      p.textContent = model.placeholder;
      box.replaceChildren(p);
      return;
    }
    const spans = document.createDocumentFragment();
    for (const [pos, piece] of model.tokens) {
      const s = document.createElement('span');
      s.className = 'k3-token';
      s.dataset.pos = pos;
      s.title = 'position ' + pos;
      s.textContent = piece;  // text, never HTML
      spans.append(s);
    }
    box.replaceChildren(spans);
    paint();
    if (stick) { box.scrollTop = box.scrollHeight; }
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
