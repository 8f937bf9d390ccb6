"""The dashboard's page loads BokehJS without its MathJax bundle.

Panel adds `bokeh-mathjax.min.js` (1.8 MB, the largest script of the page) to every served page that
holds an HTML pane, in case one of them holds TeX. No pane of the dashboard renders TeX: trace text,
file names and errors are shown verbatim (escaped on the server). Parsing that bundle is a large
share of the CPU an empty page costs the browser (docs/benchmarks.md); without it BokehJS leaves
TeX-like text in a pane untypeset, which suits a dashboard that shows text as it came.

    without_mathjax(document)   mark a served document: its page is bundled without MathJax
    install()                   wrap Panel's page bundler once (idempotent), so marked documents get
                                enable_mathjax=False; every other page of the process is unchanged

Panel renders a session's page inside `set_curdoc(session.document)` and calls
`panel.io.server.bundle_resources(doc.roots, resources)` with `enable_mathjax="auto"`; the wrapper
reads the mark from that document. `tests/apps/test_page_bundle.py` checks a served dashboard page
and a plain Panel page from the same server process, so a Panel upgrade that moves the bundler shows.
"""

from __future__ import annotations

from typing import Any

import panel as pn
import panel.io.server as panel_server

MARK = "k3wb_without_mathjax"  # a template variable of the marked document


def without_mathjax(document: Any) -> None:
    """Serve `document`'s page without the MathJax bundle (call `install()` once as well)."""
    document.template_variables[MARK] = True


def install() -> None:
    """Wrap Panel's page bundler so marked documents are bundled without MathJax (once per process)."""
    original = panel_server.bundle_resources
    if getattr(original, "_k3wb_wrapped", False):
        return

    def bundle_resources(roots: Any, resources: Any, *args: Any, **kwargs: Any) -> Any:
        document = pn.state.curdoc
        if document is not None and document.template_variables.get(MARK) and not args:
            kwargs.setdefault("enable_mathjax", False)
        return original(roots, resources, *args, **kwargs)

    bundle_resources._k3wb_wrapped = True  # type: ignore[attr-defined]
    panel_server.bundle_resources = bundle_resources


def cache_stylesheets(document: Any) -> None:
    """Let Panel build one `ImportedStyleSheet` per CSS file while it builds `document`'s models.

    Panel keeps a per-document cache of them (`state._stylesheets`, read where a pane's properties are
    made) but fills it only when a theme is applied, after the models exist: building a dashboard page
    made 178 stylesheet models for 12 files, ~0.4 s of the server's page build under load. An entry
    made before the build is used from the first pane on (`tests/apps/test_first_paint.py` checks it,
    so a Panel upgrade that moves the cache shows)."""
    from panel.io.state import state

    if document not in state._stylesheets:
        state._stylesheets[document] = {}


def share_stylesheets(document: Any) -> int:
    """One `ImportedStyleSheet` model per URL in `document` (returns how many copies were dropped).

    Panel gives every pane and widget its own stylesheet models for the same few CSS files (a dashboard
    page held 178 of them for 12 URLs, a quarter of its models: `loading.css` alone 111 times); each is a
    model the server builds and serialises and the browser builds, on every page open. BokehJS makes a
    fresh `<link>` from the model for every view that lists it (`ImportedStyleSheet.underlying`), so views
    sharing one model are styled as before. Models added later (a view filled in, a widget restyled)
    get Panel's own copies again."""
    from bokeh.models import ImportedStyleSheet

    canonical: dict[str, Any] = {}
    dropped = 0
    for model in list(document.models):
        sheets = getattr(model, "stylesheets", None)
        if not sheets:
            continue
        shared = [canonical.setdefault(s.url, s) if type(s) is ImportedStyleSheet else s for s in sheets]
        same = sum(a is b for a, b in zip(shared, sheets))
        if same != len(sheets):
            dropped += len(sheets) - same
            model.stylesheets = shared
    return dropped
