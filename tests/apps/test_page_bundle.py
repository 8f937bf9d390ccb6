"""The served dashboard page leaves out BokehJS's MathJax bundle; other Panel pages of the process keep it.

No browser: the page's HTML names the scripts it loads (`apps/dashboard/page_bundle.py`)."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import panel as pn

from apps.dashboard.app import DashboardConfig, url
from k3testing.browser import free_port, start_server


def _html(address: str) -> str:
    with urllib.request.urlopen(address, timeout=60) as response:
        return response.read().decode()


def test_dashboard_page_has_no_mathjax_bundle_and_other_pages_keep_it(small_trace: Path) -> None:
    config = DashboardConfig(trace=small_trace, root=small_trace.parent, drive=False)
    server = start_server(config)
    port = free_port()
    plain = pn.serve({"/": lambda: pn.template.BootstrapTemplate(title="plain", main=[pn.pane.HTML("<p>x</p>")])},
                     port=port, address="127.0.0.1", show=False, threaded=True)
    try:
        page = _html(url(config))
        assert "bokeh.min.js" in page and "panel.min.js" in page
        assert "bokeh-mathjax" not in page
        deadline = time.monotonic() + 30
        while True:  # the plain server's thread may still be starting
            try:
                other = _html(f"http://127.0.0.1:{port}/")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert "bokeh-mathjax" in other  # Panel's own choice for a page with an HTML pane, untouched
    finally:
        server.stop()
        plain.stop()
