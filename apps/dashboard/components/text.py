"""Plain text in the page, escaped on the server.

Panel's `Str`, `Markdown` and `Alert` panes hand their text to the browser as HTML (in Panel 1.9 a
`Str` holding `<img onerror=...>` runs the handler, and embedded `<script>` runs too), so anything
that can come from a trace, a file name, a URL parameter or a token goes through `html.escape`
here before it reaches a pane. Tests check this with hostile token text in a real browser.

The views' HTML and Alert panes are `HTML` / `Alert` from here: Panel's own re-send every stylesheet
link with each new text, resolved afresh, which inside a notebook kernel points at cdn.holoviz.org
(the links inlined when the cell was drawn come back as links, and an offline page fails to load
them). A pane's stylesheets are set when it is built and a change of its `stylesheets` parameter still
reaches the page through Panel's parameter sync, so a text update sends the text only.
"""

from __future__ import annotations

import html

import panel as pn


class _TextOnlyUpdates:
    """Mixin for Panel's HTML-based panes: an `object` change sends the stylesheets only when the pane's
    `stylesheets` parameter changed since they were last sent to that page (Panel sends a pane's
    stylesheets only with its next re-render, so that is where the change goes)."""

    def _get_model(self, doc, root=None, parent=None, comm=None):
        model = super()._get_model(doc, root, parent, comm)
        self._stylesheets_sent = {**getattr(self, "_stylesheets_sent", {}), (root or model).ref["id"]: list(self.stylesheets)}
        return model

    def _update(self, ref: str, model) -> None:
        props = self._get_properties(model.document)
        sent = getattr(self, "_stylesheets_sent", {})
        if ref in sent and sent[ref] == list(self.stylesheets):
            props.pop("stylesheets", None)
        self._stylesheets_sent = {**sent, ref: list(self.stylesheets)}
        model.update(**props)


class HTML(_TextOnlyUpdates, pn.pane.HTML):
    """`pn.pane.HTML` whose text updates leave the stylesheets the page already has."""


class Alert(_TextOnlyUpdates, pn.pane.Alert):
    """`pn.pane.Alert` whose text updates leave the stylesheets the page already has."""


def pre(text: str) -> str:
    """`text` as preformatted, escaped HTML."""
    return f"<pre class='k3-pre' style='margin:0;white-space:pre-wrap'>{html.escape(text)}</pre>"


def text_pane(text: str = "", **params) -> HTML:
    """An HTML pane showing `text` verbatim (escaped); update it with `set_text`."""
    return HTML(pre(text), **params)


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
