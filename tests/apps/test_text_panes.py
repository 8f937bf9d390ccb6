"""Text updates of the views' HTML/Alert panes send the text only, never the stylesheets again.

Panel's own panes re-send every stylesheet link with each new text; inside a notebook kernel those
links point at cdn.holoviz.org, so the CSS that was inlined when the cell was drawn came back as links
an offline page fails to load (the JupyterLab browser test saw 9 such requests per frame)."""

from __future__ import annotations

from bokeh.document import Document
from bokeh.models import InlineStyleSheet

from apps.dashboard.components.panes import AlertText, HTMLText, set_text, text_pane


def _rendered(pane):
    doc = Document()
    model = pane.get_root(doc)
    return model


def test_text_update_keeps_the_stylesheets_the_page_has() -> None:
    for pane, update in ((text_pane("first"), lambda p: set_text(p, "second <b>")),
                         (HTMLText("<p>a</p>"), lambda p: setattr(p, "object", "<p>b</p>")),
                         (AlertText("a", alert_type="info"), lambda p: setattr(p, "object", "b"))):
        model = _rendered(pane)
        inlined = [InlineStyleSheet(css=".x{}")]   # what the notebook render put there in place of links
        model.stylesheets = inlined
        update(pane)
        assert model.stylesheets == inlined, type(pane).__name__
        assert "second &lt;b&gt;" in model.text or "b" in model.text


def test_stylesheets_parameter_changes_still_reach_the_model() -> None:
    """As in Panel, a pane's new `stylesheets` reach the page with its next text."""
    pane = HTMLText("<p>a</p>")
    model = _rendered(pane)
    before = len(model.stylesheets)
    pane.stylesheets = [".k3-new { color: red; }"]
    pane.object = "<p>b</p>"
    assert len(model.stylesheets) == before + 1 and "b" in model.text
    pane.object = "<p>c</p>"   # unchanged since: not sent again
    assert len(model.stylesheets) == before + 1 and "c" in model.text
