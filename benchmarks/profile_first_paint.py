"""Where a dashboard page's first paint goes: the server's page build, the document's transfer, the browser's work.

    python benchmarks/profile_first_paint.py --trace T [--opens 3] [--profile-server 25]

One dashboard server in this process (the code of this tree) on trace T; each open is a fresh headless
Chromium. Per open it prints, in seconds from navigation (the browser's clock, `performance.now()`):

- html_received: the page's HTML in full (the server built the session's document before answering:
  Panel's `create_app`, the views' models, the template);
- scripts_done: DOMContentLoaded (BokehJS, Panel's bundle and the page's other scripts parsed and run);
- ws_open, doc_received: the websocket opened and the document pulled over it (its size in bytes);
- bokeh_views: BokehJS built a view for the document's roots (`Bokeh.index` holds them);
- first_view, first_screen: the session map's canvas visible; it and the DSA map (the views of the first
  screen) drawn with their data markers present;
- all_views, all_data: every view's canvas visible and its data marker present, scrolling to each view
  in turn (`Browser.wait_views`; a view below the first screen joins the page when scrolled near);
- the renderer's CPU (Chrome's Performance.getMetrics: script, layout, style recalculation, tasks) and the
  long tasks (> 50 ms) the page ran, with their total.

And the deterministic counts of the served document (Bokeh models by type, its JSON size) and, with
--profile-server N, the top N functions of a cProfile of the server's page build (`create_app` to
`server_doc`) for one page. The machine is shared: read the counts and the split, not one timing.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apps.dashboard import app as dashboard_app  # noqa: E402
from apps.dashboard.app import DashboardConfig, url  # noqa: E402
from k3testing.browser import VIEW_SELECTORS, Browser, start_server  # noqa: E402

# the views a 1400 x 1000 browser window shows before any scrolling
FIRST_SCREEN = (VIEW_SELECTORS["session"], VIEW_SELECTORS["dsa"])

# recorded in the page from its first script on: websocket messages (time, bytes), long tasks, Bokeh's index
_PAGE_PROBE = """
(() => {
  const k3 = window.__k3probe = {ws: [], longtasks: [], ws_open: null, doc: null, bokeh_views: null, roots: 0};
  const Native = window.WebSocket;
  class Probed extends Native {
    constructor(...args) {
      super(...args);
      this.addEventListener("open", () => { k3.ws_open = performance.now(); });
      this.addEventListener("message", (e) => {
        const n = typeof e.data === "string" ? e.data.length : (e.data.byteLength ?? e.data.size ?? 0);
        k3.ws.push([performance.now(), n]);
        // the pulled document (a PULL-DOC-REPLY's content): later view patches can be larger
        if (k3.doc === null && typeof e.data === "string" && e.data.startsWith('{"doc"')) { k3.doc = [performance.now(), n]; }
      });
    }
  }
  window.WebSocket = Probed;
  try {
    new PerformanceObserver((list) => {
      for (const e of list.getEntries()) k3.longtasks.push([e.startTime, e.duration]);
    }).observe({type: "longtask", buffered: true});
  } catch (e) {}
  const poll = () => {
    const B = window.Bokeh;
    if (B && B.index && k3.bokeh_views === null) {
      const n = Object.keys(B.index).length;
      if (n > 0) { k3.bokeh_views = performance.now(); k3.roots = n; }
    }
    if (k3.bokeh_views === null) requestAnimationFrame(poll);
  };
  requestAnimationFrame(poll);
})();
"""


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value / 1000.0, 3)


def one_open(address: str, empty: bool = False) -> dict:
    """One page open in a fresh browser (`empty`: the empty page, whose one text pane is all it waits for)."""
    with Browser() as browser:
        browser.page.add_init_script(_PAGE_PROBE)
        browser.cdp.send("Performance.enable")
        start = time.time()
        browser.page.goto(address, wait_until="commit", timeout=600_000)
        origin = browser.page.evaluate("performance.timeOrigin") / 1000.0  # epoch s of navigation start
        marks: dict = {}
        if empty:
            browser.page.locator(".k3-empty").first.wait_for(state="visible", timeout=120_000)
            marks["first_view"] = marks["first_screen"] = marks["all_views"] = marks["all_data"] = time.time() - origin
        else:
            browser.page.locator(".k3-view-session canvas").first.wait_for(state="visible", timeout=120_000)
            marks["first_view"] = time.time() - origin
            for selector in FIRST_SCREEN:
                browser.page.locator(f"{selector} canvas").first.wait_for(state="visible", timeout=120_000)
                browser.page.locator(f"{selector} .k3-has-data").first.wait_for(state="attached", timeout=120_000)
            marks["first_screen"] = time.time() - origin
            browser.wait_views(120_000)  # scrolling to each view in turn
            marks["all_views"] = time.time() - origin
            for selector in VIEW_SELECTORS.values():
                browser.page.locator(f"{selector} .k3-has-data").first.wait_for(state="attached", timeout=120_000)
            marks["all_data"] = time.time() - origin
        nav = browser.page.evaluate("JSON.stringify(performance.getEntriesByType('navigation')[0])")
        nav = json.loads(nav)
        probe = browser.page.evaluate("window.__k3probe")
        resources = browser.page.evaluate(
            "performance.getEntriesByType('resource').map(r => [r.name, r.startTime, r.responseEnd, r.transferSize])")
        metrics = {m["name"]: m["value"] for m in browser.cdp.send("Performance.getMetrics")["metrics"]}
        ws = probe["ws"]
        big = probe["doc"]
        scripts = [r for r in resources if r[0].endswith(".js")]
        out = {
            "goto_lag_s": round(origin - start, 3),
            "html_first_byte": _ms(nav["responseStart"]), "html_received": _ms(nav["responseEnd"]),
            "scripts_done": _ms(nav["domContentLoadedEventEnd"]),
            "scripts_fetched": _ms(max((r[2] for r in scripts), default=0)),
            "ws_open": _ms(probe["ws_open"]), "doc_received": _ms(big[0]) if big else None,
            "doc_bytes": big[1] if big else None, "ws_messages": len(ws), "ws_bytes": sum(m[1] for m in ws),
            "bokeh_views": _ms(probe["bokeh_views"]),
            **{k: round(v, 3) for k, v in marks.items()},
            "cpu": {k: round(metrics.get(k, 0.0), 3) for k in ("ScriptDuration", "LayoutDuration",
                                                               "RecalcStyleDuration", "TaskDuration")},
            "layouts": int(metrics.get("LayoutCount", 0)), "style_recalcs": int(metrics.get("RecalcStyleCount", 0)),
            "dom_nodes": browser.dom_nodes(),
            "long_tasks": len(probe["longtasks"]),
            "long_tasks_s": round(sum(d for _, d in probe["longtasks"]) / 1000.0, 3),
            "long_tasks_after_doc_s": round(sum(d for s, d in probe["longtasks"]
                                                if big and s >= big[0]) / 1000.0, 3),
            "static_files": len(resources), "static_bytes": sum(r[3] for r in resources),
            "console_errors": len(browser.counters.errors),
        }
        return out


def document_counts(trace: Path) -> dict:
    """Models and JSON bytes of the document a page of `trace` is served (built as the server builds it)."""
    from bokeh.document import Document

    page = dashboard_app.create_app(DashboardConfig(trace=trace, root=trace.parent), session_args={})
    document = Document()
    page.server_doc(document)
    try:
        models = list(document.models)
        payload = json.dumps(document.to_json(deferred=False), default=str)
        kinds = Counter(type(m).__name__ for m in models)
        return {"models": len(models), "json_bytes": len(payload), "by_type": dict(kinds.most_common(15))}
    finally:
        page.dashboard.close()


def profile_server(trace: Path, top: int) -> str:
    """cProfile of one page build (what the server does before answering the page request)."""
    from bokeh.document import Document

    config = DashboardConfig(trace=trace, root=trace.parent)
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    page = dashboard_app.create_app(config, session_args={})
    document = Document()
    page.server_doc(document)
    profiler.disable()
    elapsed = time.perf_counter() - started
    page.dashboard.close()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    calls = stats.total_calls  # type: ignore[attr-defined]
    stats.sort_stats("cumulative").print_stats(top)
    return f"page build {elapsed:.2f} s, {calls:,} Python calls\n" + text.getvalue()


def _empty_server() -> tuple[Any, str]:
    """The empty page of `bench_dashboard.py` (same template, one text pane) on a free port."""
    import panel as pn

    from k3testing.browser import free_port

    port = free_port()
    server = pn.serve({"/": lambda: pn.template.BootstrapTemplate(title="empty", main=[pn.pane.HTML(
        "<p>empty page</p>", css_classes=["k3-empty"])])}, port=port, address="127.0.0.1", show=False, threaded=True,
        websocket_origin=[f"127.0.0.1:{port}"])
    return server, f"http://127.0.0.1:{port}/"


def _median(opens: list[dict]) -> dict:
    keys = [k for k, v in opens[0].items() if isinstance(v, (int, float))]
    return {k: round(statistics.median(o[k] for o in opens), 3) for k in keys if all(o[k] is not None for o in opens)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, required=True)
    ap.add_argument("--opens", type=int, default=3)
    ap.add_argument("--profile-server", type=int, default=0, help="print the top N functions of a page build")
    ap.add_argument("--no-drive", action="store_true", help="serve without drive mode's sidebar controls")
    args = ap.parse_args()
    print(json.dumps({"document": document_counts(args.trace)}), flush=True)
    if args.profile_server:
        print(profile_server(args.trace, args.profile_server), flush=True)
    config = DashboardConfig(trace=args.trace, root=args.trace.parent, drive=not args.no_drive)
    server = start_server(config)
    empty, empty_url = _empty_server()
    try:
        time.sleep(1.0)
        one_open(url(config))  # the server's first page: the trace reduced, not timed
        opens, empties = [], []
        for _ in range(args.opens):  # interleaved with the empty page: the same moments of a shared machine
            empties.append(one_open(empty_url, empty=True))
            opens.append(one_open(url(config)))
            print(json.dumps(opens[-1]), flush=True)
    finally:
        server.stop()
        empty.stop()
    print(json.dumps({"empty_page_median": _median(empties)}))
    print(json.dumps({"median": _median(opens)}))


if __name__ == "__main__":
    main()
