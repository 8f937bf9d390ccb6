"""The dashboard's views inline in a notebook: what `workbench.show` loads (entry point `k3_workbench.views`).

    inline_view(trace, views=["session", "kda"])  -> InlineView (a Panel Viewer; the cell displays it)

The same components, reducers and follower as the served dashboard, without the sidebar or drive
mode: one `Dashboard(drive=False)` per cell, whose follower thread tails the trace and whose periodic
callback (an asyncio task on the kernel's event loop, so it runs while no cell is busy) applies new
frames. The views redraw by changing their Bokeh models in place; in a notebook those changes reach
the page only when pushed over the comm (`pn.io.push_notebook`, which the server does by itself),
so the notebook dashboard pushes its layout after every frame it applies.
"""

from __future__ import annotations

import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import panel as pn

from apps.dashboard.app import Dashboard, DashboardConfig
from apps.dashboard.views import VIEWS



def view_names() -> list[str]:
    """The names `show(views=...)` accepts: the session map and every registered view (`views.VIEWS`)."""
    return ["session", *VIEWS]


def default_views() -> list[str]:
    """What `show()` shows when no views are named."""
    return ["session", *(n for n, spec in VIEWS.items() if spec.notebook)]


def _load_extension() -> None:
    """Make the page load BokehJS and Panel from the Jupyter server itself, in every cell that shows a view.

    Where the page gets them from decides whether a view renders, now and after the tab is reloaded:
    - `pn.extension()` alone makes it fetch them from cdn.bokeh.org / cdn.holoviz.org: offline (CI, an
      air-gapped cluster) that fails, Panel logs "Bokeh or Panel library is missing", and the view
      stays an empty div;
    - inline, the 3 MB bundle is the cell's output, twice (two mimetypes): a saved notebook weighs
      6-7 MB, and only the one cell that first loaded Panel holds it; a reloaded tab whose views sit
      in other cells (or after that cell ran again) renders them without BokehJS: empty again.
    So each cell that shows a view starts with a small loader (`publish_loader`) that fetches the
    files from the Jupyter server (Panel's server extension serves them under `panel-preview/static/`)
    when the page does not have them yet: a reloaded tab loads them again from the first such cell.
    The views' stylesheets stay inline (`pn.config.inline`), so nothing is fetched from outside the
    Jupyter server. Outside a kernel there is no page to load into, and Panel's global settings are
    left alone (a dashboard served from the same process keeps serving its resources as files).
    """
    if not _in_kernel():
        return
    if not getattr(pn.extension, "_loaded", False) or not pn.config.inline:
        with _loader_instead_of_bundle():
            pn.extension(inline=True)
    else:
        publish_loader()


@contextmanager
def _loader_instead_of_bundle() -> Iterator[None]:
    """While `pn.extension()` sets up the kernel side (comm manager, config), its page loader is ours."""
    import panel.io.notebook as panel_notebook

    original = panel_notebook.load_notebook
    panel_notebook.load_notebook = lambda *args, **kwargs: publish_loader()
    try:
        yield
    finally:
        panel_notebook.load_notebook = original


# where a Jupyter server with Panel's server extension serves Bokeh's and Panel's static files, below its base URL
SERVED_AT = "panel-preview/"
_URL_LISTS = re.compile(r"const (js_urls|js_modules|css_urls) = (\[.*?\]);")


def loader_js() -> str:
    """Panel's page loader, fetching BokehJS and Panel from the Jupyter server (see `_load_extension`).

    Panel builds it with relative URLs (`static/js/bokeh.min.js`); in the page they are made absolute on
    the server's base URL (JupyterLab's page config, `/` without one), and nothing is loaded when the page
    already has this Bokeh with Panel (another cell's loader ran).
    """
    import bokeh
    from bokeh.resources import Resources as BokehResources
    from panel.io.notebook import _autoload_js, require_components
    from panel.io.resources import Resources, bundle_resources, set_resource_mode

    with set_resource_mode("server"):
        resources = Resources.from_bokeh(BokehResources(mode="server"), notebook=True)
        bundle = bundle_resources(None, resources, notebook=True, reloading=False, enable_mathjax=False)
        configs, requirements, exports, skip_imports = require_components()
        js = _autoload_js(bundle=bundle, configs=configs, requirements=requirements, exports=exports,
                          skip_imports=skip_imports, ipywidget=False, reloading=False)
    js, found = _URL_LISTS.subn(r"const \1 = \2.map(k3wbServed);", js)
    if found != 3:
        raise RuntimeError("Panel's page loader changed: its js_urls / js_modules / css_urls lists were not found")
    version = bokeh.__version__.replace("rc", "-rc.").replace(".dev", "-dev.")
    served = f"""const k3wbServed = (url) => {{
  if (/^([a-z]+:)?\\/\\//i.test(url) || url.startsWith("/")) {{ return url; }}
  const config = document.getElementById("jupyter-config-data");
  let base = "/";
  try {{ base = (config && JSON.parse(config.textContent).baseUrl) || document.body.dataset.baseUrl || "/"; }}
  catch (e) {{ base = "/"; }}
  return base.replace(/\\/?$/, "/") + "{SERVED_AT}" + url;
}};
"""
    return (f"(function() {{ const have = window.Bokeh;\n"
            f"if (have && have.version === {version!r} && have.Panel) {{ return; }}\n{served}{js}\n}})();")


