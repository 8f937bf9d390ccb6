"""The served dashboard page that every Chromium test of the dashboard starts from, set up in one place.

- `BROWSER`: the marks of a test that drives Debian's Chromium (skipped where it is not installed);
- `served_page(config, ...)`: the dashboard served on a free port and opened in Chromium, both stopped after;
- `drive_config`, `generate`, `session_status`, `wait_until`: the drive-mode and polling steps those tests share.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from apps.dashboard.app import DashboardConfig, url
from k3testing.browser import Browser, chromium_available, start_server

BROWSER = [pytest.mark.browser,
           pytest.mark.skipif(not chromium_available(),
                              reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium; "
                                     ".ci/run installs it)")]


class OpenedBrowser(Browser):
    """A `Browser` that keeps how long its first page took to show (`Browser.open`'s seconds)."""

    opened_s: float = 0.0


def drive_config(root: Path, model: str = "preset:tiny", **settings: Any) -> DashboardConfig:
    """Drive mode on `model`, recording under `root`, frames applied every 250 ms (so a test sees a run live)."""
    return DashboardConfig(root=root, model=model, refresh_ms=250, **settings)


@contextmanager
def served_page(config: DashboardConfig, trace: str | None = None, wait_for: str = ".k3-view-session canvas",
                every_view: bool = False, **window: Any) -> Iterator[OpenedBrowser]:
    """Serve `config` (its port is set to a free one) and open it in Chromium (`window`: `Browser`'s width,
    height, extra_args) at the page of `trace`, a name under the root; waits for `wait_for` to show, and
    for every view to draw when `every_view`. The browser closes and the server stops however the test ends."""
    server = start_server(config)
    try:
        with OpenedBrowser(**window) as browser:
            browser.opened_s = browser.open(url(config, trace=trace), wait_for=wait_for)
            if every_view:
                browser.wait_views()
            yield browser
    finally:
        server.stop()


def wait_until(check: Callable[[], object], timeout: float, poll: float = 0.3) -> bool:
    """Poll `check` until it holds or `timeout` seconds pass; returns whether it held (the caller asserts it
    where it must, with its own message)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)
    return True


def session_status(browser: Browser) -> str:
    """The session view's status line ("recording ...", "complete ...")."""
    return browser.page.locator(".k3-view-session pre").first.inner_text()


def generate(browser: Browser, prompt: str | None, timeout: float,
             done: Callable[[], object] | None = None) -> bool:
    """Type `prompt` into drive mode's prompt box (None: leave it as it is) and click Generate; returns
    whether `done` (default: the session view reads "complete") held within `timeout` seconds."""
    if prompt is not None:
        browser.page.locator(".k3-runner textarea").first.fill(prompt)
    browser.page.get_by_role("button", name="Generate").click()
    return wait_until(done or (lambda: session_status(browser).startswith("complete")), timeout)
