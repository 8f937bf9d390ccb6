"""Drive mode's What if in real headless Chromium (issue 39): after an answer, a typed START:END range is
hidden beside 8 disjoint controls, the panel shows the verdict, and the effects view shows the rerun
without a page reload."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from apps.dashboard.app import DashboardConfig, url
from k3testing.browser import Browser, chromium_available, start_server
from workbench.causal.reruns import RANGE

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not chromium_available(),
                                 reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium; "
                                        ".ci/run installs it)")]


def test_what_if_range_verdict_and_live_effects_view(tmp_path: Path) -> None:
    config = DashboardConfig(root=tmp_path / "traces", model="preset:tiny", new_tokens=4, refresh_ms=250)
    server = start_server(config)
    try:
        with Browser(height=3400) as browser:
            browser.open(url(config), wait_for=".k3-view-session canvas")
            browser.wait_views()
            browser.page.locator(".k3-runner textarea").first.fill("The vault code is 4-7-1-9. " * 8)
            browser.page.get_by_role("button", name="Generate").click()
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                if browser.page.locator(".k3-view-session pre").first.inner_text().startswith("complete"):
                    break
                time.sleep(0.3)
            what_if = browser.page.locator(".k3-what-if")
            button = browser.page.get_by_role("button", name="Rerun last answer")
            choices = what_if.locator("select").first
            deadline = time.monotonic() + 120
            while RANGE not in choices.locator("option").all_inner_texts() and time.monotonic() < deadline:
                time.sleep(0.3)   # offered once the recording closed
            choices.select_option(label=RANGE)
            positions = what_if.locator("input[type=text]").first
            positions.fill("3:9")
            positions.press("Enter")
            time.sleep(0.5)
            button.click()
            answers = browser.page.locator(".k3-what-if-answers pre")
            deadline = time.monotonic() + 90
            while "verdict:" not in " ".join(answers.all_inner_texts()) and time.monotonic() < deadline:
                time.sleep(0.3)
            text = " ".join(answers.all_inner_texts())
            alerts = browser.page.locator(".k3-what-if .alert").all_inner_texts()
            assert "positions [3, 9) hidden from DSA every layer" in text, alerts
            assert "verdict: hiding positions [3, 9)" in text
            assert "8 random spans of the same size" in text
            effects = browser.page.locator(".k3-view-effects .k3-effects-check")

            def shown() -> str:
                return " ".join(effects.all_inner_texts())

            deadline = time.monotonic() + 30
            while "what if: positions [3, 9)" not in shown() and time.monotonic() < deadline:
                time.sleep(0.3)
            assert "what if: positions [3, 9)" in shown()      # live: no reload
            assert browser.counters.errors == []
    finally:
        server.stop()