def publish_loader() -> None:
    """Display the page setup a view needs: Panel's notebook CSS, `loader_js`, and Panel's comm manager (what
    `pn.extension` displays, with the loader in place of the inline bundle)."""
    import bokeh.io.notebook
    from IPython.display import publish_display_data
    from panel.io.notebook import LOAD_MIME, PANEL_DIR, PYVIZ_PROXY, _JupyterCommManager, nb_mime_js

    css = (PANEL_DIR / "_templates" / "jupyter.css").read_text(encoding="utf-8")
    shim = '<script type="esms-options">{"shimMode": true}</script>'
    publish_display_data(data={"text/html": f"{shim}<style>{css}</style>"})
    js = loader_js()
    publish_display_data({"application/javascript": js, LOAD_MIME: js})
    bokeh.io.notebook.curstate().output_notebook()
    comms = "\n".join([PYVIZ_PROXY, _JupyterCommManager.js_manager, nb_mime_js])
    publish_display_data(data={LOAD_MIME: comms, "application/javascript": comms})


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return hasattr(get_ipython(), "kernel")


# how long frames wait for the page to report that it drew the view, before they are applied anyway
PAGE_WAIT_S = 10.0


class NotebookDashboard(Dashboard):
    """The dashboard, pushing each applied frame to the notebook page (a no-op outside a notebook).

    Frames wait until the page has drawn the view: pyviz_comms drops every message for a view that
    is not yet in Bokeh's index, so a frame pushed while the page still builds the view would be lost
    (and for a finished trace no later frame would bring it). The width probe is the signal: the page
    sends its width once the view is laid out. A notebook run without a page (nbclient) gets its
    frames after `PAGE_WAIT_S`. (This did not measurably change the rare BokehJS receiver errors the
    JupyterLab browser test tolerates once; see tests/apps/test_jupyterlab.py.)
    """

    layout: pn.viewable.Viewable | None = None
    shown_at: float | None = None

    def _page_ready(self) -> bool:
        if self.probe.px > 0:
            return True
        return self.shown_at is not None and time.monotonic() - self.shown_at > PAGE_WAIT_S

    def _tick(self) -> None:
        if not self._page_ready():
            return
        before = self.state.frame
        super()._tick()
        if self.state.frame is not before and self.layout is not None:
            pn.io.push_notebook(self.layout)


class InlineView(pn.viewable.Viewer):
    """Some of the dashboard's views over one trace, followed live. `close()` stops following."""

    def __init__(self, trace: str | Path, views: Sequence[str] | None = None, *, refresh_ms: int = 300,
                 interval: float = 0.5, **params: Any) -> None:
        names = default_views() if views is None else list(views)
        unknown = [n for n in names if n not in view_names()]
        if unknown or not names:
            raise ValueError(f"views must be a non-empty list of {', '.join(view_names())}; got {names}")
        super().__init__(**params)
        config = DashboardConfig(trace=Path(trace), drive=False, refresh_ms=refresh_ms, interval=interval)
        self.dashboard = NotebookDashboard(config)
        self.names = names
        self._layout: pn.Column | None = None

    @property
    def state(self) -> Any:
        """The `DashboardState` every view follows (its `frame` is the latest shown)."""
        return self.dashboard.state

    def __panel__(self) -> pn.viewable.Viewable:
        if self._layout is None:
            dash = self.dashboard
            dash.start(sync=True)
            views = [dash.session_map if n == "session" else dash.view(n) for n in self.names]
            self._layout = pn.Column(dash.probe, dash.alert, dash.source, *views, sizing_mode="stretch_width",
                                     css_classes=["k3-inline"])
            dash.layout = self._layout
            dash.shown_at = time.monotonic()
        return self._layout

    def close(self) -> None:
        self.dashboard.close()


def inline_view(trace: Path, *, views: Sequence[str] | None = None, **options: Any) -> InlineView:
    """The provider `workbench.show` calls: load Panel's notebook extension, then the views of `trace`."""
    _load_extension()
    return InlineView(trace, views, **options)
