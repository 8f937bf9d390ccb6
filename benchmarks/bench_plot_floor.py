"""What the plotting library alone costs the dashboard's page: its Bokeh figures, with a trace's data, and nothing else.

    python benchmarks/bench_plot_floor.py --trace-128k T [--rounds 5]

Four pages, served by one Panel server in this process, each opened in a fresh headless Chromium, interleaved
for --rounds rounds (medians printed, and each page over the empty one):

- empty: the dashboard's template with one text pane (as in `bench_dashboard.py`);
- figures: the same template holding only the Bokeh figures of every view of a dashboard following trace T
  (the visible figures its views place: the session map, DSA map, KDA state, KDA health and experts ones for the
  128K demo trace, each holding T's data), without any of the views' text, tables, widgets or sidebar;
- figures and sidebar: the same with the dashboard's sidebar (the source line and drive mode's controls), which
  every served page carries;
- one figure: the first of them alone (what the browser's first figure costs: BokehJS's plotting code and styles).

Why: the dashboard's goal for a 128K trace was every view drawn with data in under 2 s on this machine (issue 43).
The figures page is a floor under that number for any layout of the same figures with this plotting library: a
page that shows every view builds at least these figures. Each open's figures are built before the server starts
(the dashboards they come from too), so a page's time is the transfer's and the browser's. Seconds are from
navigation to the last figure's canvas visible. Needs /usr/bin/chromium and Playwright.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import panel as pn  # noqa: E402
from bokeh.models import Plot  # noqa: E402

from apps.dashboard.app import Dashboard, DashboardConfig  # noqa: E402
from apps.dashboard.components.seen import ShownWhenSeen  # noqa: E402
from k3testing.browser import Browser, chromium_available, free_port  # noqa: E402


def figures_of(obj: Any, found: list[Plot] | None = None) -> list[Plot]:
    """Every Bokeh figure in `obj`'s layout (Panel layouts, panes, viewers and places until seen), in page order."""
    found = [] if found is None else found
    if isinstance(obj, Plot):
        if obj.visible and obj not in found:
            found.append(obj)
    elif isinstance(obj, ShownWhenSeen):
        figures_of(obj.component, found)
    elif isinstance(obj, pn.pane.Bokeh):
        figures_of(obj.object, found)
    elif isinstance(obj, pn.layout.ListLike):
        for child in obj.objects:
            figures_of(child, found)
    elif isinstance(obj, pn.viewable.Viewer):
        figures_of(obj.__panel__(), found)
    return found


def _dashboard_parts(trace: Path) -> tuple[list[Plot], list]:
    """The figures of the page `workbench dashboard` serves for `trace` once every view is shown (the views the
    page places, as their components are built, each holding the trace's data), and its sidebar's items (the
    source line and drive mode's controls)."""
    dash = Dashboard(DashboardConfig(trace=trace, root=trace.parent))
    dash.state.sync()
    dash.state.poll()
    found: list[Plot] = []
    for placed in dash.views(until_seen=False):
        figures_of(placed, found)
    sidebar = dash.sidebar()
    dash.close()  # the figures keep the data they were given; nothing follows the trace any more
    return found, sidebar


def _page(items: list, sidebar: list | None = None) -> pn.template.BootstrapTemplate:
    done = pn.pane.HTML("<p>page drawn</p>", css_classes=["k3-floor-done"])
    side = {"sidebar": [pn.Column(*sidebar, sizing_mode="stretch_width")], "sidebar_width": 340} if sidebar else {}
    return pn.template.BootstrapTemplate(title="floor", main=[*items, done], **side)


def _bokeh(figures: list[Plot]) -> list:
    return [pn.pane.Bokeh(f, sizing_mode="stretch_width") for f in figures]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace-128k", type=Path, required=True, help="the trace whose dashboard's figures are drawn")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("artifacts/bench_plot_floor.json"))
    args = ap.parse_args()
    if not chromium_available():
        raise SystemExit("needs /usr/bin/chromium (apt-get install chromium)")
    # every open gets figures of its own (a Bokeh model belongs to one document), built before the server starts:
    # the pages' time is then the browser's and the transfer's, not the building of a dashboard per request
    opens = args.rounds + 1
    ready = {name: [_dashboard_parts(args.trace_128k) for _ in range(opens)]
             for name in ("figures", "figures_and_sidebar", "one_figure")}
    counted = ready["figures"][0][0]
    print(f"{len(counted)} figures: {[f.title.text if f.title is not None else type(f).__name__ for f in counted]}",
          flush=True)

    def with_sidebar() -> pn.template.BootstrapTemplate:
        figures, sidebar = ready["figures_and_sidebar"].pop()
        return _page(_bokeh(figures), sidebar)

    pages = {
        "empty": lambda: _page([]),
        "figures": lambda: _page(_bokeh(ready["figures"].pop()[0])),
        "figures_and_sidebar": with_sidebar,
        "one_figure": lambda: _page(_bokeh(ready["one_figure"].pop()[0][:1])),
    }
    canvases = {"empty": 0, "figures": len(counted), "figures_and_sidebar": len(counted), "one_figure": 1}
    port = free_port()
    server = pn.serve({f"/{name}": page for name, page in pages.items()}, port=port, address="127.0.0.1", show=False,
                      threaded=True, websocket_origin=[f"127.0.0.1:{port}"])
    runs: dict[str, list[float]] = {name: [] for name in pages}
    try:
        time.sleep(1.0)
        for r in range(args.rounds + 1):  # the first round warms the server's imports: not counted
            order = list(pages) if r % 2 == 0 else list(pages)[::-1]
            for name in order:
                with Browser() as browser:
                    start = time.perf_counter()
                    browser.page.goto(f"http://127.0.0.1:{port}/{name}", wait_until="commit", timeout=120_000)
                    browser.page.locator(".k3-floor-done").first.wait_for(state="visible", timeout=120_000)
                    if canvases[name]:
                        # a figure draws on several canvas layers; the last figure's are the last on the page
                        browser.page.locator(".bk-Figure canvas, .bk-Plot canvas").last.wait_for(state="visible",
                                                                                                 timeout=120_000)
                    if r:
                        runs[name].append(time.perf_counter() - start)
            if r:
                print(json.dumps({"round": r, **{k: round(v[-1], 2) for k, v in runs.items()}}), flush=True)
    finally:
        server.stop()
    median = {name: round(statistics.median(v), 2) for name, v in runs.items()}
    result = {"figures": len(counted), "rounds": args.rounds, "median_s": median,
              "over_empty_page_s": {k: round(v - median["empty"], 2) for k, v in median.items() if k != "empty"},
              "runs": runs}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
