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
