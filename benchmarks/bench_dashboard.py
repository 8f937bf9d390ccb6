"""Dashboard performance in real headless Chromium: first paint, bytes to the browser, memory over time.

    python benchmarks/bench_dashboard.py                       # all three, default sizes
    python benchmarks/bench_dashboard.py --skip-1m --live-seconds 60

0. An empty Panel page (the same template, one text pane, no trace) served by the same server code:
   seconds from navigation to its text being visible. Part of every figure below, so it is measured
   in the same run as they are (the ratio view time / empty page is what the dashboard adds).
1. First paint of a 128K-token trace (demo dims, synthetic): seconds from navigation to (a) the first
   view drawn, (b) the session map showing the trace's data, (c) the first screen's views (session map,
   DSA map) drawn with data, (d) all four views drawn, scrolling to each in turn as a reader would (the
   views below the first screen join the page when scrolled near). Fresh browser profile each time (no
   cache), median of --repeats.
2. Opening a 1M-token synthetic trace at K3.1 Pro dims (24 DSA, 69 KDA x 96 heads, 92 MoE x 896
   experts): seconds to the first screen's views drawn with data and to every view (scrolling to each),
   bytes the browser received over HTTP (static JS/CSS, the same for any trace) and over the
   websocket (the data), until every view is drawn and a generated token's read-out is shown.
   With --reopen-1m, opened a second time on a fresh server: the dashboard's summaries of a finished
   trace (`workbench/trace/summary_cache.py`) written by the first open are read instead of the parts.
   With --recorded-1m, opened as `workbench run` leaves a trace: its summaries written into the trace
   directory (`write_summaries`), then a fresh server with an empty user cache (as on another machine).
3. Browser memory during a live session: a 128K trace replayed as if recorded (`TraceReplay`) for
   --live-seconds; JS heap after a forced GC and DOM node count every --sample-seconds.

Trees side by side (`--trees OLD NEW ...`, each a source tree such as `git worktree add /tmp/wt-HASH HASH`):
one dashboard server per tree (a subprocess importing that tree) on the same 128K trace and an empty
page in this process, opened in turn (a fresh browser each, the order alternating every round) for
--repeats rounds; prints each tree's median first paint, its ratio to the first tree's, and what it adds
to the empty page measured in the same rounds. On a loaded machine this is the figure to read.

The summary cache lives in a fresh temporary directory unless --summary-cache names one, so every
figure but a --reopen-1m one is a first open of the trace (the first repeat of (1) opens it on a fresh
server; later repeats are reloads, answered from the server's shared reducers).

Prints one JSON document (and writes it to --out). Needs /usr/bin/chromium and Playwright.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the synthetic-trace harness is test scaffolding at the repository root, not an installed package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from k3testing.synthetic import Dims, trace_bytes, write_synthetic_trace  # noqa: E402

from workbench.analysis.views import shared_reducers
from workbench.trace import summary_cache
from apps.dashboard.app import DashboardConfig, url
from k3testing.browser import VIEW_SELECTORS, Browser, chromium_available, start_server
from k3testing.replay import TraceReplay
from workbench.analysis.views.summaries import write_summaries

# the views a 1400 x 1000 window shows before any scrolling; the others join a served page when scrolled near
# (`apps/dashboard/components/seen.py`), so "every view" is measured scrolling to each in turn (`wait_views`)
FIRST_SCREEN = ("session", "dsa")


def _trace(path: Path | None, work: Path, name: str, tokens: int, dims: Dims) -> Path:
    if path is not None:
        return path
    out = work / name
    started = time.perf_counter()
    write_synthetic_trace(out, tokens, dims, overwrite=True)
    print(f"wrote {name} ({tokens:,} tokens, {trace_bytes(out)['total'] / 2**20:.0f} MiB) in "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    return out


def empty_page(repeats: int) -> dict:
    """Seconds from navigation to a text pane drawn on an otherwise empty page (same template, server, browser)."""
    import panel as pn

    from k3testing.browser import free_port

    port = free_port()

    def app() -> pn.viewable.Viewable:
        return pn.template.BootstrapTemplate(title="empty", main=[pn.pane.HTML("<p>empty page</p>",
                                                                              css_classes=["k3-empty"])])

    server = pn.serve({"/": app}, port=port, address="127.0.0.1", show=False, threaded=True,
                      websocket_origin=[f"127.0.0.1:{port}"])
    runs = []
    try:
        time.sleep(1.0)
        for _ in range(repeats):
            with Browser() as browser:
                runs.append(browser.open(f"http://127.0.0.1:{port}/", wait_for=".k3-empty", timeout_ms=120_000))
    finally:
        server.stop()
    return {"runs": [round(r, 2) for r in runs], "median_s": round(statistics.median(runs), 2)}


def _wait_data(browser: Browser, timeout_ms: int) -> float | None:
    """perf_counter() once every view shows data from the trace (its `k3-has-data` marker); None for a
    dashboard without the markers (the code before views had them), so old and new can be compared."""
    try:
        import apps.dashboard.components.base  # noqa: F401  (the markers came with ViewComponent)
    except ImportError:
        return None
    for selector in VIEW_SELECTORS.values():
        browser.page.locator(f"{selector} .k3-has-data").first.wait_for(state="attached", timeout=timeout_ms)
    return time.perf_counter()


def _wait_first_screen(browser: Browser, timeout_ms: int) -> float:
    """perf_counter() once the views of the first screen (a 1400 x 1000 window, no scrolling: the session map
    and the DSA map) are drawn with data from the trace (a canvas each, and the data marker where the tree's
    views have one)."""
    for name in FIRST_SCREEN:
        browser.page.locator(f"{VIEW_SELECTORS[name]} canvas").first.wait_for(state="visible", timeout=timeout_ms)
        try:
            browser.page.locator(f"{VIEW_SELECTORS[name]} .k3-has-data").first.wait_for(state="attached",
                                                                                        timeout=timeout_ms)
        except Exception:  # a tree without the markers: its canvas is what it shows
            pass
    return time.perf_counter()


def first_paint(trace: Path, repeats: int) -> dict:
    config = DashboardConfig(trace=trace, root=trace.parent)
    server = start_server(config)
    runs = []
    try:
        for _ in range(repeats):
            with Browser() as browser:
                start = time.perf_counter()
                browser.page.goto(url(config), wait_until="commit", timeout=600_000)
                browser.page.locator(".k3-view-session canvas").first.wait_for(state="visible", timeout=120_000)
                first_view = time.perf_counter() - start
                browser.page.get_by_text("complete").first.wait_for(timeout=120_000)
                with_data = time.perf_counter() - start
                first_screen = _wait_first_screen(browser, 120_000) - start
                browser.wait_views(120_000)
                all_views = time.perf_counter() - start
                with_data_all = _wait_data(browser, 120_000)
                runs.append({"first_view_s": first_view, "session_data_s": with_data,
                             "first_screen_with_data_s": first_screen, "all_views_s": all_views,
                             "all_views_with_data_s": with_data_all and with_data_all - start,
                             "console_errors": len(browser.counters.errors)})
    finally:
        server.stop()
    summary = {k: round(statistics.median(r[k] for r in runs), 2) for k in ("first_view_s", "session_data_s",
                                                                            "first_screen_with_data_s", "all_views_s")}
    if all(r["all_views_with_data_s"] is not None for r in runs):
        summary["all_views_with_data_s"] = round(statistics.median(r["all_views_with_data_s"] for r in runs), 2)
    return {"trace": str(trace), "runs": runs, "median": summary}


def bytes_to_browser(trace: Path) -> dict:
    config = DashboardConfig(trace=trace, root=trace.parent)
    server = start_server(config)
    try:
        with Browser() as browser:
            start = time.perf_counter()
            browser.page.goto(url(config), wait_until="commit", timeout=600_000)
            browser.page.get_by_text("complete").first.wait_for(timeout=600_000)
            first_screen = _wait_first_screen(browser, 600_000) - start
            browser.wait_views(600_000)  # scrolling to each view in turn
            loaded = time.perf_counter() - start
            with_data = _wait_data(browser, 600_000)
            time.sleep(2)  # a deferred view's first update may still be in flight
            at_open = (browser.counters.http_bytes, browser.counters.ws_bytes)
            shown = browser.page.locator(".k3-dsa-tokens .k3-token").count()
            if shown > 5:
                browser.page.locator(".k3-dsa-tokens .k3-token").nth(5).click()
                browser.page.locator(".k3-dsa-readout table.k3-reads").wait_for(timeout=120_000)
                time.sleep(1)
            # else: the generated text never reached the page (before `apps/dashboard/page_gate.py`, about
            # half the first opens at 1M); report it instead of failing the run
            return {"generated_tokens_shown": shown, "trace": str(trace), "trace_bytes_on_disk": trace_bytes(trace)["total"],
                    "seconds_to_first_screen_with_data": round(first_screen, 2),
                    "seconds_to_all_views_with_data": round(loaded, 1),
                    "seconds_to_every_view_showing_trace_data": with_data and round(with_data - start, 1),
                    "http_bytes_static": at_open[0], "ws_bytes_at_open": at_open[1],
                    "ws_bytes_after_token_click": browser.counters.ws_bytes,
                    "ws_frames": browser.counters.ws_frames, "js_heap_bytes": browser.js_heap(),
                    "console_errors": browser.counters.errors}
    finally:
        server.stop()


def live_memory(source: Path, work: Path, seconds: float, sample: float) -> dict:
    target = work / "live"
    replay = TraceReplay(source, target, seconds=seconds * 0.8, decode_rate=None, interval=0.5)
    config = DashboardConfig(trace=target, root=work)
    server = start_server(config)
    samples = []
    try:
        with Browser() as browser:
            browser.open(url(config), wait_for=".k3-view-session canvas")
            browser.wait_views()
            replay.start()
            start = time.perf_counter()
            while True:
                elapsed = time.perf_counter() - start
                samples.append({"t_s": round(elapsed, 1), "js_heap_bytes": browser.js_heap(),
                                "dom_nodes": browser.dom_nodes(), "ws_bytes": browser.counters.ws_bytes})
                if elapsed >= seconds:
                    break
                time.sleep(max(0.0, min(sample, seconds - elapsed)))
            errors = browser.counters.errors
    finally:
        replay.stop()
        replay.join(10)
        server.stop()
    heaps = [s["js_heap_bytes"] for s in samples]
    half = len(heaps) // 2
    return {"seconds": seconds, "samples": samples, "heap_min": min(heaps), "heap_max": max(heaps),
            "heap_first_half_max": max(heaps[: max(half, 1)]), "heap_second_half_max": max(heaps[half:]),
            "console_errors": errors, "replay_error": repr(replay.error) if replay.error else None}


def as_recorded(trace: Path, work: Path) -> dict:
    """Open `trace` as the recording command leaves it: `write_summaries` into a copy of the trace (hard
    links: the parts are not copied, and the original gains nothing), then a fresh server and an empty user
    cache, as on another machine the trace was copied to."""
    copy = work / "as-recorded"
    for src in trace.rglob("*"):
        if src.is_file() and summary_cache.TRACE_DIR not in src.relative_to(trace).parts:
            dst = copy / src.relative_to(trace)
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:  # another file system
                shutil.copyfile(src, dst)
    shared_reducers.forget_all()
    started = time.perf_counter()
    written = write_summaries(copy)
    summarize_s = time.perf_counter() - started
    os.environ["K3WB_DASHBOARD_CACHE"] = str(work / "empty-user-cache")
    shared_reducers.forget_all()
    out = bytes_to_browser(copy)
    out.update(summaries_written=written, write_summaries_s=round(summarize_s, 1),
               summaries_bytes=sum(p.stat().st_size for p in (copy / summary_cache.TRACE_DIR).rglob("*") if p.is_file()))
    return out


def _serve_tree(tree: Path, trace: Path, cache: Path) -> tuple[subprocess.Popen, str]:
    """A dashboard server of `trace` run by the code of `tree` (its own process); returns it and its URL."""
    import socket

    from k3testing.browser import free_port

    port = free_port()
    code = ("from pathlib import Path; from apps.dashboard.app import DashboardConfig, serve; "
            f"serve(DashboardConfig(trace=Path({str(trace)!r}), root=Path({str(trace.parent)!r}), port={port}))")
    env = dict(os.environ, PYTHONPATH=str(tree), K3WB_DASHBOARD_CACHE=str(cache))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tree, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"http://127.0.0.1:{port}/"
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the dashboard of {tree} did not start")


def _open(address: str, wait_for: str | None = None) -> dict:
    """One page open in a fresh browser: seconds to the session map drawn, its data, every view, every view
    with data (None where the tree's views carry no data markers); `wait_for`: only that selector."""
    with Browser() as browser:
        start = time.perf_counter()
        browser.page.goto(address, wait_until="commit", timeout=600_000)
        if wait_for:
            browser.page.locator(wait_for).first.wait_for(state="visible", timeout=120_000)
            return {"first_view_s": time.perf_counter() - start}
        browser.page.locator(".k3-view-session canvas").first.wait_for(state="visible", timeout=120_000)
        out = {"first_view_s": time.perf_counter() - start}
        browser.page.get_by_text("complete").first.wait_for(timeout=120_000)
        out["session_data_s"] = time.perf_counter() - start
        out["first_screen_with_data_s"] = _wait_first_screen(browser, 120_000) - start
        browser.wait_views(120_000)  # scrolling to each view in turn
        out["all_views_s"] = time.perf_counter() - start
        try:
            for selector in VIEW_SELECTORS.values():
                browser.page.locator(f"{selector} .k3-has-data").first.wait_for(state="attached", timeout=30_000)
            out["all_views_with_data_s"] = time.perf_counter() - start
        except Exception:  # a tree without the markers
            out["all_views_with_data_s"] = None
        return out


def compare_trees(trees: list[Path], trace: Path, repeats: int, work: Path) -> dict:
    """First paint of `trace` served by each tree, interleaved with an empty page (see the module docstring)."""
    import panel as pn

    from k3testing.browser import free_port

    port = free_port()
    empty = pn.serve({"/": lambda: pn.template.BootstrapTemplate(title="empty", main=[pn.pane.HTML(
        "<p>empty page</p>", css_classes=["k3-empty"])])}, port=port, address="127.0.0.1", show=False, threaded=True,
        websocket_origin=[f"127.0.0.1:{port}"])
    servers = [_serve_tree(tree, trace, work / f"cache-{i}") for i, tree in enumerate(trees)]
    runs: dict[str, list[dict]] = {"empty": [], **{str(t): [] for t in trees}}
    try:
        time.sleep(1.0)
        for _, address in servers:  # each server's first open reduces the trace: not timed
            _open(address)
        for r in range(repeats):
            order = list(range(len(trees)))
            order = order if r % 2 == 0 else order[::-1]
            runs["empty"].append(_open(f"http://127.0.0.1:{port}/", wait_for=".k3-empty"))
            for i in order:
                runs[str(trees[i])].append(_open(servers[i][1]))
            print(json.dumps({"round": r + 1, **{k: round(v[-1]["first_view_s"], 2) for k, v in runs.items()}}),
                  flush=True)
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait(30)
        empty.stop()
    empty_s = statistics.median(x["first_view_s"] for x in runs["empty"])
    out: dict = {"empty_page_s": round(empty_s, 2), "rounds": repeats, "trees": {}}
    base: dict = {}
    for tree in map(str, trees):
        med = {k: round(statistics.median(x[k] for x in runs[tree]), 2) for k in runs[tree][0]
               if all(x[k] is not None for x in runs[tree])}
        base = base or med
        out["trees"][tree] = {"median": med, "over_empty_page_s": {k: round(v - empty_s, 2) for k, v in med.items()},
                              "ratio_to_first_tree": {k: round(v / base[k], 3) for k, v in med.items() if k in base},
                              "runs": runs[tree]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace-128k", type=Path, help="reuse a 128K trace instead of writing one")
    ap.add_argument("--trace-1m", type=Path, help="reuse a 1M-token K3.1 Pro-dims trace instead of writing one")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--live-seconds", type=float, default=300.0)
    ap.add_argument("--sample-seconds", type=float, default=15.0)
    ap.add_argument("--skip-1m", action="store_true")
    ap.add_argument("--skip-live", action="store_true")
    ap.add_argument("--reopen-1m", action="store_true",
                    help="open the 1M trace again on a fresh server (warm summaries)")
    ap.add_argument("--recorded-1m", action="store_true",
                    help="open the 1M trace as `workbench run` leaves it (summaries written into a linked copy "
                         "of the trace) on a fresh server with an empty user cache")
    ap.add_argument("--summary-cache", type=Path, help="the dashboard's summary cache (default: a fresh temporary one)")
    ap.add_argument("--out", type=Path, default=Path("artifacts/bench_dashboard.json"))
    ap.add_argument("--trees", type=Path, nargs="+", help="source trees whose dashboards open the 128K trace "
                    "side by side, interleaved (the first is the baseline); nothing else is measured")
    args = ap.parse_args()
    if not chromium_available():
        raise SystemExit("needs /usr/bin/chromium (apt-get install chromium)")
    if args.trees:
        with tempfile.TemporaryDirectory(prefix="k3wb-bench-") as tmp:
            t128 = _trace(args.trace_128k, Path(tmp), "demo-128k", 131072, Dims.demo())
            result = compare_trees([t.resolve() for t in args.trees], t128, args.repeats, Path(tmp))
        for tree, r in result["trees"].items():
            print(json.dumps({"tree": tree, "median": r["median"], "over_empty_page_s": r["over_empty_page_s"],
                              "ratio_to_first_tree": r["ratio_to_first_tree"]}))
        print(json.dumps({"empty_page_s": result["empty_page_s"], "rounds": result["rounds"]}))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        return
    with tempfile.TemporaryDirectory(prefix="k3wb-bench-") as tmp:
        work = Path(tmp)
        os.environ["K3WB_DASHBOARD_CACHE"] = str(args.summary_cache or work / "summary-cache")
        results: dict = {"empty_page": empty_page(args.repeats)}
        print(json.dumps({"empty_page_s": results["empty_page"]["median_s"]}), flush=True)
        t128 = _trace(args.trace_128k, work, "demo-128k", 131072, Dims.demo())
        results["first_paint_128k"] = first_paint(t128, args.repeats)
        empty = results["empty_page"]["median_s"]
        paint = results["first_paint_128k"]["median"]
        # side by side: what the dashboard adds to an empty page served and drawn in the same run
        paint["empty_page_s"] = empty
        paint["over_empty_page_s"] = {k: round(paint[k] - empty, 2) for k in list(paint) if k.endswith("_s")
                                      and k != "empty_page_s"}
        print(json.dumps(paint), flush=True)
        if not args.skip_1m:
            t1m = _trace(args.trace_1m, work, "pro-1m", 1 << 20, Dims.k31_pro())
            if (t1m / summary_cache.TRACE_DIR).exists():
                print(f"note: {t1m} holds summaries ({summary_cache.TRACE_DIR}/): its first open is not a cold one",
                      flush=True)
            results["open_1m_k31_pro"] = bytes_to_browser(t1m)
            results["open_1m_k31_pro"]["trace_holds_summaries"] = (t1m / summary_cache.TRACE_DIR).exists()
            results["open_1m_k31_pro"]["empty_page_s"] = results["empty_page"]["median_s"]
            print(json.dumps({k: v for k, v in results["open_1m_k31_pro"].items() if k != "trace"}), flush=True)
            if args.reopen_1m:
                shared_reducers.forget_all()  # as a fresh server process: only the on-disk summaries remain
                results["reopen_1m_k31_pro"] = bytes_to_browser(t1m)
                print(json.dumps({"reopen": {k: v for k, v in results["reopen_1m_k31_pro"].items() if k != "trace"}}),
                      flush=True)
            if args.recorded_1m:
                results["recorded_1m_k31_pro"] = as_recorded(t1m, work)
                print(json.dumps({"as recorded": {k: v for k, v in results["recorded_1m_k31_pro"].items()
                                                  if k != "trace"}}), flush=True)
        if not args.skip_live:
            results["live_memory"] = live_memory(t128, work, args.live_seconds, args.sample_seconds)
            live = results["live_memory"]
            print(json.dumps({k: live[k] for k in ("heap_min", "heap_max", "heap_first_half_max",
                                                   "heap_second_half_max")}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
