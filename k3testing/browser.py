"""Headless-browser harness shared by the dashboard's browser test and `benchmarks/bench_dashboard.py`.

- `start_server(config)`: the dashboard on a free local port in a background thread.
- `Browser`: Debian's Chromium driven by Playwright (never a downloaded browser), with a fresh
  profile, no network beyond the dashboard, and counters read over the Chrome DevTools Protocol:
  console errors, bytes received (HTTP responses + websocket frames) and the JS heap.

Playwright is imported lazily, so importing the dashboard never needs it.
"""

from __future__ import annotations

import base64
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--enable-precise-memory-info"]

# selectors of the four views (css_classes set by the components) and of things inside them
VIEW_SELECTORS = {"session": ".k3-view-session", "dsa": ".k3-view-dsa", "kda": ".k3-view-kda",
                  "experts": ".k3-view-experts"}


def chromium_available() -> bool:
    return Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(config: Any) -> Any:
    """Serve `config` (a DashboardConfig; its port is replaced by a free one) in a thread; returns the server."""
    from apps.dashboard.app import serve

    config.port = free_port()
    server = serve(config, threaded=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", config.port), timeout=0.5):
                return server
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"dashboard server did not start on port {config.port}")


@dataclass
class Counters:
    """What the browser saw: console errors, bytes received over HTTP and the websocket."""

    errors: list[str] = field(default_factory=list)
    http_bytes: int = 0
    ws_bytes: int = 0
    ws_frames: int = 0
    external: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return self.http_bytes + self.ws_bytes


class Browser:
    """A headless Chromium page with CDP counters. Use as a context manager."""

    def __init__(self, width: int = 1400, height: int = 1000, extra_args: tuple[str, ...] = ()) -> None:
        self.width, self.height = width, height
        self.extra_args = list(extra_args)
        self.counters = Counters()
        self._profile = tempfile.mkdtemp(prefix="k3wb-chromium-")

    def __enter__(self) -> "Browser":
        from playwright.sync_api import sync_playwright

        self._pw = sync_playwright().start()
        self.context = self._pw.chromium.launch_persistent_context(
            self._profile, executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS + self.extra_args,
            viewport={"width": self.width, "height": self.height})
        self.page = self.context.pages[0] if self.context.pages else self.context.new_page()
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda exc: self.counters.errors.append(f"pageerror: {exc}"))
        self.page.on("request", self._request)
        self.cdp = self.context.new_cdp_session(self.page)
        self.cdp.send("Network.enable")
        self.cdp.on("Network.loadingFinished", self._loaded)
        self.cdp.on("Network.webSocketFrameReceived", self._frame)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.context.close()
        finally:
            self._pw.stop()
            shutil.rmtree(self._profile, ignore_errors=True)

    def _console(self, msg: Any) -> None:
        if msg.type == "error":
            self.counters.errors.append(f"console: {msg.text}")

    def _request(self, request: Any) -> None:
        if not request.url.startswith(("http://127.0.0.1", "ws://127.0.0.1", "blob:", "data:", "http://localhost")):
            self.counters.external.append(request.url)

    def _loaded(self, params: dict) -> None:
        self.counters.http_bytes += int(params.get("encodedDataLength", 0))

    def _frame(self, params: dict) -> None:
        response = params.get("response", {})
        data = response.get("payloadData", "")
        # opcode 1 = text (UTF-8 as is); anything else arrives base64-encoded
        size = len(data.encode()) if response.get("opcode") == 1 else len(base64.b64decode(data or ""))
        self.counters.ws_bytes += size
        self.counters.ws_frames += 1

    def js_heap(self, collect: bool = True) -> int:
        """Bytes of JS heap in use (after a garbage collection when `collect`)."""
        if collect:
            self.cdp.send("HeapProfiler.collectGarbage")
        return int(self.cdp.send("Runtime.getHeapUsage")["usedSize"])

    def dom_nodes(self) -> int:
        return int(self.cdp.send("Memory.getDOMCounters")["nodes"])

    def open(self, url: str, wait_for: str | None = ".k3-view-session canvas", timeout_ms: int = 60_000) -> float:
        """Navigate and wait for `wait_for` to be visible; returns seconds from navigation to that point."""
        start = time.perf_counter()
        self.page.goto(url, wait_until="commit", timeout=timeout_ms)
        if wait_for:
            self.page.locator(wait_for).first.wait_for(state="visible", timeout=timeout_ms)
        return time.perf_counter() - start

    def wait_views(self, timeout_ms: int = 60_000) -> None:
        """Wait until every view has at least one drawn canvas, scrolling to each in turn as a reader would
        (a served page builds a view below the first screen when it is scrolled near: its placeholder
        `.k3-unseen-NAME`, `apps/dashboard/components/seen.py`)."""
        for name, selector in VIEW_SELECTORS.items():
            self.page.locator(f"{selector}, .k3-unseen-{name}").first.scroll_into_view_if_needed(timeout=timeout_ms)
            self.page.locator(f"{selector} canvas").first.wait_for(state="visible", timeout=timeout_ms)
