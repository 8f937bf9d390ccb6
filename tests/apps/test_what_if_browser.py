"""Drive mode's What if in real headless Chromium (issue 39): after an answer, a typed START:END range is
hidden beside 8 disjoint controls, the panel shows the verdict, and the effects view shows the rerun
without a page reload."""

from __future__ import annotations

import time
from pathlib import Path

from workbench.causal.reruns import RANGE

from tests.apps.served_page import BROWSER, drive_config, generate, served_page, wait_until

pytestmark = BROWSER


def test_what_if_range_verdict_and_live_effects_view(tmp_path: Path) -> None:
    with served_page(drive_config(tmp_path / "traces", new_tokens=4), every_view=True, height=3400) as browser:
        generate(browser, "The vault code is 4-7-1-9. " * 8, 240)
        what_if = browser.page.locator(".k3-what-if")
        button = browser.page.get_by_role("button", name="Rerun last answer")
        choices = what_if.locator("select").first
        wait_until(lambda: RANGE in choices.locator("option").all_inner_texts(), 120)  # once the recording closed
        choices.select_option(label=RANGE)
        positions = what_if.locator("input[type=text]").first
        positions.fill("3:9")
        positions.press("Enter")
        time.sleep(0.5)
        button.click()
        answers = browser.page.locator(".k3-what-if-answers pre")
        wait_until(lambda: "verdict:" in " ".join(answers.all_inner_texts()), 90)
        text = " ".join(answers.all_inner_texts())
        alerts = browser.page.locator(".k3-what-if .alert").all_inner_texts()
        assert "positions [3, 9) hidden from DSA every layer" in text, alerts
        assert "verdict: hiding positions [3, 9)" in text
        assert "8 random spans of the same size" in text
        effects = browser.page.locator(".k3-view-effects .k3-effects-check")
        # live: the rerun reaches the effects view without a reload
        assert wait_until(lambda: "what if: positions [3, 9)" in " ".join(effects.all_inner_texts()), 30)
        assert browser.counters.errors == []
