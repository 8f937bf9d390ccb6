"""Plain text in the page, escaped on the server.

Panel's `Str`, `Markdown` and `Alert` panes hand their text to the browser as HTML (in Panel 1.9 a
`Str` holding `<img onerror=...>` runs the handler, and embedded `<script>` runs too), so anything
that can come from a trace, a file name, a URL parameter or a token goes through `html.escape`
here before it reaches a pane. Tests check this with hostile token text in a real browser.

`HTMLText` / `AlertText` are the HTML and Alert panes the views update: Panel's own panes send their
stylesheets again (new model objects) with every new text, and a model-valued property change makes
Bokeh re-index every model of the document (about 70 ms per update with ~450 models, a dozen per
frame); these send only the changed text and properties.
"""

from __future__ import annotations

import html
from typing import Any

import panel as pn


class _KeepStylesheets:
    """Mixin for Panel's HTML-like panes: an update of `object` leaves the model's stylesheets as they are."""

    def _update(self, ref: str, model: Any) -> None:
        props = self._get_properties(model.document)
        props.pop("stylesheets", None)  # unchanged (a change of the `stylesheets` param takes Panel's other path)
        model.update(**props)


class HTMLText(_KeepStylesheets, pn.pane.HTML):
    """`pn.pane.HTML` that sends only its text and changed properties when `object` changes."""


class AlertText(_KeepStylesheets, pn.pane.Alert):
    """`pn.pane.Alert` that sends only its text and changed properties when `object` changes."""


def pre(text: str) -> str:
    """`text` as preformatted, escaped HTML."""
    return f"<pre class='k3-pre' style='margin:0;white-space:pre-wrap'>{html.escape(text)}</pre>"


def text_pane(text: str = "", **params) -> pn.pane.HTML:
    """An HTML pane showing `text` verbatim (escaped); update it with `set_text`."""
    return HTMLText(pre(text), **params)


def set_text(pane: pn.pane.HTML, text: str) -> None:
    pane.object = pre(text)


def html_table(css_class: str, headers: list[str], rows: list[list[str]]) -> str:
    """An HTML table in the views' style. `headers` are escaped here; `rows` hold cells that are
    already HTML (each caller escapes what came from a trace and may add its own markup)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table class='{css_class}' style='font-size:12px;width:100%'><tr>{head}</tr>{body}</table>"


def alert_text(text: str) -> str:
    """Text for an Alert (a Markdown pane): escaped, so markup in it stays text."""
    return html.escape(text)
