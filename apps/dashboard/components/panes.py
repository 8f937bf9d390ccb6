"""Plain text in the page, escaped on the server.

Panel's `Str`, `Markdown` and `Alert` panes hand their text to the browser as HTML (in Panel 1.9 a
`Str` holding `<img onerror=...>` runs the handler, and embedded `<script>` runs too), so anything
that can come from a trace, a file name, a URL parameter or a token goes through `html.escape`
here before it reaches a pane. Tests check this with hostile token text in a real browser.

`HTMLText` / `AlertText` are the HTML and Alert panes the views update: Panel's own panes send their
stylesheets again (new model objects) with every new text, and a model-valued property change makes
Bokeh re-index every model of the document (for every update, a dozen per frame); these send only the changed text and properties. Inside a notebook kernel the re-sent
stylesheets were also links to cdn.holoviz.org (Panel resolves them afresh), replacing the CSS inlined
when the cell was drawn, so an offline page failed to load 9 of them per frame.
"""

from __future__ import annotations

import html
import re
from typing import Any

import panel as pn


class _KeepStylesheets:
    """Mixin for Panel's HTML-like panes: an update of `object` sends the stylesheets only when the pane's
    `stylesheets` parameter changed since they were last sent to that page (Panel sends a pane's
    stylesheets only with its next text, so that is where such a change must still go)."""

    def _get_model(self, doc: Any, root: Any = None, parent: Any = None, comm: Any = None) -> Any:
        model = super()._get_model(doc, root, parent, comm)
        self._stylesheets_sent = {**getattr(self, "_stylesheets_sent", {}), (root or model).ref["id"]: list(self.stylesheets)}
        return model

    def _update(self, ref: str, model: Any) -> None:
        props = self._get_properties(model.document)
        sent = getattr(self, "_stylesheets_sent", {})
        if ref in sent and sent[ref] == list(self.stylesheets):
            props.pop("stylesheets", None)
        self._stylesheets_sent = {**sent, ref: list(self.stylesheets)}
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


# Markdown's punctuation: escaped with a backslash, a trace name like `![x](http://elsewhere/p.png)` in an
# error stays text instead of becoming an image fetched from another site (or a link, a heading, a list)
_MARKDOWN_PUNCTUATION = re.compile(r"([\\`*_{}\[\]()#+\-.!|~=:])")


def alert_text(text: str) -> str:
    """Text for an Alert (a Markdown pane): HTML- and Markdown-escaped, so markup in it stays text."""
    return html.escape(_MARKDOWN_PUNCTUATION.sub(r"\\\1", text))


def show_message(alert: Any, message: str) -> None:
    """A panel's status line in its Alert: escaped, red for an "error: ..." line, hidden when empty."""
    alert.object = alert_text(message)
    alert.alert_type = "danger" if message.startswith("error:") else "info"
    alert.visible = bool(message)
